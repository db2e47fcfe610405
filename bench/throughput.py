#!/usr/bin/env python3
"""Put/Get throughput through the daemon, next to the limits measured in the same run.

For each block size (default 256 KiB, 1 MiB, 4 MiB) it measures, in this order:

- ``memcpy``: numpy copy between two preallocated buffers of the block size;
- ``file O_DIRECT``: raw write and read of the same number of blocks to a file with
  O_DIRECT and an aligned buffer (plain buffered I/O if the filesystem refuses it);
- ``grpc echo``: a bare grpcio server in a separate process, streaming the same
  bytes the way our Put (client stream) and Get (server stream) do;
- ``kvstore``: our daemon in a separate process (``kvstore serve``), once with a host
  tier large enough for everything (host) and once with a tiny host tier so every
  block lives on NVMe (nvme: puts demote through host to NVMe, gets read NVMe and
  promote back);

and prints each of our figures as a ratio of each limit. Figures are GB/s (1e9 B/s).

    python bench/throughput.py [--sizes 256KiB,1MiB,4MiB] [--total 256MiB] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.units import format_size, parse_size  # noqa: E402

_ECHO_SERVER = r"""
import sys
from concurrent import futures
import grpc

def sink(request_iterator, context):
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")

def source(request, context):
    size = int.from_bytes(request[:8], "little")
    count = int.from_bytes(request[8:16], "little")
    payload = b"\x01" * size
    for _ in range(count):
        yield payload

handlers = {
    "Sink": grpc.stream_unary_rpc_method_handler(sink),
    "Source": grpc.unary_stream_rpc_method_handler(source),
}
opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
server.add_insecure_port(sys.argv[1])
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_of(fn, repeats: int = 3) -> float:
    """Shortest wall time of ``repeats`` runs of ``fn`` (seconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_memcpy(size: int, count: int) -> float:
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    np.copyto(dst, src)  # first touch outside the timing

    def run():
        for _ in range(count):
            np.copyto(dst, src)
    return gbps(size * count, best_of(run))


def bench_file(folder: pathlib.Path, size: int, count: int) -> tuple[float, float, str]:
    """Raw write and read GB/s of ``count`` blocks of ``size`` bytes, and the mode used."""
    path = folder / "raw.bin"
    aligned = (size + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, aligned)
    buf.write(b"\x02" * aligned)
    mode = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
        os.pwrite(fd, buf, 0)
    except OSError:
        mode = "buffered"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(buf)

    def write():
        for i in range(count):
            os.pwrite(fd, view, i * aligned)
        os.fsync(fd)

    def read():
        for i in range(count):
            os.preadv(fd, [view], i * aligned)
    w = gbps(size * count, best_of(write))
    r = gbps(size * count, best_of(read))
    os.close(fd)
    view.release()
    buf.close()
    path.unlink()
    return w, r, mode


def start(cmd: list[str], ready_line: str | None = None, env=None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if ready_line:
        for line in proc.stdout:
            if ready_line in line:
                break
        else:
            raise RuntimeError(f"{cmd} exited before it was ready")
    return proc


def bench_grpc_echo(address: str, size: int, count: int) -> tuple[float, float]:
    import grpc

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(address, options=opts) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        sink = ch.stream_unary("/bench.Echo/Sink")
        source = ch.unary_stream("/bench.Echo/Source")
        payload = b"\x03" * size

        def put():
            assert int.from_bytes(sink(payload for _ in range(count)), "little") == size * count

        def get():
            n = sum(len(c) for c in source(size.to_bytes(8, "little") + count.to_bytes(8, "little")))
            assert n == size * count
        return gbps(size * count, best_of(put)), gbps(size * count, best_of(get))


def bench_kvstore(folder: pathlib.Path, tier: str, size: int, count: int) -> tuple[float, float]:
    from kvstore.client import KVStoreClient

    sock = pathlib.Path(tempfile.mkdtemp(prefix="kvsb-")) / "kvstore.sock"
    total = size * count
    host = total * 2 + (64 << 20) if tier == "host" else 2 * size + (1 << 20)
    cfg = folder / f"{tier}.toml"
    data_dir = folder / f"nvme-{tier}"
    cfg.write_text(f"""
