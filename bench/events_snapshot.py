#!/usr/bin/env python3
"""KV event snapshots: what a router joining a node with many blocks costs, and what it gets.

1. **Burst through a small queue**: ``--burst`` blocks put in one call with ``[events]
   max_queue = 1``; the router (tests/support/router.py) reads only afterwards. Printed: the
   blocks it ends with, the events dropped and the snapshots that replaced them, the time
   until its view equals the daemon's.
2. **A router joining** a daemon holding ``--blocks`` blocks: the time from connecting to
   a view equal to the daemon's, and the longest hold of the store's lock while the
   snapshot was read (``held_blocks``, one chunk of 1,024 blocks per hold).

In-process daemon (client, daemon and router share one GIL), host tier only. A benchmark
reports; it does not pass or fail.

    python bench/events_snapshot.py [--blocks 50000] [--burst 400]
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kvstore.client.client import KVStoreClient  # noqa: E402
from kvstore.service import events as events_module  # noqa: E402
from kvstore.service.startup import start_server  # noqa: E402
from support.daemon import daemon_config, short_socket_dir  # noqa: E402
from support.router import Router, true_blocks  # noqa: E402


def key(i: int) -> bytes:
    return hashlib.sha256(f"bench-ev-{i}".encode()).digest()


def converge(router: Router, daemon, limit_s: float = 600.0) -> float:
    """Seconds until the router's view is the daemon's (which no longer changes: read once)."""
    t0 = time.perf_counter()
    truth = true_blocks(daemon.manager)
    router.follow(lambda: router.blocks == truth, "convergence", limit_s)
    return time.perf_counter() - t0


def put(address: str, ids: range, nbytes: int) -> None:
    with KVStoreClient(address, timeout=600) as c:
        step = 4096
        for s in range(ids.start, ids.stop, step):
            part = range(s, min(s + step, ids.stop))
            c.put_from([key(i) for i in part], [np.full(nbytes, i % 251, dtype=np.uint8) for i in part])


def burst(n: int) -> None:
    folder = short_socket_dir()
    with tempfile.TemporaryDirectory() as tmp:
        d = start_server(daemon_config(pathlib.Path(tmp), host="64MiB", nvme=None, extra={"events": {
            "enabled": True, "endpoint": f"ipc://{folder}/ev", "replay_endpoint": f"ipc://{folder}/rp",
            "max_queue": 1, "batch_ms": 0.0}}))
        router = Router(d.events.endpoint, d.events.replay_endpoint)
        try:
            router.follow(lambda: router.cleared >= 1, "the join snapshot", 60)
            put(d.address, range(n), 4096)
            seconds = converge(router, d)
            c = d.manager.counters
            print(f"burst of {n} blocks through max_queue = 1: router holds {len(router.blocks)} of "
                  f"{len(true_blocks(d.manager))}; events_dropped {c['events_dropped']}, events_snapshots "
                  f"{c['events_snapshots']}, replays asked {router.replays}; equal views after {seconds * 1e3:.0f} ms")
        finally:
            router.close()
            d.stop(0)


def join(n: int) -> None:
    folder = short_socket_dir()
    holds: list[float] = []
    real = events_module.held_blocks

    def timed(manager):
        """held_blocks, timing each chunk (one hold of the lock; the first also lists the keys)."""
        chunks = real(manager)
        while True:
            t0 = time.perf_counter()
            try:
                out = next(chunks)
            except StopIteration:
                return
            holds.append(time.perf_counter() - t0)
            yield out

    with tempfile.TemporaryDirectory() as tmp:
        d = start_server(daemon_config(pathlib.Path(tmp), host="512MiB", nvme=None, extra={"events": {
            "enabled": True, "endpoint": f"ipc://{folder}/ev", "replay_endpoint": f"ipc://{folder}/rp"}}))
        try:
            t0 = time.perf_counter()
            put(d.address, range(n), 1024)
            print(f"stored {n} blocks of 1 KiB in {time.perf_counter() - t0:.1f} s")
            d.events._held = lambda: timed(d.manager)
            router = Router(d.events.endpoint, d.events.replay_endpoint)
            try:
                seconds = converge(router, d)
                print(f"a router joining a node with {n} blocks: equal views after {seconds:.2f} s "
                      f"({router.cleared} snapshot(s), {len(router.seqs)} batches); reading one chunk of "
                      f"1,024 blocks (one hold of the store's lock) took {np.median(holds) * 1e3:.1f} ms "
                      f"median, {max(holds) * 1e3:.1f} ms at most ({len(holds)} chunks; the router "
                      "shares the daemon's GIL here)")
            finally:
                router.close()
        finally:
            d.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=50_000)
    ap.add_argument("--burst", type=int, default=400)
    args = ap.parse_args()
    burst(args.burst)
    join(args.blocks)


if __name__ == "__main__":
    main()
