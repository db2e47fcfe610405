#!/usr/bin/env python3
"""What the weights' fingerprint of the store namespace costs at start (computed once per engine
process: ``engine_adapter.model_identity.fingerprint_checkpoint``).

Writes a checkpoint of ``--files`` safetensors files of ``--tensors`` float16 tensors each
(``--mib`` MiB per file, random values), then times the fingerprint: from the page cache
(best and median of ``--reps``), and once after ``posix_fadvise(DONTNEED)`` of every file (the
kernel may keep pages it is asked to drop: a lower bound of a cold read). Prints the bytes the
fingerprint reads (header plus at most four 4 KiB samples per tensor) against the checkpoint's
size, and the time to read the whole checkpoint once, for scale. A benchmark reports; it does
not pass or fail.

    python bench/weights_fingerprint.py [--files 4] [--tensors 200] [--mib 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from engine_adapter.model_identity import SAMPLE_BYTES, SAMPLES, fingerprint_checkpoint  # noqa: E402


def write(root: pathlib.Path, files: int, tensors: int, mib: int) -> int:
    per = (mib << 20) // (tensors * 2)
    gen = torch.Generator().manual_seed(0)
    for f in range(files):
        save_file({f"t{f}.{i}": torch.randn(per, generator=gen).half() for i in range(tensors)},
                  str(root / f"model-{f:05d}-of-{files:05d}.safetensors"))
    (root / "config.json").write_text('{"model_type": "llama"}')
    return sum(p.stat().st_size for p in root.iterdir())


def drop_cache(root: pathlib.Path) -> None:
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvs-fp-") as tmp:
        root = pathlib.Path(tmp)
        size = write(root, args.files, args.tensors, args.mib)
        drop_cache(root)
        t0 = time.perf_counter()
        value, source = fingerprint_checkpoint(root)
        cold = time.perf_counter() - t0
        hot = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            assert fingerprint_checkpoint(root)[0] == value
            hot.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in root.iterdir():
            with open(p, "rb") as fh:
                while fh.read(16 << 20):
                    pass
        whole = time.perf_counter() - t0
        sampled = args.files * args.tensors * SAMPLES * SAMPLE_BYTES
        print(f"checkpoint: {args.files} files x {args.tensors} tensors, {size / 2**20:.0f} MiB ({source})")
        print(f"fingerprint reads <= {sampled / 2**20:.1f} MiB of samples + headers "
              f"({100 * sampled / size:.2f}% of the checkpoint)")
        print(f"fingerprint: after fadvise(DONTNEED) {cold * 1e3:.1f} ms; page cache best {min(hot) * 1e3:.1f} ms, "
              f"median {statistics.median(hot) * 1e3:.1f} ms")
        print(f"reading the whole checkpoint once (page cache): {whole * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
