"""Device check: GPU tests plus a tier bandwidth matrix next to limits measured in the same run.

    python bench/device_check.py [--dir DIR] [--total-mib N] [--block-mib N] [--reps N] [--skip-tests]

On a GPU machine it (1) runs ``pytest -m gpu`` and (2) measures each data path of the
store next to the hardware limit it should approach, measured in the same run, and
prints ``ours / limit`` ratios. On a CPU machine it says so, measures the paths that
have a CPU twin (HBM stand-in, POSIX NVMe) quickly, and exits 0. The output format
is documented in ``docs/device_check.md``. Nothing here passes or fails on a time: the
exit status is 1 when the GPU tests fail, 3 when a matrix row raised (its row reads
``(stopped)``; SIGTERM from a ``timeout`` too: the rows measured before it are printed and the
scratch files removed), 2 for bad arguments.

It must finish in under 8 minutes on the GPU machine: the tests get at most
``TEST_TIMEOUT_S`` and every measurement moves ``--total-mib`` (default 1024 on a
GPU, 64 on CPU) a few times; rows are skipped once ``BUDGET_S`` has passed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEST_TIMEOUT_S = 300
BUDGET_S = 420          # stop starting new rows after this (the whole run must stay < 480 s)


@dataclass
class Row:
    """One line of the matrix: our path's rate and the limit it is compared with (GB/s = 1e9 B/s)."""

    path: str
    ours: float | None
    limit_name: str
    limit: float | None
    note: str = ""

    def cells(self) -> list[str]:
        ratio = f"{self.ours / self.limit:.2f}" if self.ours and self.limit else "-"
        fmt = lambda v: f"{v:.2f}" if v is not None else "n/a"  # noqa: E731
        return [self.path, fmt(self.ours), self.limit_name, fmt(self.limit), ratio, self.note]


def best_rate(fn: Callable[[], None], nbytes: int, reps: int, before: Callable[[], None] | None = None) -> float:
    """Best of ``reps`` runs of ``fn`` (each moving ``nbytes``), in GB/s."""
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def key(i: int) -> bytes:
    return hashlib.sha256(b"device-check-%d" % i).digest()


# ---------------------------------------------------------------------- files

