#!/usr/bin/env python3
"""An engine's Lookup latency while the store writes to NVMe, next to the same Lookup idle.

A daemon (``kvstore serve``, its own process) with a 16 MiB host tier and an NVMe tier of
``--nvme`` bytes, filled first so that every put evicts. A prober process times a Lookup of
32 keys every 2 ms over the unix socket, as an engine's scheduler would, for ``--seconds``
with nothing else running (the baseline of this run), then for ``--seconds`` while a writer
client streams puts of ``--total`` bytes of 1 MiB blocks through the shared arena (each is
demoted to NVMe before the put can go on: the NVMe tier's writes, frees and evictions run
all the time). Prints the Lookup p50/p99/p999 of both phases, their ratios, and the put
GB/s of the loaded phase. With ``--fsync`` the NVMe tier flushes every write (group commit).
A benchmark reports; it does not judge.

    python bench/lookup_under_load.py [--seconds 8] [--total 128MiB] [--nvme 256MiB] [--fsync]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kvstore.common.units import format_size, parse_size  # noqa: E402
from throughput import Daemon  # noqa: E402

BLOCK = 1 << 20


def probe(address: str, seconds: float) -> None:
    """The prober: Lookup of 32 keys every 2 ms for ``seconds``; prints the latencies (ms) as JSON."""
    from kvstore.client.client import KVStoreClient

    c = KVStoreClient(address, timeout=60, shared_memory=False)
    c.wait_ready(30)
    keys = [hashlib.sha256(f"probe-{i}".encode()).digest() for i in range(32)]
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        c.lookup(keys)
        lat.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.002)
    c.close()
    print(json.dumps(lat), flush=True)


def run_probe(address: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--probe", address, "--seconds", str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def quantiles(lat: list[float]) -> tuple[float, float, float]:
    lat = sorted(lat)
    return tuple(lat[min(len(lat) - 1, int(len(lat) * q))] for q in (0.5, 0.99, 0.999))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    ap.add_argument("--total", default="128MiB", help="bytes per put of 1 MiB blocks")
    ap.add_argument("--nvme", default="256MiB", help="NVMe tier capacity")
    ap.add_argument("--fsync", action="store_true", help="the NVMe tier flushes every write")
    ap.add_argument("--dir", default="", help="scratch folder (on the disk to measure; default: a temp folder)")
    ap.add_argument("--probe", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe(args.probe, args.seconds)
        return 0
    from kvstore.client.client import KVStoreClient

    total, nvme = parse_size(args.total), parse_size(args.nvme)
    count = max(1, total // BLOCK)
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="kvlul-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(folder, "lul", 16 << 20, nvme, "unix:SOCK", fsync=args.fsync)
    try:
        c = KVStoreClient(daemon.address, timeout=600, shared_memory=True)
        c.wait_ready(30)
        src = np.random.default_rng(1).integers(0, 256, (count, BLOCK), dtype=np.uint8)
        rounds = [0]

        def put() -> None:
            rounds[0] += 1
            keys = [hashlib.sha256(f"{rounds[0]}-{i}".encode()).digest() for i in range(count)]
            assert c.put_from(keys, src).stored == count
        print(f"filling the {format_size(nvme)} NVMe tier ...", file=sys.stderr, flush=True)
        for _ in range(nvme // (count * BLOCK) + 1):
            put()
        print(f"Lookup idle for {args.seconds:.0f} s ...", file=sys.stderr, flush=True)
        p = run_probe(daemon.address, args.seconds)
        idle = json.loads(p.communicate()[0])
        print(f"Lookup under puts for {args.seconds:.0f} s ...", file=sys.stderr, flush=True)
        p = run_probe(daemon.address, args.seconds)
        rates: list[float] = []
        done = threading.Event()
        threading.Thread(target=lambda: (p.wait(), done.set()), daemon=True).start()
        while not done.is_set():
            t0 = time.perf_counter()
            put()
            rates.append(count * BLOCK / (time.perf_counter() - t0) / 1e9)
        loaded = json.loads(p.communicate()[0])
        c.close()
    finally:
        daemon.stop()
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    i, b = quantiles(idle), quantiles(loaded)
    print(f"\nLookup of 32 keys over the unix socket (ms), NVMe fsync {'on' if args.fsync else 'off'}:")
    print(f"{'':>12} {'n':>6} {'p50':>7} {'p99':>7} {'p999':>7}")
    print(f"{'idle':>12} {len(idle):6d} {i[0]:7.2f} {i[1]:7.2f} {i[2]:7.2f}")
    print(f"{'under puts':>12} {len(loaded):6d} {b[0]:7.2f} {b[1]:7.2f} {b[2]:7.2f}")
    print(f"{'ratio':>12} {'':>6} {b[0] / i[0]:6.2f}x {b[1] / i[1]:6.2f}x {b[2] / i[2]:6.2f}x")
    print(f"puts meanwhile: {len(rates)} of {format_size(count * BLOCK)}, median "
          f"{statistics.median(rates) if rates else 0:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
