#!/usr/bin/env python3
"""NVMe tier put and get next to raw O_DIRECT file I/O of the same bytes, in the same run.

For each block size (default 256 KiB, 1 MiB, 4 MiB) and thread count (default 1 and 4),
over ``--rounds`` rounds (the median is printed), it measures the figures below. Ours and
the raw figure it is compared with run over the same blocks in alternating slices of
8 blocks per thread, so that the load of a shared machine weighs on both alike.

- ``raw write`` / ``raw read``: one new file per block, opened with O_DIRECT, written or
  read in one call from/into a page-aligned buffer (buffered I/O where the filesystem
  refuses O_DIRECT): the limit;
- ``put``: ``reserve`` + ``write`` (the whole block from a page-aligned buffer, as the
  host arena demotes) + ``commit``, reserve under one lock as the manager serialises it
  (the commit runs without it, as a copy into a disk does); ``put bytes`` (1 thread): the
  same from a ``bytes`` object (unaligned: one bounce copy), into recycled spare files;
- ``get``: ``read_into`` of the whole block into a page-aligned buffer, every chunk
  verified; ``get bytearray`` (1 thread): into a ``bytearray`` (unaligned: a bounce copy);
- ``get 1/16``: a contiguous sixteenth of the block (one of 16 rotating slices), next to
  ``raw read 1/16``: an O_DIRECT read of those bytes alone;
- ``get TP rank``: what TP rank 0 of 8 reads of a block laid out
  ``[32 layers][k|v][8 KV heads][...]``: 64 ranges, an eighth of the block.

With ``--fsync`` the tier flushes every commit (``fsync=True``: commits in flight share
their flushes, :mod:`tiers.nvme.group`) and each raw write ends with ``fdatasync`` of its
file and ``fsync`` of its folder, the same promise.

GB/s are payload bytes served per second (1e9 B/s), medians over the rounds; ``x raw`` is
the median over the rounds of each round's ratio to the raw figure of the same
direction, size and threads (so it need not equal the ratio of the two medians);
``disk/served`` is bytes read from the block files (headers and whole checksum chunks
included) per byte served.

    python bench/nvme_tier.py [--sizes 256KiB,1MiB,4MiB] [--threads 1,4] [--total 256MiB]
                              [--rounds 3] [--chunk 16KiB] [--header-cache 32MiB] [--dir DIR] [--fsync]
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

from kvstore.common.units import format_size, parse_size  # noqa: E402
from tiers.nvme.tier import NVMeTier  # noqa: E402
from tiers.nvme.files import probe_direct  # noqa: E402


def filled(n: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, max(n, 4096)))
    seed = os.urandom(1 << 16)
    for off in range(0, n, len(seed)):
        view[off:min(n, off + len(seed))] = seed[:min(len(seed), n - off)]
    return view


class Workers:
    """``threads`` threads that run one share each of a list of block indices."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        if self.pool is not None:                       # start the threads before anything is timed
            barrier = threading.Barrier(threads)
            list(self.pool.map(lambda _: barrier.wait(), range(threads)))

    def run(self, indices: list[int], work) -> float:
        """Seconds to run ``work(i, thread)`` for every i, split over the threads."""
        def part(t: int) -> None:
            for i in indices[t::self.threads]:
                work(i, t)
        start = time.perf_counter()
        if self.pool is None:
            part(0)
        else:
            list(self.pool.map(part, range(self.threads)))
        return time.perf_counter() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def alternate(workers: Workers, count: int, slice_blocks: int, first, second) -> tuple[float, float]:
    """Run ``first`` and ``second`` over the same blocks, alternating slices of
    ``slice_blocks`` blocks so that drift in the machine's load hits both alike; returns
    the seconds each took in all."""
    a = b = 0.0
    for start in range(0, count, slice_blocks):
        indices = list(range(start, min(count, start + slice_blocks)))
        a += workers.run(indices, first)
        b += workers.run(indices, second)
    return a, b


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def tp_ranges(size: int, layers: int = 32, heads: int = 8, tp: int = 8) -> list[tuple[int, int]]:
    per_head = size // (layers * 2 * heads)
    per_kv = heads * per_head
    return [((layer * 2 + kv) * per_kv, per_head * heads // tp) for layer in range(layers) for kv in range(2)]


def one_round(folder: pathlib.Path, size: int, count: int, threads: int, chunk: int, direct: bool,
              header_cache: int, fsync: bool = False) -> dict:
    """Seconds per figure (``(seconds, bytes served per block)``) and read amplification."""
    src = filled(size)
    src_bytes = bytes(src[:size])
    outs = [filled(size) for _ in range(threads)]
    plain = [bytearray(size) for _ in range(threads)]
    flags = os.O_DIRECT if direct else 0
    (folder / "raw").mkdir()
    paths = [str(folder / "raw" / f"{i:08d}") for i in range(count)]
    t = NVMeTier(folder / "tier", count * (size + (64 << 10)) + (64 << 20), direct=None if direct else False,
                 chunk_bytes=chunk, header_cache_bytes=header_cache, fsync=fsync)
    lock = threading.Lock()
    workers = Workers(threads)
    slice_blocks = 8 * threads
    sixteenth = size // 16
    tp = tp_ranges(size)
    times, amp = {}, {}

    def raw_write(i, th):
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        os.pwrite(fd, src[:size], 0)
        if fsync:
            os.fdatasync(fd)
        os.close(fd)
        if fsync:
            folder_fd = os.open(folder / "raw", os.O_RDONLY)
            os.fsync(folder_fd)
            os.close(folder_fd)

    def raw_read(i, th, offset=0, n=size):
        fd = os.open(paths[i], os.O_RDONLY | flags)
        os.preadv(fd, [outs[th][:n]], offset)
        os.close(fd)

    def put(i, th, data=src[:size]):
        with lock:
            t.reserve(key(i), size)
        t.write(key(i), 0, data)
        t.commit(key(i))

    def get(i, th, ranges=None, out=outs):
        t.read_into(key(i), out[th], ranges)

    def counted(label, fn):
        before = t.read_counters()
        result = fn()
        after = t.read_counters()
        amp[label] = (after.bytes_read - before.bytes_read) / max(1, after.bytes_served - before.bytes_served)
        return result

    try:
        times["raw write"], times["put"] = alternate(workers, count, slice_blocks, raw_write, put)
        times["raw read"], times["get"] = counted("get", lambda: alternate(workers, count, slice_blocks, raw_read, get))
        r16, g16 = counted("get 1/16", lambda: alternate(
            workers, count, slice_blocks, lambda i, th: raw_read(i, th, (i % 16) * sixteenth, sixteenth),
            lambda i, th: get(i, th, [((i % 16) * sixteenth, sixteenth)])))
        times["raw read 1/16"], times["get 1/16"] = (r16, sixteenth), (g16, sixteenth)
        served = sum(n for _, n in tp)
        times["get TP rank"] = (counted("get TP rank", lambda: workers.run(list(range(count)),
                                                                            lambda i, th: get(i, th, tp))), served)
        if threads == 1:
            _, times["get bytearray"] = counted("get bytearray", lambda: alternate(
                workers, count, slice_blocks, raw_read, lambda i, th: get(i, th, None, plain)))
            for i in range(count):
                t.free(key(i))
                os.unlink(paths[i])
            _, times["put bytes"] = alternate(workers, count, slice_blocks, raw_write,
                                              lambda i, th: put(i, th, src_bytes))
    finally:
        workers.close()
        t.close()
    return {"times": times, "amplification": amp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--total", default="256MiB", help="bytes per figure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", default="16KiB", help="the tier's checksum chunk")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--header-cache", default="32MiB",
                    help="the tier's header cache (0: every read also reads and checks the block's header)")
    ap.add_argument("--fsync", action="store_true", help="flush every commit (and every raw write)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    total, chunk, cache = parse_size(args.total), parse_size(args.chunk), parse_size(args.header_cache)
    if args.dir:
        pathlib.Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=args.dir))
    direct = probe_direct(str(base))
    print(f"# folder {base} ({'O_DIRECT' if direct else 'buffered: the filesystem refuses O_DIRECT'}), "
          f"{format_size(total)} per figure, chunk {format_size(chunk)}, header cache {format_size(cache)}, "
          f"median of {args.rounds} rounds, {'fsync, ' if args.fsync else ''}"
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'block':>10} {'thr':>3} {'what':<14} {'GB/s':>6} {'raw GB/s':>8} {'x raw':>6} {'disk/served':>11}")
    try:
        for size in sizes:
            count = max(1, total // size)
            for nthreads in threads:
                rounds = []
                for _ in range(args.rounds):
                    folder = base / "run"
                    folder.mkdir()
                    rounds.append(one_round(folder, size, count, nthreads, chunk, direct, cache, args.fsync))
                    shutil.rmtree(folder)
                report(size, count, nthreads, rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def report(size: int, count: int, nthreads: int, rounds: list[dict]) -> None:
    def gbs(label: str, r: dict) -> float:
        v = r["times"][label]
        seconds, served = v if isinstance(v, tuple) else (v, size)
        return count * served / seconds / 1e9

    pairs = {"put": "raw write", "put bytes": "raw write", "get": "raw read", "get bytearray": "raw read",
             "get 1/16": "raw read 1/16", "get TP rank": None}
    for label, base in pairs.items():
        if label not in rounds[0]["times"]:
            continue
        ours = statistics.median(gbs(label, r) for r in rounds)
        limit = statistics.median(gbs(base, r) for r in rounds) if base else None
        ratio = statistics.median(gbs(label, r) / gbs(base, r) for r in rounds) if base else None
        amp = statistics.median(r["amplification"][label] for r in rounds) if label in rounds[0]["amplification"] \
            else None
        print(f"{format_size(size):>10} {nthreads:>3} {label:<14} {ours:6.2f} "
              f"{(f'{limit:8.2f}' if limit else ' ' * 8)} {(f'{ratio:6.2f}' if ratio else ' ' * 6)} "
              f"{(f'{amp:11.3f}' if amp is not None else '')}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
