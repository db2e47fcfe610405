"""Load: N client processes x M mixed operations (put/get/lookup/delete, overlapping keys)
against the daemon in its own process, for a bounded time.

Checked: every byte read is its key's payload; no block is lost (every shared block put is
still there, every private block is present exactly when its worker last put it) and none is
counted twice (blocks put - deleted - dropped = blocks visible); no deadlock (every process
has a deadline); the daemon's peak RSS stays within its RSS after start-up (which holds the
preallocated host arena) plus the documented overhead bound (docs/reliability.md).
Reports ops/s and peak RSS (run with -s).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

from kvstore.client.client import KVStoreClient
from rel_support import DaemonProcess, is_payload_of, short_socket_dir, size_for, write_toml

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rel_load_worker as worker  # noqa: E402

CLIENTS = 4
SECONDS = 6.0
MAX_OPS = 4000
WORKERS = 8
MAX_MESSAGE = 4 << 20
HOST = 8 << 20
MiB = 1 << 20


def overhead_bound(workers: int, max_message: int) -> int:
    """Bytes the daemon may grow above its RSS after start (docs/reliability.md): the NVMe
    tier's retained O_DIRECT bounce buffers (64 MiB), one request and one reply message
    per gRPC worker, and 64 MiB for the interpreter's heap and the allocator's arenas."""
    return 64 * MiB + workers * 2 * max_message + 64 * MiB


@pytest.mark.slow
def test_mixed_load_from_several_processes(tmp_path):
    socket_dir = short_socket_dir()
    address = f"unix:{socket_dir}/kvstore.sock"
    cfg = write_toml(tmp_path / "node.toml", {
        "server": {"listen": address, "workers": WORKERS, "max_message_bytes": MAX_MESSAGE,
                   "max_chunk_bytes": "1MiB"},
        "tiers": {"host": {"capacity": HOST}, "nvme": {"path": str(tmp_path / "nvme"), "capacity": "256MiB"}},
    })
    d = DaemonProcess(cfg, address, tmp_path / "daemon.log").start()
    try:
        rss_start = d.status("VmRSS")
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    samples.append(d.status("VmRSS"))
                except (OSError, KeyError):
                    return
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(HERE / "rel_load_worker.py"), address, str(w),
                                   str(SECONDS), str(MAX_OPS), str(1000 + w), str(tmp_path / f"w{w}.json")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for w in range(CLIENTS)]
        for p in procs:
            try:
                out, _ = p.communicate(timeout=SECONDS + 300)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError("a client process did not finish: deadlock or hang in the daemon")
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
        elapsed = time.monotonic() - t0
        stop.set()
        sampler.join(5)
        peak = d.status("VmHWM")
        reports = [json.loads((tmp_path / f"w{w}.json").read_text()) for w in range(CLIENTS)]
        problems = [p for r in reports for p in r["problems"]]
        assert not problems, problems[:10]

        # nothing lost, nothing duplicated
        shared = sorted({i for r in reports for i in r["shared_put"]})
        private = {bytes.fromhex(h) for r in reports for h in r["present"]}
        all_private = [worker.private_key(w, i) for w in range(CLIENTS) for i in range(worker.PRIVATE_KEYS)]
        expected = [worker.shared_key(i) for i in shared] + sorted(private)
        with KVStoreClient(address, timeout=30, max_message_bytes=MAX_MESSAGE) as c:
            for i in range(0, len(expected), 16):
                for g in c.get(expected[i:i + 16]):
                    assert g.found, f"block {g.key.hex()[:16]} was lost"
                    assert is_payload_of(g.key, g.data, size_for(g.key, worker.MIN_BLOCK, worker.MAX_BLOCK))
            gone = [k for k in all_private if k not in private]
            assert not any(g.found for g in c.get(gone)), "a deleted block came back"
            stats = c.stats()
        counters = stats["counters"]
        visible = counters["blocks_put"] - counters.get("blocks_deleted", 0) - counters.get("blocks_dropped", 0)
        assert visible == len(expected), (visible, len(expected), counters)
        assert counters.get("corrupt_blocks", 0) == 0 and counters.get("blocks_dropped", 0) == 0
        # copies to NVMe: by a put that needed room, or by the background cleaner ahead of it
        assert counters.get("demotions", 0) + counters.get("precleaned", 0) > 0, "the load never demoted"

        ops = sum(sum(r["ops"].values()) for r in reports)
        moved = sum(r["bytes"] for r in reports)
        bound = overhead_bound(WORKERS, MAX_MESSAGE)
        print(f"\nload: {CLIENTS} processes, {ops} ops in {elapsed:.1f}s = {ops / elapsed:.0f} ops/s, "
              f"{moved / elapsed / MiB:.0f} MiB/s payload; daemon RSS at start {rss_start / MiB:.0f} MiB, "
              f"peak {peak / MiB:.0f} MiB (sampled max {max(samples, default=0) / MiB:.0f} MiB), "
              f"bound {(rss_start + bound) / MiB:.0f} MiB; ops {_totals(reports)}")
        assert ops >= CLIENTS * worker.MIN_OPS, "a client stopped early"
        assert peak <= rss_start + bound, f"peak RSS {peak / MiB:.0f} MiB above the bound"
        assert d.stop() == 0
    finally:
        d.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _totals(reports) -> dict:
    out: dict = {}
    for r in reports:
        for k, v in r["ops"].items():
            out[k] = out.get(k, 0) + v
    return out
