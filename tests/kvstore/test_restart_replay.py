"""Acceptance: SIGKILL the daemon after a replay, restart it, replay again: every block that
was on NVMe is served, nothing corrupt; a flipped byte in one NVMe file makes exactly that
block miss."""

import pathlib
import signal
import subprocess
import sys

import pytest

from support.daemon import CONVERSATION_TRACE, short_socket_dir
from kvstore.client.client import KVStoreClient
from kvstore.tools.replay import replay, trace_key
from kvstore.tools.trace import read_mooncake_trace

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason=f"trace not found: {CONVERSATION_TRACE}")]

N_REQUESTS = 150
BPT = 16  # 8 KiB blocks (a host tier of 200 blocks: 1.6 MiB, above the 1 MiB minimum)


def start_daemon(cfg: pathlib.Path, sock: str) -> subprocess.Popen:
    """Start ``kvstore serve`` (its log goes to a file beside the config: a pipe nobody
    reads would block the daemon once full) and wait until it serves; a daemon that does
    not come up is killed, never left behind."""
    log = open(cfg.with_suffix(".log"), "a")
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    try:
        with KVStoreClient(sock) as c:
            c.wait_ready(timeout=180)
    except BaseException:
        stop(proc, signal.SIGKILL)
        raise AssertionError("the daemon did not start:\n" + cfg.with_suffix(".log").read_text()[-4000:]) from None
    return proc


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` and wait for the exit (a graceful stop persists memory blocks to NVMe:
    generous deadline); a daemon still running then is killed."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)
        raise


def test_sigkill_restart_and_flipped_byte(tmp_path):
    sock = f"unix:{short_socket_dir()}/kvstore.sock"
    cfg = tmp_path / "node.toml"
    # a host tier of 200 blocks: most of the replay's blocks end up on NVMe
    cfg.write_text(f"""
[server]
listen = "{sock}"
[tiers.host]
capacity = {200 * 512 * BPT}
[tiers.nvme]
path = "{tmp_path / 'nvme'}"
capacity = "1GiB"
""")
    requests = read_mooncake_trace(CONVERSATION_TRACE)[:N_REQUESTS]
    proc = start_daemon(cfg, sock)
    try:
        with KVStoreClient(sock) as c:
            first = replay(requests, c, bytes_per_token=BPT, progress=False)
            stats = c.stats()
    finally:
        stop(proc, signal.SIGKILL)
    assert first.corrupt_blocks == 0
    nvme_blocks = {p.name for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file() and len(p.name) == 64}
    keys = {trace_key(h, 512 * BPT).hex(): trace_key(h, 512 * BPT) for r in requests for h in r.hash_ids}
    on_nvme = sorted(k for k in nvme_blocks if k in keys)
    assert len(on_nvme) > 1000, stats

    # flip one byte of the payload of one NVMe block file (it starts after the 4 KiB header)
    victim = on_nvme[len(on_nvme) // 2]
    path = next(p for p in (tmp_path / "nvme" / "blocks").rglob(victim))
    raw = bytearray(path.read_bytes())
    raw[4096 + 7] ^= 0x5A
    path.write_bytes(bytes(raw))

    proc = start_daemon(cfg, sock)
    try:
        with KVStoreClient(sock) as c:
            # a block whose copy to NVMe was in flight at the kill has a file but no index
            # entry: recovery drops it (by design); a handful at most, never the others
            survived = {p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file()} & set(on_nvme)
            assert len(set(on_nvme) - survived) <= 8, "recovery dropped more than the copies in flight"
            got = c.get([keys[k] for k in on_nvme])
            found = {g.key.hex() for g in got if g.found}
            # every surviving NVMe block is served with its own bytes; only the flipped one misses
            assert found == survived - {victim}
            assert all(g.data == (g.key * (512 * BPT // 32 + 1))[:512 * BPT] for g in got if g.found)
            counters = c.stats()["counters"]
            assert counters["corrupt_blocks"] == (1 if victim in survived else 0)
            assert counters["blocks_recovered"] >= len(survived)
            second = replay(requests, c, bytes_per_token=BPT, progress=False)
    finally:
        stop(proc, signal.SIGTERM)
    assert second.corrupt_blocks == 0
    assert second.token_hit_rate > first.token_hit_rate