def o_direct_ok(folder: pathlib.Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / ".odirect-probe"
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            probe.unlink()


def drop_page_cache(folder: pathlib.Path) -> None:
    """Flush and evict ``folder``'s files from the page cache, so reads hit the device."""
    os.sync()
    for p in folder.rglob("*"):
        if p.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def raw_file_rates(folder: pathlib.Path, total: int, chunk: int, reps: int, direct: bool) -> tuple[float, float]:
    """(write, read) GB/s of one file written and read in ``chunk``-byte pwrite/preadv calls:
    the fio-like limit of the disk (O_DIRECT when the filesystem allows it)."""
    path = folder / "raw.bin"
    buf = mmap.mmap(-1, chunk)                      # page aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    flag = os.O_DIRECT if direct else 0
    view = memoryview(buf)

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            for off in range(0, total, chunk):
                os.pwrite(fd, view, off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read():
        fd = os.open(path, os.O_RDONLY | flag)
        try:
            for off in range(0, total, chunk):
                os.preadv(fd, [view], off)
        finally:
            os.close(fd)

    w = best_rate(write, total, reps)
    r = best_rate(read, total, reps, before=lambda: drop_page_cache(folder))
    path.unlink()
    view.release()
    buf.close()
    return w, r


# ---------------------------------------------------------------------- tier paths

def nvme_tier(folder: pathlib.Path, capacity: int):
    from tiers.nvme.tier import NVMeTier
    return NVMeTier(folder, capacity, io="posix")


def put_blocks(tier, keys: list[bytes], source: Callable[[int], object], size: int) -> None:
    for i, k in enumerate(keys):
        tier.reserve(k, size)
        tier.write(k, 0, source(i))
        tier.commit(k)


def free_blocks(tier, keys: list[bytes]) -> None:
    for k in keys:
        if k in tier:
            tier.free(k)


def measure_tiers(args, folder: pathlib.Path, gpu: bool, rows: list[Row], started: float) -> None:
    """Allocate the host arena and the HBM tier, measure, and free them."""
    import numpy as np

    from tiers.hbm import HBMTier
    from tiers.memory import allocate_host_buffer

    total, block = args.total, args.block
    n = total // block
    total = n * block
    keys = [key(i) for i in range(n)]
    arena = allocate_host_buffer(total, pinned=gpu)
    arena.array[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    hbm = HBMTier(2 * total + (1 << 20), backend="cuda" if gpu else "shm")   # room for a second copy
    try:
        measure_paths(args, folder, gpu, rows, started, hbm, arena, keys, total, n)
    finally:
        hbm.close()


def measure_paths(args, folder, gpu, rows, started, hbm, arena, keys, total, n) -> None:
    """Append the matrix rows: ``n`` blocks of ``args.block`` bytes (``total``) between the
    (pinned) host ``arena``, the HBM tier ``hbm``, the NVMe tier and GDS."""
    import numpy as np

    block, reps = args.block, args.reps
    host = memoryview(arena.array)
    sl = lambda i: host[i * block:(i + 1) * block]  # noqa: E731
    hbm_name = "HBM" if gpu else "HBM stand-in"
    direct = o_direct_ok(folder)

    def over_budget() -> bool:
        return time.monotonic() - started > BUDGET_S

    # ---- limits of memory copies
    if gpu:
        import cupy
        from cupy.cuda import runtime as rt
        dev = cupy.empty(total, dtype=cupy.uint8)
        h2d = best_rate(lambda: rt.memcpy(dev.data.ptr, arena.array.ctypes.data, total, rt.memcpyHostToDevice),
                        total, reps)
        d2h = best_rate(lambda: rt.memcpy(arena.array.ctypes.data, dev.data.ptr, total, rt.memcpyDeviceToHost),
                        total, reps)
        up_limit, down_limit = ("cudaMemcpy H2D pinned", h2d), ("cudaMemcpy D2H pinned", d2h)
    else:
        scratch = np.empty(total, dtype=np.uint8)
        cp = best_rate(lambda: np.copyto(scratch, arena.array), total, reps)
        up_limit = down_limit = ("memcpy (numpy copy)", cp)

    # ---- host <-> HBM
    rows.append(Row(f"host -> {hbm_name} (HBMTier.write)",
                    best_rate(lambda: put_blocks(hbm, keys, sl, block), total, reps,
                              before=lambda: free_blocks(hbm, keys)), *up_limit))
    rows.append(Row(f"{hbm_name} -> host (HBMTier.read_into)",
                    best_rate(lambda: [hbm.read_into(k, sl(i)) for i, k in enumerate(keys)], total, reps),
                    *down_limit))

    # ---- host <-> NVMe (POSIX tier) next to raw file throughput
    raw_w, raw_r = raw_file_rates(folder, total, block, reps, direct)
    nv_note = "O_DIRECT" if direct else "buffered (no O_DIRECT here)"
    try:
        nvme = nvme_tier(folder / "nvme", 4 * total)
    except Exception as e:  # the tier is optional for this script; say why it is missing
        nvme = None
        rows.append(Row("host -> NVMe (NVMeTier)", None, "raw file write", raw_w, f"{type(e).__name__}: {e}"))
        rows.append(Row("NVMe -> host (NVMeTier)", None, "raw file read", raw_r, ""))
    if nvme is not None:
        rows.append(Row("host -> NVMe (NVMeTier put)",
                        best_rate(lambda: put_blocks(nvme, keys, sl, block), total, reps,
                                  before=lambda: free_blocks(nvme, keys)),
                        "raw file write", raw_w, nv_note))
        rows.append(Row("NVMe -> host (NVMeTier read_into)",
                        best_rate(lambda: [nvme.read_into(k, sl(i)) for i, k in enumerate(keys)], total, reps,
                                  before=lambda: drop_page_cache(folder / "nvme")),
                        "raw file read", raw_r, nv_note))
        if not over_budget():
            bounce = [key(n + i) for i in range(n)]

            def hbm_to_nvme():
                for i, k in enumerate(keys):
                    hbm.read_into(k, sl(i))
                    nvme.reserve(bounce[i], block)
                    nvme.write(bounce[i], 0, sl(i))
                    nvme.commit(bounce[i])

            rows.append(Row(f"{hbm_name} -> NVMe (bounce: read_into host arena + NVMeTier put)",
                            best_rate(hbm_to_nvme, total, reps, before=lambda: free_blocks(nvme, bounce)),
                            "raw file write", raw_w, nv_note))
            up = [key(2 * n + i) for i in range(n)]

            def bounced(i: int) -> memoryview:
                nvme.read_into(bounce[i], sl(i))
                return sl(i)

            rows.append(Row(f"NVMe -> {hbm_name} (bounce: NVMeTier read_into host arena + HBMTier.write)",
                            best_rate(lambda: put_blocks(hbm, up, bounced, block), total,
                                      reps, before=lambda: (free_blocks(hbm, up), drop_page_cache(folder / "nvme"))),
                            "raw file read", raw_r, nv_note))
            free_blocks(hbm, up)
        nvme.close()

    # ---- HBM <-> NVMe through GDS (kvikio) next to kvikio's raw throughput
    if gpu and not over_budget():
        measure_gds(folder, hbm, keys, total, block, reps, rows)
    if gpu and not over_budget():
        measure_kernels(total, reps, rows)


def measure_gds(folder: pathlib.Path, hbm, keys: list[bytes], total: int, block: int, reps: int,
                rows: list[Row]) -> None:
    from tiers import gds

    info = gds.gds_info()
    if not info.available:
        rows.append(Row("HBM -> NVMe (GDS)", None, "kvikio raw write", None, info.reason))
        return
    import cupy
    import kvikio

    gdir = folder / "gds"
    gdir.mkdir(exist_ok=True)
    dev = cupy.empty(total, dtype=cupy.uint8)
    raw = gdir / "raw.bin"

    def raw_write():
        f = kvikio.CuFile(raw, "w")
        try:
            f.write(dev)
        finally:
            f.close()
        os.sync()

    def raw_read():
        f = kvikio.CuFile(raw, "r")
        try:
            f.read(dev)
        finally:
            f.close()

    kw = best_rate(raw_write, total, reps)
    kr = best_rate(raw_read, total, reps, before=lambda: drop_page_cache(gdir))
    raw.unlink()
    note = f"kvikio {info.mode}"
    paths = [gdir / f"{i}.blk" for i in range(len(keys))]

    def write_all():
        for k, p in zip(keys, paths):
            gds.write_block_file(p, hbm.device_array(k))
        os.sync()

    def read_all():
        for k, p in zip(keys, paths):
            gds.read_block_file(p, hbm.device_array(k), block)

    rows.append(Row("HBM -> NVMe (GDS write_block_file)", best_rate(write_all, total, reps),
                    "kvikio raw write", kw, note))
    rows.append(Row("NVMe -> HBM (GDS read_block_file)",
                    best_rate(read_all, total, reps, before=lambda: drop_page_cache(gdir)),
                    "kvikio raw read", kr, note))
    measure_tier_gds(gdir / "tier", hbm, keys, total, block, reps, rows, (kw, kr), note)
    shutil.rmtree(gdir, ignore_errors=True)


def measure_tier_gds(folder: pathlib.Path, hbm, keys: list[bytes], total: int, block: int, reps: int,
                     rows: list[Row], raw: tuple[float, float], note: str) -> None:
    """The NVMe tier's device path (what the manager uses for HBM <-> NVMe with io = gds):
    GDS plus the checksum's device -> host copy, the temp file + rename and the index."""
    from tiers.nvme.tier import NVMeTier

    tier = NVMeTier(folder, 2 * total, io="gds")
    up = [key(3 * len(keys) + i) for i in range(len(keys))]

    def put_all():
        for k in keys:
            tier.reserve(k, block)
            tier.write_from_device(k, hbm.device_array(k))
            tier.commit(k)
        os.sync()

    def read_all():
        for k, u in zip(keys, up):
            hbm.reserve(u, block)
            tier.read_into_device(k, hbm.device_array(u))
            hbm.mark_written(u, block)
            hbm.commit(u)

    try:
        rows.append(Row("HBM -> NVMe (NVMeTier.write_from_device: GDS + checksum)",
                        best_rate(put_all, total, reps, before=lambda: free_blocks(tier, keys)),
                        "kvikio raw write", raw[0], note))
        rows.append(Row("NVMe -> HBM (NVMeTier.read_into_device: GDS + checksum)",
                        best_rate(read_all, total, reps,
                                  before=lambda: (free_blocks(hbm, up), drop_page_cache(folder))),
                        "kvikio raw read", raw[1], note))
    finally:
        free_blocks(hbm, up)
        tier.close()


def measure_kernels(total: int, reps: int, rows: list[Row]) -> None:
    """Gather/scatter of a 70B-like TP shard (8 KV heads, head_dim 128, fp16, 16-token
    pages) against a device-to-device copy of the same bytes."""
    import torch

    import kernels

    layers, bs, heads, hd = 8, 16, 8, 128
    page = 2 * bs * heads * hd * 2                            # bytes per layer and block
    nb = max(2, total // (layers * page))
    caches = [torch.randn(2, nb, bs, heads, hd, device="cuda", dtype=torch.float16) for _ in range(layers)]
    ids = torch.randperm(nb, device="cuda")
    out = kernels.gather_blocks(caches, ids)
    nbytes = out.nbytes
    src, dst = torch.empty_like(out), torch.empty_like(out)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    d2d = best_rate(synced(lambda: dst.copy_(src)), nbytes, reps)
    note = f"{kernels.implementation(caches).__name__}, {layers} layers x {nb} blocks"
    rows.append(Row("gather paged cache -> blocks (HBM)",
                    best_rate(synced(lambda: kernels.gather_blocks(caches, ids, out=out)), nbytes, reps),
                    "D2D copy", d2d, note))
    rows.append(Row("scatter blocks -> paged cache (HBM)",
                    best_rate(synced(lambda: kernels.scatter_blocks(caches, ids, out)), nbytes, reps),
                    "D2D copy", d2d, note))


# ---------------------------------------------------------------------- report

def run_gpu_tests() -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 1, f"timed out after {TEST_TIMEOUT_S} s"
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error|skipped)", ln)),
                   lines[-1] if lines else "no output")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    text = f"{summary} ({time.monotonic() - t0:.1f} s, exit {res.returncode})"
    if failures:
        text += "\n" + "\n".join("  " + ln for ln in failures[:20])
    return (0 if res.returncode in (0, 5) else 1), text


class Terminated(Exception):
    """SIGTERM arrived while measuring (a ``timeout`` around the script)."""


def _terminated(signum, frame) -> None:
    raise Terminated("SIGTERM: the rows above were measured before it")


def header(gpu_info) -> list[str]:
    lines = ["kvstore device check",
             f"  machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
             f"python {platform.python_version()}"]
    versions = []
    for mod in ("torch", "cupy", "kvikio"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            versions.append(f"{mod} -")
    lines.append("  libraries: " + ", ".join(versions))
    if gpu_info.available:
        name = "?"
        try:
            import torch
            p = torch.cuda.get_device_properties(0)
            name = f"{p.name}, {p.total_memory / 2**30:.1f} GiB"
        except Exception:
            pass
        lines.append(f"  gpu: {gpu_info.device_count} device(s), device 0: {name}")
    else:
        lines.append(f"  gpu: none ({gpu_info.reason})")
    return lines


def table(rows: list[Row]) -> list[str]:
    head = ["path", "ours GB/s", "limit", "limit GB/s", "ours/limit", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=pathlib.Path, default=ROOT / "kvstore-data",
                    help="folder on the disk to measure (a temporary subfolder is made and removed)")
    ap.add_argument("--total-mib", type=int, default=None, help="bytes per measurement (default 1024 GPU, 64 CPU)")
    ap.add_argument("--block-mib", type=int, default=2, help="block size in MiB (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="runs per measurement; the best is reported")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    args = ap.parse_args(argv)
    started = time.monotonic()

    from tiers.gpu import gpu_info
    info = gpu_info()
    gpu = info.available and info.cupy
    print("\n".join(header(info)), flush=True)
    if args.block_mib <= 0 or (args.total_mib is not None and args.total_mib < args.block_mib) or args.reps < 1:
        print("bad arguments: need 0 < --block-mib <= --total-mib and --reps >= 1", file=sys.stderr)
        return 2
    args.block = args.block_mib << 20
    args.total = (args.total_mib or (1024 if gpu else 64)) << 20
    if not gpu:
        args.reps = min(args.reps, 2)
        print(f"{info.reason or 'no GPU use: CuPy is missing'}; GPU tests and GPU rows skipped, "
              f"measuring the CPU twins only", flush=True)

    rc = 0
    if gpu and not args.skip_tests:
        rc, text = run_gpu_tests()
        print(f"gpu tests: pytest -m gpu: {text}", flush=True)
    elif not gpu:
        print("gpu tests: skipped (no GPU)", flush=True)
    else:
        print("gpu tests: skipped (--skip-tests)", flush=True)

    args.dir.mkdir(parents=True, exist_ok=True)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="device-check-", dir=args.dir))
    rows: list[Row] = []
    signal.signal(signal.SIGTERM, _terminated)       # `timeout`: report the rows so far, remove the files
    try:
        print(f"files: {folder} (O_DIRECT {'yes' if o_direct_ok(folder) else 'no'})", flush=True)
        measure_tiers(args, folder, gpu, rows, started)
    except Exception as e:  # report what was measured, and why the rest was not
        rows.append(Row("(stopped)", None, "-", None, f"{type(e).__name__}: {e}"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    n = args.total // args.block
    print(f"\nbandwidth: {n} blocks x {args.block_mib} MiB = {n * args.block / 2**30:.2f} GiB per run, "
          f"best of {args.reps}; GB/s = 1e9 bytes/s")
    print("\n".join(table(rows)))
    if any(r.path == "(stopped)" for r in rows) and rc == 0:
        rc = 3
    print(f"\ndevice check: done in {time.monotonic() - started:.1f} s (exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
