#!/usr/bin/env python3
"""Put/Get throughput through the daemon, next to the limits measured in the same run.

Per block size (default 256 KiB, 1 MiB, 4 MiB, and 128 blocks of 32 KiB), over ``--total``
bytes, best of ``--rounds`` rounds (rounds of every path interleaved, so load on the
machine hits them alike):

limits
  - ``memcpy``: streaming copy of ``--total`` bytes between two buffers that large (the
    physical limit of one copy; a cache-resident copy is several times faster);
  - ``file``: raw O_DIRECT write (+ one fsync) and read of the same blocks (aligned
    buffer), the write over the blocks of the previous round; ``file new``: the same
    write into newly allocated space (the file cut to 0 first, untimed), what a put of
    new blocks asks of the disk (ext4 on this team's VMs: about half as fast);
  - ``raw gRPC``: a bare grpcio server in a separate process streaming the same bytes as
    generic byte messages (a client stream for put, a server stream for get), distinct
    payloads held in memory like the blocks; on the unix socket, and on 127.0.0.1 as the
    limit of ``gRPC TCP``;
and, beside them, the least work a store adds to those, as limits of what it does per block:
  - ``file per block``: each block written O_DIRECT over a file kept from the previous
    round, then renamed to its block's name, a few threads, one fsync of the folder (what a
    put into a full tier of block files asks of the file system, before checksums and index);
  - ``raw gRPC with the copies``: the same streams with one copy per block on each side, in
    and out of memory (a put copies its buffer into the message and the server copies the
    message into its memory; a get the other way round), as ``put_from`` / ``get_into``
    over gRPC do at the least;
kvstore, daemon in a separate process (``kvstore serve``):
  - ``zero-copy``: same node, ``put_from`` / ``get_into`` through the shared host arena
    (leases as control frames on the arena session); ``zero-copy gRPC ctl``: the same with
    Lookup and Lease as gRPC calls (the path before control frames);
  - ``gRPC unix`` and ``gRPC TCP``: the same calls with ``shared_memory=False`` (raw
    frames over gRPC) on the unix socket and on 127.0.0.1;
  - ``NVMe``: a host tier of a few blocks, so puts demote to NVMe and gets read NVMe
    (zero-copy: promoted into the arena, then copied; gRPC: read straight into frames).
    The NVMe tier holds ``3 x --total`` and is filled before the rounds of each block
    size, so every put evicts as in a cache in service (a put into a new tier writes new
    space: ``file new`` is its limit).

Figures are GB/s (1e9 B/s); ratios compare with the limits of the same run. For the
128 x 32 KiB batch the p50/p99 latency of one ``get_into`` (lookup included) is printed too.

With ``--nvme-fsync`` the NVMe tier flushes every put (``[tiers.nvme] fsync = true``, group
commit), like the raw write's fsync; ``--paths`` runs some kvstore paths only.

    python bench/throughput.py [--sizes 256KiB,1MiB,4MiB] [--total 256MiB] [--rounds 3] [--dir DIR]
                               [--paths "NVMe zero-copy,NVMe gRPC"] [--nvme-fsync]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.common.units import format_size, parse_size  # noqa: E402

_ECHO_SERVER = r"""
import sys
from concurrent import futures
import grpc

def sink(request_iterator, context):
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")

HELD = {}

def source(request, context):
    # count distinct payloads held in memory, as a store holds its blocks (one payload
    # sent count times would stay in the CPU cache, a best case no store serves)
    size = int.from_bytes(request[:8], "little")
    count = int.from_bytes(request[8:16], "little")
    if (size, count) not in HELD:
        HELD.clear()
        HELD[size, count] = [bytes([i % 251 + 1]) * size for i in range(count)]
    yield from HELD[size, count]

STORED = {}

