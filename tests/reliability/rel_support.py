"""Helpers of the reliability tests: keys and payloads that check themselves, a daemon in
a subprocess (kill, restart, RSS), an audit of an NVMe folder, in-memory tiers with
fault hooks for manager-level tests.

Payloads are derived from keys (:func:`payload`), so any byte served can be checked
against its key: a partial, shifted, stale or foreign block never passes.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import lmdb
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.common.errors import TierFull, TierIOError
from tiers.base import Tier, TierKind, check_ranges

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # workers run outside pytest
from support.toml_config import write_toml  # noqa: E402,F401  (the suite's one TOML writer)

ROOT = pathlib.Path(__file__).resolve().parents[2]
INDEX_VALUE = struct.Struct("<QQd")      # tiers/nvme/tier.py's index value: size, xxh3_64, time
PAGE = 4096


# ---------------------------------------------------------------------------- keys, payloads

def key(i: int, tag: str = "k") -> bytes:
    """A 32-byte block key, well spread (the NVMe tier fans files out by its first bytes)."""
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


def size_for(k: bytes, lo: int = 1024, hi: int = 256 << 10) -> int:
    """A payload size in ``[lo, hi)`` bytes derived from the key."""
    return lo + int.from_bytes(k[:4], "big") % (hi - lo)


def payload(k: bytes, n: int | None = None, variant: int = 0) -> bytes:
    """``n`` bytes (default :func:`size_for`) derived from the key and the position in the
    block (SHAKE-128 stream): truncated, shifted or foreign data never matches."""
    n = size_for(k) if n is None else n
    return hashlib.shake_128(b"payload/%d/" % variant + k).digest(n)


def is_payload_of(k: bytes, data: bytes, n: int | None = None) -> bool:
    n = size_for(k) if n is None else n
    return len(data) == n and data == payload(k, n)


# ---------------------------------------------------------------------------- config files

def short_socket_dir() -> pathlib.Path:
    """A short folder for unix sockets (their paths are limited to ~107 bytes)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="kvs-rel-"))


# ---------------------------------------------------------------------------- daemon process

class DaemonProcess:
    """``kvstore serve --config FILE`` in a subprocess.

    Args:
        config: the TOML file.
        address: the gRPC target it listens on (``unix:...`` or ``127.0.0.1:port``).
        log_path: stdout and stderr of the daemon go here (shown when it fails to start).
    """

    def __init__(self, config: pathlib.Path, address: str, log_path: pathlib.Path):
        self.config = config
        self.address = address
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 120.0) -> "DaemonProcess":
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        finally:
            log.close()
        if wait:
            self.wait_ready(timeout)
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until the health service says SERVING (a generous deadline: a daemon starts in
        about a second, but in tens of seconds on a saturated machine). Raises RuntimeError
        with the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with grpc.insecure_channel(self.address) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout}s:\n{self.log_tail()}")

    def wait_stopped(self, timeout: float = 60.0) -> None:
        """After SIGSTOP: wait until every thread of the daemon is stopped (``T`` in
        ``/proc/PID/task/*/stat``); ``kill`` returns before a loaded machine has stopped them,
        and a thread still running could answer one more call. Raises RuntimeError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for stat in pathlib.Path(f"/proc/{self.pid}/task").glob("*/stat"):
                try:
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    continue
            if states and all(s in ("T", "t") for s in states):
                return
            time.sleep(0.01)
        raise RuntimeError(f"daemon {self.pid} not stopped after {timeout}s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful: the tiers are closed) and wait; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"daemon ignored SIGTERM for {timeout}s:\n{self.log_tail()}")
        return self.proc.returncode

    def status(self, field: str) -> int:
        """A ``kB`` field of ``/proc/PID/status`` in bytes (VmRSS, VmHWM = peak RSS)."""
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)


# ---------------------------------------------------------------------------- NVMe audit

def nvme_audit(path: pathlib.Path, verify_checksums: bool = True) -> dict:
    """Compare a closed NVMe tier folder's index with its block files (see
    :func:`tiers.nvme.repair.audit_folder`: the counts, and ``keys``, the indexed keys)."""
    from tiers.nvme.repair import audit_folder
    return audit_folder(path, verify_payload=verify_checksums)


# ---------------------------------------------------------------------------- in-memory tiers

from support.fake_tiers import MemTier  # noqa: E402,F401  (the suite's one fake tier)


def run_in_thread(fn, *args, **kwargs):
    """Start ``fn`` in a daemon thread; returns ``(thread, box)`` where ``box`` gets
    ``"result"`` or ``"error"``."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box