[server]
listen = "unix:{sock}"
[tiers.host]
capacity = {host}
[tiers.nvme]
enabled = {"true" if tier == "nvme" else "false"}
path = "{data_dir}"
capacity = {total * 4 + (64 << 20)}
""")
    proc = start([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg)], "kvstore serving on")
    try:
        with KVStoreClient(f"unix:{sock}", timeout=300) as c:
            c.wait_ready()
            rounds = iter(range(1000))
            payload = os.urandom(size)

            def put():
                r = next(rounds)
                keys = [(r * 100000 + i).to_bytes(32, "big") for i in range(count)]
                put.keys = keys
                res = c.put((k, payload) for k in keys)
                assert res.stored == count, res

            def get():
                got = c.get(put.keys)
                assert len(got) == count and all(g.found for g in got)
                expect = "HOST" if tier == "host" else "NVME"
                if tier == "host":
                    assert all(g.tier.name == expect for g in got)
            p = gbps(total, best_of(put))
            if tier == "nvme":
                # every get must come from NVMe: measure each round on blocks not yet promoted
                times = []
                for _ in range(3):
                    put()
                    t0 = time.perf_counter()
                    got = c.get(put.keys)
                    times.append(time.perf_counter() - t0)
                    assert sum(g.tier.name == "NVME" for g in got) >= count - 2
                g = gbps(total, min(times))
            else:
                g = gbps(total, best_of(get))
            return p, g
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(sock.parent, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    ap.add_argument("--dir", default="kvstore-data/bench", help="scratch folder (on the NVMe to measure)")
    args = ap.parse_args()
    sizes = [parse_size(s.strip()) for s in args.sizes.split(",")]
    total = parse_size(args.total)
    folder = pathlib.Path(args.dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)

    echo_sock = pathlib.Path(tempfile.mkdtemp(prefix="kvse-")) / "echo.sock"
    echo = start([sys.executable, "-c", _ECHO_SERVER, f"unix:{echo_sock}"], "ready")
    rows = []
    try:
        for size in sizes:
            count = max(4, total // size)
            print(f"measuring {format_size(size)} blocks x {count} ...", file=sys.stderr, flush=True)
            mc = bench_memcpy(size, count)
            fw, fr, mode = bench_file(folder, size, count)
            ep, eg = bench_grpc_echo(f"unix:{echo_sock}", size, count)
            hp, hg = bench_kvstore(folder, "host", size, count)
            np_, ng = bench_kvstore(folder, "nvme", size, count)
            rows.append((size, mc, fw, fr, mode, ep, eg, hp, hg, np_, ng))
    finally:
        echo.terminate()
        echo.wait(timeout=30)
        shutil.rmtree(echo_sock.parent, ignore_errors=True)

    print("\nLimits measured in this run (GB/s):")
    print(f"{'block':>9} {'memcpy':>8} {'file wr':>8} {'file rd':>8} {'(mode)':>9} {'grpc put':>9} {'grpc get':>9}")
    for size, mc, fw, fr, mode, ep, eg, *_ in rows:
        print(f"{format_size(size):>9} {mc:8.2f} {fw:8.2f} {fr:8.2f} {mode:>9} {ep:9.2f} {eg:9.2f}")
    print("\nkvstore through the daemon (GB/s) and as a ratio of each limit:")
    print(f"{'block':>9} {'op':>9} {'GB/s':>7} {'/memcpy':>8} {'/file':>7} {'/grpc':>7}")
    for size, mc, fw, fr, mode, ep, eg, hp, hg, np_, ng in rows:
        for name, value, file_ref, grpc_ref in (("host put", hp, fw, ep), ("host get", hg, fr, eg),
                                                ("nvme put", np_, fw, ep), ("nvme get", ng, fr, eg)):
            print(f"{format_size(size):>9} {name:>9} {value:7.2f} {value / mc:8.3f} {value / file_ref:7.3f} "
                  f"{value / grpc_ref:7.3f}")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
