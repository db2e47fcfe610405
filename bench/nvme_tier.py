#!/usr/bin/env python3
"""NVMe tier put and get next to raw O_DIRECT file I/O of the same bytes, in the same run.

For each block size (default 256 KiB, 1 MiB, 4 MiB) and thread count (default 1 and 4),
interleaved over ``--rounds`` rounds (the median is printed), it measures:

- ``raw write`` / ``raw read``: one new file per block, opened with O_DIRECT, written or
  read in one call from/into a page-aligned buffer (buffered I/O where the filesystem
  refuses O_DIRECT): the limit;
- ``put``: ``reserve`` + ``write`` (the whole block from a page-aligned buffer, as the
  host arena demotes) + ``commit``, reserve and commit under one lock as the manager
  serialises them; ``put bytes``: the same from a ``bytes`` object (unaligned: a bounce copy);
- ``get``: ``read_into`` of the whole block into a page-aligned buffer, every chunk
  verified; ``get bytearray``: into a ``bytearray`` (unaligned: a bounce copy);
- ``get 1/16``: a contiguous sixteenth of the block (one of 16 rotating slices), next to
  ``raw read 1/16``: an O_DIRECT read of those bytes alone;
- ``get TP rank``: what TP rank 0 of 8 reads of a block laid out
  ``[32 layers][k|v][8 KV heads][...]``: 64 ranges, an eighth of the block.

GB/s are payload bytes served per second (1e9 B/s); ``x raw`` is the ratio to the raw
figure of the same direction, size and threads; ``disk/served`` is bytes read from the
block files (headers and whole checksum chunks included) per byte served.

    python bench/nvme_tier.py [--sizes 256KiB,1MiB,4MiB] [--threads 1,4] [--total 256MiB]
                              [--rounds 3] [--chunk 16KiB] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.units import format_size, parse_size  # noqa: E402
from tiers.nvme import NVMeTier  # noqa: E402
from tiers.nvme_io import probe_direct  # noqa: E402


def filled(n: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, max(n, 4096)))
    seed = os.urandom(1 << 16)
    for off in range(0, n, len(seed)):
        view[off:min(n, off + len(seed))] = seed[:min(len(seed), n - off)]
    return view


def run_threads(threads: int, count: int, work) -> float:
    """Seconds to run ``work(i, buf_index)`` for i in range(count), split over threads."""
    def part(t: int) -> None:
        for i in range(t, count, threads):
            work(i, t)
    start = time.perf_counter()
    if threads == 1:
        part(0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(threads)))
    return time.perf_counter() - start


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def tp_ranges(size: int, layers: int = 32, heads: int = 8, tp: int = 8) -> list[tuple[int, int]]:
    per_head = size // (layers * 2 * heads)
    per_kv = heads * per_head
    return [((layer * 2 + kv) * per_kv, per_head * heads // tp) for layer in range(layers) for kv in range(2)]


class Round:
    def __init__(self, folder: pathlib.Path, size: int, count: int, threads: int, chunk: int, direct: bool):
        self.folder, self.size, self.count, self.threads = folder, size, count, threads
        self.chunk, self.direct = chunk, direct
        self.src = filled(size)
        self.src_bytes = bytes(self.src[:size])
        self.outs = [filled(size) for _ in range(threads)]
        self.flags = os.O_DIRECT if direct else 0

    def raw(self) -> dict:
        d = self.folder / "raw"
        d.mkdir()
        paths = [str(d / f"{i:08d}") for i in range(self.count)]

        def write(i, t):
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flags, 0o600)
            os.pwrite(fd, self.src[:self.size], 0)
            os.close(fd)

        def read(i, t):
            fd = os.open(paths[i], os.O_RDONLY | self.flags)
            os.preadv(fd, [self.outs[t][:self.size]], 0)
            os.close(fd)

        sixteenth = self.size // 16

        def read16(i, t):
            fd = os.open(paths[i], os.O_RDONLY | self.flags)
            os.preadv(fd, [self.outs[t][:sixteenth]], (i % 16) * sixteenth)
            os.close(fd)

        r = {"raw write": run_threads(self.threads, self.count, write),
             "raw read": run_threads(self.threads, self.count, read),
             "raw read 1/16": run_threads(self.threads, self.count, read16)}
        shutil.rmtree(d)
        return r

    def tier(self) -> dict:
        t = NVMeTier(self.folder / "tier", self.count * (self.size + (64 << 10)) + (64 << 20),
                     direct=None if self.direct else False, chunk_bytes=self.chunk)
        lock = threading.Lock()
        results, amplification = {}, {}
        try:
            for label, src in (("put", self.src[:self.size]), ("put bytes", self.src_bytes)):
                def put(i, _t, src=src):
                    with lock:
                        t.reserve(key(i), self.size)
                    t.write(key(i), 0, src)
                    with lock:
                        t.commit(key(i))
                if label == "put bytes":
                    if self.threads != 1:
                        continue
                    for i in range(self.count):
                        t.free(key(i))
                results[label] = run_threads(self.threads, self.count, put)
            sixteenth = self.size // 16
            tp = tp_ranges(self.size)
            reads = {"get": lambda i: None, "get bytearray": lambda i: None,
                     "get 1/16": lambda i: [((i % 16) * sixteenth, sixteenth)], "get TP rank": lambda i: tp}
            plain = [bytearray(self.size) for _ in range(self.threads)]
            for label, ranges in reads.items():
                if label == "get bytearray" and self.threads != 1:
                    continue
                outs = plain if label == "get bytearray" else self.outs
                before = t.read_counters()

                def get(i, th, ranges=ranges, outs=outs):
                    t.read_into(key(i), outs[th], ranges(i))
                results[label] = run_threads(self.threads, self.count, get)
                after = t.read_counters()
                amplification[label] = (after.bytes_read - before.bytes_read) / (after.bytes_served -
                                                                                  before.bytes_served)
            for label in ("get 1/16", "get TP rank"):
                results[label] = (results[label], sixteenth if label == "get 1/16" else sum(n for _, n in tp))
        finally:
            t.close()
            shutil.rmtree(self.folder / "tier")
        return {"times": results, "amplification": amplification}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--total", default="256MiB", help="bytes per figure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", default="16KiB", help="the tier's checksum chunk")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    total, chunk = parse_size(args.total), parse_size(args.chunk)
    base = pathlib.Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=args.dir))
    direct = probe_direct(str(base))
    print(f"# folder {base} ({'O_DIRECT' if direct else 'buffered: the filesystem refuses O_DIRECT'}), "
          f"{format_size(total)} per figure, chunk {format_size(chunk)}, median of {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'block':>7} {'thr':>3} {'what':<14} {'GB/s':>6} {'raw GB/s':>8} {'x raw':>6} {'disk/served':>11}")
    try:
        for size in sizes:
            count = max(1, total // size)
            for nthreads in threads:
                raws, tiers = [], []
                for _ in range(args.rounds):
                    folder = base / "run"
                    folder.mkdir()
                    r = Round(folder, size, count, nthreads, chunk, direct)
                    raws.append(r.raw())
                    tiers.append(r.tier())
                    shutil.rmtree(folder)
                report(size, count, nthreads, raws, tiers)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def report(size: int, count: int, nthreads: int, raws: list[dict], tiers: list[dict]) -> None:
    def gbs(seconds: float, nbytes: int) -> float:
        return nbytes / seconds / 1e9

    raw = {k: statistics.median(gbs(r[k], count * (size // 16 if "1/16" in k else size)) for r in raws)
           for k in raws[0]}
    pairs = {"put": "raw write", "put bytes": "raw write", "get": "raw read", "get bytearray": "raw read",
             "get 1/16": "raw read 1/16", "get TP rank": None}
    for label, base in pairs.items():
        if label not in tiers[0]["times"]:
            continue
        vals = []
        for t in tiers:
            v = t["times"][label]
            seconds, served = (v if isinstance(v, tuple) else (v, size))
            vals.append(gbs(seconds, count * served))
        ours = statistics.median(vals)
        amp = statistics.median(t["amplification"][label] for t in tiers) if label.startswith("get") else None
        limit = raw[base] if base else None
        print(f"{format_size(size):>7} {nthreads:>3} {label:<14} {ours:6.2f} "
              f"{(f'{limit:8.2f}' if limit else ' ' * 8)} {(f'{ours / limit:6.2f}' if limit else ' ' * 6)} "
              f"{(f'{amp:11.3f}' if amp is not None else '')}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