def sink_copy(request_iterator, context):
    # each message copied into memory held by the server, as a store copies a put into its tier
    n = 0
    for chunk in request_iterator:
        size = len(chunk)
        if STORED.get("size") != size:
            STORED.clear()
            STORED["size"], STORED["mem"] = size, bytearray(size * 64)
        mem = STORED["mem"]
        slot = (n // size) % 64 * size
        mem[slot:slot + size] = chunk
        n += size
    return n.to_bytes(8, "little")

def source_copy(request, context):
    # each payload copied out of memory into its message, as a store copies a block into a frame
    size = int.from_bytes(request[:8], "little")
    count = int.from_bytes(request[8:16], "little")
    if (size, count) not in HELD:
        HELD.clear()
        HELD[size, count] = [bytes([i % 251 + 1]) * size for i in range(count)]
    for payload in HELD[size, count]:
        yield bytes(memoryview(payload))

handlers = {
    "Sink": grpc.stream_unary_rpc_method_handler(sink),
    "Source": grpc.unary_stream_rpc_method_handler(source),
    "SinkCopy": grpc.stream_unary_rpc_method_handler(sink_copy),
    "SourceCopy": grpc.unary_stream_rpc_method_handler(source_copy),
}
opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
port = server.add_insecure_port(sys.argv[1])
server.start()
print("ready", port, flush=True)
server.wait_for_termination()
"""


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def memcpy_stream(total: int):
    src = np.ones(total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    np.copyto(dst, src)                                   # pages touched outside the timing
    return lambda: np.copyto(dst, src)


class RawFile:
    """Raw O_DIRECT (or buffered, if refused) block writes and reads in ``folder``."""

    def __init__(self, folder: pathlib.Path, size: int, count: int):
        self.path = folder / "raw.bin"
        self.size, self.count = size, count
        self.aligned = (size + 4095) // 4096 * 4096
        self.buf = mmap.mmap(-1, self.aligned)
        self.buf.write(b"\x02" * self.aligned)
        self.mode = "O_DIRECT"
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
            os.pwrite(self.fd, self.buf, 0)
        except OSError:
            self.mode = "buffered"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.view = memoryview(self.buf)

    def fresh(self) -> None:
        """Cut the file to 0 bytes: the next write allocates its space anew."""
        os.ftruncate(self.fd, 0)
        os.fsync(self.fd)

    def write(self) -> None:
        for i in range(self.count):
            os.pwrite(self.fd, self.view, i * self.aligned)
        os.fsync(self.fd)

    def read(self) -> None:
        for i in range(self.count):
            os.preadv(self.fd, [self.view], i * self.aligned)

    def close(self) -> None:
        os.close(self.fd)
        self.view.release()
        self.buf.close()
        self.path.unlink()


class BlockFiles:
    """Raw writes of one file per block, as a store of content-addressed block files makes
    them: each block written O_DIRECT over a file kept from an earlier round (as an
    evicted block's file is reused), then renamed to its block's name; ``workers`` threads
    (one per core, at most 4), one fsync of the folder at the end. The least a put into a
    full tier of block files asks of this file system, before any checksum or index."""

    def __init__(self, folder: pathlib.Path, size: int, count: int):
        self.size, self.count = size, count
        self.aligned = (size + 4095) // 4096 * 4096
        self.workers = max(1, min(4, os.cpu_count() or 1))
        self.folder = folder / "block-files"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.names = [self.folder / "a", self.folder / "b"]
        for d in self.names:
            d.mkdir(parents=True)
        self.bufs = [mmap.mmap(-1, self.aligned) for _ in range(self.workers)]
        for b in self.bufs:
            b.write(b"\x02" * self.aligned)
        self.flags = os.O_WRONLY | getattr(os, "O_DIRECT", 0)
        try:
            self._fill(0, self.names[0], os.O_CREAT)
        except OSError:                              # no O_DIRECT here: buffered
            self.flags = os.O_WRONLY
            self._fill(0, self.names[0], os.O_CREAT)
        for w in range(1, self.workers):
            self._fill(w, self.names[0], os.O_CREAT)
        self.round = 0
        self.pool = ThreadPoolExecutor(self.workers)

    def _fill(self, worker: int, into: pathlib.Path, extra: int = 0, moved_to: pathlib.Path | None = None) -> None:
        buf = memoryview(self.bufs[worker])
        for i in range(worker, self.count, self.workers):
            path = into / f"{i:08x}"
            fd = os.open(path, self.flags | extra, 0o600)
            try:
                os.pwrite(fd, buf, 0)
            finally:
                os.close(fd)
            if moved_to is not None:
                os.rename(path, moved_to / f"{i:08x}")
        buf.release()

    def write(self) -> None:
        old, new = self.names[self.round % 2], self.names[(self.round + 1) % 2]
        self.round += 1
        for f in [self.pool.submit(self._fill, w, old, 0, new) for w in range(self.workers)]:
            f.result()
        fd = os.open(new, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.pool.shutdown()
        for b in self.bufs:
            b.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(cmd: list[str], ready_line: str) -> tuple[subprocess.Popen, str]:
    """Start ``cmd``; returns the process and its first output line containing ``ready_line``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if ready_line in line:
            return proc, line.strip()
    raise RuntimeError(f"{cmd} exited before it was ready")


def echo_calls(address: str, size: int, count: int):
    import grpc

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    ch = grpc.insecure_channel(address, options=opts)
    grpc.channel_ready_future(ch).result(timeout=30)
    sink, source = ch.stream_unary("/bench.Echo/Sink"), ch.unary_stream("/bench.Echo/Source")
    sink_copy, source_copy = ch.stream_unary("/bench.Echo/SinkCopy"), ch.unary_stream("/bench.Echo/SourceCopy")
    payloads = [bytes([i % 251 + 3]) * size for i in range(count)]     # distinct, as the blocks put
    src = np.random.default_rng(1).integers(0, 256, (count, size), dtype=np.uint8)
    out = np.empty((count, size), dtype=np.uint8)
    ask = size.to_bytes(8, "little") + count.to_bytes(8, "little")

    def put():
        assert int.from_bytes(sink(iter(payloads)), "little") == size * count

    def get():
        assert sum(len(c) for c in source(ask)) == size * count

    def put_copies():                   # one copy per block on each side, as put_from by gRPC
        assert int.from_bytes(sink_copy(src[i].tobytes() for i in range(count)), "little") == size * count

    def get_copies():                   # one copy per block on each side, as get_into by gRPC
        n = 0
        for n, message in enumerate(source_copy(ask), 1):
            out[n - 1] = np.frombuffer(message, dtype=np.uint8)
        assert n == count
    get_copies.out = out
    get()                                                 # the server makes its payloads
    return put, get, put_copies, get_copies, ch


class Daemon:
    """``kvstore serve`` in its own process with a config for this measurement."""

    def __init__(self, folder: pathlib.Path, name: str, host_bytes: int, nvme_bytes: int, listen: str,
                 fsync: bool = False):
        self.sock_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvsb-"))
        self.listen = listen.replace("SOCK", str(self.sock_dir / "kvstore.sock"))
        self.data = folder / f"nvme-{name}"
        cfg = folder / f"{name}.toml"
        cfg.write_text(f"""
[server]
listen = "{self.listen}"
max_message_bytes = "64MiB"
[tiers.host]
capacity = {host_bytes}
[tiers.nvme]
enabled = {"true" if nvme_bytes else "false"}
path = "{self.data}"
capacity = {max(nvme_bytes, 1 << 20)}
fsync = {"true" if fsync else "false"}
""")
        self.proc, banner = start([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(cfg)],
                                  "kvstore serving on")
        self.address = banner.rsplit(" ", 1)[1]        # "kvstore serving on ADDRESS"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.data, ignore_errors=True)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def kv_calls(address: str, size: int, count: int, shm: bool, tag: str, nvme: bool, control: bool = True):
    """put and get closures moving ``count`` blocks of ``size`` bytes; each put stores new keys
    (``control`` False: the arena's Lookup and Lease go by gRPC, not as control frames)."""
    from kvstore.client.client import KVStoreClient

    c = KVStoreClient(address, timeout=600, shared_memory=shm)
    c.wait_ready(30)
    if shm:
        assert c.shared_memory, f"{address}: the shared arena is not available"
        if not control:
            c.arena().control = None
    src = np.random.default_rng(1).integers(0, 256, (count, size), dtype=np.uint8)
    out = np.empty((count, size), dtype=np.uint8)
    state = {"round": 0, "keys": []}

    def new_keys():
        state["round"] += 1
        return [hashlib.sha256(f"{tag}-{size}-{state['round']}-{i}".encode()).digest() for i in range(count)]

    def put():
        keys = new_keys()
        r = c.put_from(keys, src)
        assert r.stored == count, r
        state["keys"] = keys

    def get():
        g = c.get_into(state["keys"], out)
        assert g.found == count, g.found

    def fresh_get():                     # NVMe: blocks written this round, not yet promoted
        put()
        return timed(get)

    def lookup():
        assert c.lookup(state["keys"]).hit_blocks == count
    get.lookup = lookup
    return put, get, (fresh_get if nvme else None), c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-latency", type=int, default=200, help="get_into calls timed for the 32 KiB batch")
    ap.add_argument("--dir", default="kvstore-data/bench", help="scratch folder (on the NVMe to measure)")
    ap.add_argument("--paths", default="", help="kvstore paths to run, comma-separated (default: all)")
    ap.add_argument("--nvme-fsync", action="store_true", help="the NVMe tier flushes every put (fsync = true)")
    args = ap.parse_args()
    only = {p.strip() for p in args.paths.split(",") if p.strip()}
    sizes = [(parse_size(s.strip()), None) for s in args.sizes.split(",")] + [(32 << 10, 128)]
    total = parse_size(args.total)
    folder = pathlib.Path(args.dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    echo_sock = pathlib.Path(tempfile.mkdtemp(prefix="kvse-")) / "echo.sock"
    echo, _ = start([sys.executable, "-c", _ECHO_SERVER, f"unix:{echo_sock}"], "ready")
    echo_tcp, banner = start([sys.executable, "-c", _ECHO_SERVER, "127.0.0.1:0"], "ready")
    echo_tcp_address = f"127.0.0.1:{banner.split()[1]}"
    arena = total * 2 + (64 << 20)
    nvme_bytes = total * 3
    wanted = {"unix": ("zero-copy", "gRPC unix"), "tcp": ("gRPC TCP",), "nvme": ("NVMe zero-copy", "NVMe gRPC")}
    wanted = {d: names for d, names in wanted.items() if not only or only & set(names)}
    daemons = {
        "unix": lambda: Daemon(folder, "host", arena, 0, "unix:SOCK"),
        "tcp": lambda: Daemon(folder, "tcp", arena, 0, "127.0.0.1:0"),
        "nvme": lambda: Daemon(folder, "nvme", 16 << 20, nvme_bytes, "unix:SOCK", fsync=args.nvme_fsync),
    }
    daemons = {d: start_daemon() for d, start_daemon in daemons.items() if d in wanted}
    rows = []
    try:
        for size, batch in sizes:
            count = batch or max(4, total // size)
            label = f"{batch}x{format_size(size)}" if batch else format_size(size)
            print(f"measuring {label} blocks x {count} ...", file=sys.stderr, flush=True)
            raw = RawFile(folder, size, count)
            files = BlockFiles(folder, size, count)
            e_put, e_get, e_put_cp, e_get_cp, ch = echo_calls(f"unix:{echo_sock}", size, count)
            et_put, et_get, et_put_cp, et_get_cp, ch_tcp = echo_calls(echo_tcp_address, size, count)
            copy = memcpy_stream(size * count)
            paths = {
                "zero-copy": lambda: kv_calls(daemons["unix"].address, size, count, True, "z", False),
                "zero-copy gRPC ctl": lambda: kv_calls(daemons["unix"].address, size, count, True, "zg", False, False),
                "gRPC unix": lambda: kv_calls(daemons["unix"].address, size, count, False, "u", False),
                "gRPC TCP": lambda: kv_calls(daemons["tcp"].address, size, count, False, "t", False),
                "NVMe zero-copy": lambda: kv_calls(daemons["nvme"].address, size, count, True, "nz", True),
                "NVMe gRPC": lambda: kv_calls(daemons["nvme"].address, size, count, False, "ng", True),
            }
            paths = {name: calls() for name, calls in paths.items() if not only or name in only}
            best: dict[str, float] = {}
            for name, (put, *_rest) in paths.items():
                if name.startswith("NVMe"):      # a full tier: each put evicts (see the docstring)
                    print(f"  filling the NVMe tier by {name} ...", file=sys.stderr, flush=True)
                    for _ in range(-(-nvme_bytes // (size * count)) + 1):
                        put()

            def note(name: str, seconds: float) -> None:
                best[name] = min(best.get(name, float("inf")), seconds)
            for _ in range(args.rounds):
                note("memcpy", timed(copy))
                note("file write", timed(raw.write))
                note("file read", timed(raw.read))
                raw.fresh()
                note("file write new", timed(raw.write))
                note("file per block", timed(files.write))
                note("raw gRPC put", timed(e_put))
                note("raw gRPC get", timed(e_get))
                note("raw gRPC TCP put", timed(et_put))
                note("raw gRPC TCP get", timed(et_get))
                note("raw gRPC put copies", timed(e_put_cp))
                note("raw gRPC get copies", timed(e_get_cp))
                note("raw gRPC TCP put copies", timed(et_put_cp))
                note("raw gRPC TCP get copies", timed(et_get_cp))
                for name, (put, get, fresh, _) in paths.items():
                    note(f"{name} put", timed(put))
                    note(f"{name} get", fresh() if fresh else timed(get))
            nbytes = size * count
            rates = {k: gbps(nbytes, v) for k, v in best.items()}
            lat = None
            if batch and "zero-copy" in paths:
                put, get, _, c = paths["zero-copy"]
                put()
                times = []
                for _ in range(args.batch_latency):
                    t0 = time.perf_counter()
                    get.lookup()
                    get()
                    times.append(time.perf_counter() - t0)
                times.sort()
                lat = (times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3)
            rows.append((label, raw.mode, rates, lat))
            print(f"  load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            raw.close()
            files.close()
            ch.close()
            ch_tcp.close()
            for *_, c in paths.values():
                c.close()
    finally:
        for d in daemons.values():
            d.stop()
        for e in (echo, echo_tcp):
            e.terminate()
            e.wait(timeout=30)
        shutil.rmtree(echo_sock.parent, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    report(rows)
    return 0


def report(rows) -> None:
    print("\nLimits measured in this run (GB/s):")
    print(f"{'block':>14} {'memcpy':>8} {'file wr':>8} {'file new':>8} {'file rd':>8} {'(mode)':>9} "
          f"{'gRPC put':>9} {'gRPC get':>9} {'TCP put':>8} {'TCP get':>8}")
    for label, mode, r, _ in rows:
        print(f"{label:>14} {r['memcpy']:8.2f} {r['file write']:8.2f} {r['file write new']:8.2f} "
              f"{r['file read']:8.2f} {mode:>9} {r['raw gRPC put']:9.2f} {r['raw gRPC get']:9.2f} "
              f"{r['raw gRPC TCP put']:8.2f} {r['raw gRPC TCP get']:8.2f}")
    print("\n... and with the least work a store adds (GB/s): a file per block (written over a kept file,"
          "\nrenamed into place); raw gRPC with one copy per block on each side (in and out of memory):")
    print(f"{'block':>14} {'file/blk':>8} {'gRPC put':>9} {'gRPC get':>9} {'TCP put':>8} {'TCP get':>8}")
    for label, _, r, _ in rows:
        print(f"{label:>14} {r['file per block']:8.2f} {r['raw gRPC put copies']:9.2f} "
              f"{r['raw gRPC get copies']:9.2f} {r['raw gRPC TCP put copies']:8.2f} {r['raw gRPC TCP get copies']:8.2f}")
    print("\nkvstore, daemon in its own process (GB/s, and the ratio to the limit it is held to):")
    print(f"{'block':>14} {'path':>18} {'put':>7} {'get':>7}   {'put ratio':>18} {'get ratio':>18}")
    for label, _, r, lat in rows:
        for name, ref, ref_name in (("zero-copy", ("memcpy", "memcpy"), "memcpy"),
                                    ("zero-copy gRPC ctl", ("memcpy", "memcpy"), "memcpy"),
                                    ("gRPC unix", ("raw gRPC put", "raw gRPC get"), "raw gRPC"),
                                    ("gRPC TCP", ("raw gRPC TCP put", "raw gRPC TCP get"), "raw TCP"),
                                    ("NVMe zero-copy", ("file write", "file read"), "file"),
                                    ("NVMe gRPC", ("file write", "file read"), "file")):
            if f"{name} put" not in r:
                continue
            p, g = r[f"{name} put"], r[f"{name} get"]
            print(f"{label:>14} {name:>18} {p:7.2f} {g:7.2f}   {p / r[ref[0]]:7.2f}x {ref_name:>9} "
                  f"{g / r[ref[1]]:7.2f}x {ref_name:>9}")
            if name.startswith("NVMe"):
                print(f"{label:>14} {name:>18} put {p / r['file write new']:.2f}x a write into new space, "
                      f"{p / r['file per block']:.2f}x a file per block")
            elif name.startswith("gRPC"):
                raw_name = "raw gRPC TCP" if name.endswith("TCP") else "raw gRPC"
                print(f"{label:>14} {name:>18} put {p / r[raw_name + ' put copies']:.2f}x, get "
                      f"{g / r[raw_name + ' get copies']:.2f}x {raw_name} with the copies")
        if lat:
            print(f"{label:>14} {'lookup+get_into':>16} p50 {lat[0]:.2f} ms, p99 {lat[1]:.2f} ms (one batch)")


if __name__ == "__main__":
    sys.exit(main())
