"""``kvstore serve`` stops on SIGTERM whichever of its threads the kernel hands the signal to.

A process-directed signal goes to any thread that does not block it; CPython then only sets a
flag that the main thread acts on when it next runs Python code. A main thread parked in a wait
without a timeout slept through a SIGTERM that landed on a gRPC or tier thread, so the daemon
never stopped (seen about once in four restarts under load). The test sends SIGTERM to one
thread that is not the main thread (``tgkill``), every time.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import pytest

from kvstore.client.client import KVStoreClient
from support.daemon import short_socket_dir

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or SYS_TGKILL is None,
                                reason="needs Linux tgkill to signal one thread of another process")


def tgkill(pid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}) failed")


def test_sigterm_delivered_to_another_thread_stops_the_daemon(tmp_path):
    sock = f"unix:{short_socket_dir()}/kvstore.sock"
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[server]\nlisten = "{sock}"\n[tiers.host]\ncapacity = "4MiB"\n'
                   f'[tiers.nvme]\npath = "{tmp_path / "nvme"}"\ncapacity = "16MiB"\n')
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        with KVStoreClient(sock) as c:
            c.wait_ready(timeout=180)
            c.put([(b"k" * 32, b"kv" * 512)])
        others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        assert others, "the daemon runs worker threads"
        tgkill(proc.pid, others[-1], signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        log.close()
    assert "kvstore stopped" in (tmp_path / "serve.log").read_text()
