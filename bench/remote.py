#!/usr/bin/env python3
"""Remote tier (Mooncake Store) get/put throughput next to raw Mooncake on the same bytes.

One run starts a loopback cluster: a master, and a storage node in another process that
mounts the only segment, so every byte crosses the Transfer Engine over TCP (the client
under test mounts none). For each block size and batch it measures, in this order:

- ``TE``: raw Transfer Engine, batch write/read of the same blocks between a registered
  buffer here and one in another process (the transport's limit);
- ``store``: raw ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the
  same blocks from/into a registered buffer (what Mooncake itself gives);
- ``tier``: our :class:`tiers.mooncake.MooncakeTier` ``put_many`` / ``get_many_into``
  (header, xxh3 checksum, staging copy, verify on every get, deadline guard), and the
  two-phase ``reserve/write/commit`` + ``read_into`` path for batch 1;

- ``daemon``: the same bytes through two ``kvstore serve`` processes of the cluster
  (:mod:`bench.remote_daemon`): a client of daemon B getting blocks only the cluster
  holds (paged into B's arena), and a client of daemon A putting with write-through;
  each next to the same call on blocks B holds itself (``local``);

and prints GB/s (1e9 B/s) with ``/store`` and ``/TE`` ratios (gets against TE reads,
puts against TE writes) and, for daemon calls, ``/local``. Puts use fresh keys each
round (a put of an existing key is a no-op in Mooncake) and are removed between cases,
outside the timing.

    python bench/remote.py [--sizes 1MiB,4MiB] [--batches 1,16] [--total 256MiB] [--repeat 3] [--no-daemons]
                           [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.common.units import format_size, parse_size  # noqa: E402
from tiers.mooncake.client import mooncake_missing, store_class  # noqa: E402
from tiers.mooncake.local_cluster import LocalMaster, LocalSegment, free_port  # noqa: E402


def _te_target(metadata: str, nbytes: int) -> None:
    """Child process: a Transfer Engine with one registered buffer, until stdin closes."""
    from mooncake.engine import TransferEngine

    name = f"127.0.0.1:{free_port()}"
    engine = TransferEngine()
    assert engine.initialize(name, metadata, "tcp", "") == 0
    buf = np.ones(nbytes, np.uint8)
    assert engine.register_memory(buf.ctypes.data, nbytes) == 0
    print(f"ready {name} {buf.ctypes.data}", flush=True)
    sys.stdin.read()


def timed_rounds(fn, nbytes_per_round: int, total: int) -> float:
    """GB/s of ``fn(r)`` over enough rounds ``r`` to move ``total`` bytes, after one warm-up."""
    fn()
    rounds = max(1, total // nbytes_per_round)
    t0 = time.perf_counter()
    for r in range(rounds):
        fn(r)
    return rounds * nbytes_per_round / (time.perf_counter() - t0) / 1e9


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class Raw:
    """The raw store and TE baselines over one registered buffer of ``nbytes``."""

    def __init__(self, master: LocalMaster, nbytes: int):
        self.buf = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
        self.out = np.zeros(nbytes, np.uint8)
        self.store = store_class()()
        assert self.store.setup({"local_hostname": "127.0.0.1", "metadata_server": master.metadata_server,
                                 "global_segment_size": 0, "local_buffer_size": 16 << 20, "protocol": "tcp",
                                 "master_server_addr": master.address}) == 0
        for b in (self.buf, self.out):
            assert self.store.register_buffer(b.ctypes.data, b.nbytes) == 0
        from mooncake.engine import TransferEngine

        self.child = subprocess.Popen([sys.executable, __file__, "--te-target", master.metadata_server, str(nbytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _, self.peer, addr = self.child.stdout.readline().split()
        self.peer_addr = int(addr)
        self.te = TransferEngine()
        assert self.te.initialize(f"127.0.0.1:{free_port()}", master.metadata_server, "tcp", "") == 0
        assert self.te.register_memory(self.out.ctypes.data, nbytes) == 0

    def te_rate(self, size: int, batch: int, total: int, write: bool) -> float:
        srcs = [self.out.ctypes.data + i * size for i in range(batch)]
        dsts = [self.peer_addr + i * size for i in range(batch)]
        op = self.te.batch_transfer_sync_write if write else self.te.batch_transfer_sync_read

        def run(_r=0):
            assert op(self.peer, srcs, dsts, [size] * batch) == 0
        return timed_rounds(run, size * batch, total)

    def store_put(self, size: int, batch: int, total: int, prefix: str) -> float:
        ptrs = [self.buf.ctypes.data + i * size for i in range(batch)]

        def run(r=-1):
            names = [f"{prefix}{r}/{i}" for i in range(batch)]
            assert self.store.batch_put_from(names, ptrs, [size] * batch) == [0] * batch
        rate = timed_rounds(run, size * batch, total)
        self.store.remove_by_regex(f"^{prefix}.*", True)
        return rate

    def store_get(self, size: int, batch: int, total: int, prefix: str) -> float:
        names = [f"{prefix}{i}" for i in range(batch)]
        assert self.store.batch_put_from(names, [self.buf.ctypes.data + i * size for i in range(batch)],
                                         [size] * batch) == [0] * batch
        ptrs = [self.out.ctypes.data + i * size for i in range(batch)]

        def run(_r=0):
            assert self.store.batch_get_into(names, ptrs, [size] * batch) == [size] * batch
        rate = timed_rounds(run, size * batch, total)
        assert self.out[:size].tobytes() == self.buf[:size].tobytes()
        self.store.remove_by_regex(f"^{prefix}.*", True)
        return rate

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(30)
        self.store.close()


def tier_rates(tier, raw: Raw, size: int, batch: int, total: int) -> dict:
    blocks = [raw.buf[i * size:(i + 1) * size] for i in range(batch)]
    outs = [raw.out[i * size:(i + 1) * size] for i in range(batch)]
    run_id = uuid.uuid4().bytes[:8]

    def key(r, i):
        return run_id + r.to_bytes(4, "big", signed=True) + i.to_bytes(4, "big") + bytes(16)

    def put(r=-1):
        assert tier.put_many([(key(r, i), blocks[i]) for i in range(batch)]) == [True] * batch
    rates = {"tier put": timed_rounds(put, size * batch, total)}
    for k in tier.keys():                                # drop them, outside the timing
        tier.free(k)
    tier.flush(60)
    keys = [key(10**6, i) for i in range(batch)]
    assert tier.put_many([(k, b) for k, b in zip(keys, blocks)]) == [True] * batch

    def get(_r=0):
        assert tier.get_many_into(keys, outs) == [size] * batch
    rates["tier get"] = timed_rounds(get, size * batch, total)
    assert all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocks))
    if batch == 1:
        def put2(r=-1):
            k = key(r + 2 * 10**6 + 7, 0)
            tier.reserve(k, size)
            tier.write(k, 0, blocks[0])
            tier.commit(k)
        rates["tier put (2-phase)"] = timed_rounds(put2, size, total)
        for k in tier.keys():
            if k != keys[0]:
                tier.free(k)
        tier.flush(60)

        def get2(_r=0):
            assert tier.read_into(keys[0], outs[0]) == size
        rates["tier get (read_into)"] = timed_rounds(get2, size, total)
    for k in tier.keys():
        tier.free(k)
    tier.flush(60)
    return rates


def _rows(samples: dict[tuple, list[float]]) -> list[dict]:
    """Medians and ratios of the tier's and the daemons' figures."""
    rows = []
    for (size, batch, who, op), values in samples.items():
        if who not in ("tier", "daemon") or "(local)" in op:
            continue
        kind = "put" if "put" in op else "get"
        rate, store, te = (median(values), median(samples[(size, batch, "store", kind)]),
                           median(samples[(size, batch, "te", kind)]))
        local = 0.0
        if who == "daemon":
            local = median(samples[(size, batch, "daemon", op.split(" (")[0] + " (local)")])
        rows.append({"block": size, "batch": batch, "op": op,
                     "GBps": rate, "store_GBps": store, "te_GBps": te, "local_GBps": local,
                     "over_store": rate / store, "over_te": rate / te, "over_local": rate / local if local else 0.0,
                     "samples": len(values)})
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--te-target":
        _te_target(sys.argv[2], int(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1MiB,4MiB")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    p.add_argument("--repeat", type=int, default=3, help="measurements per figure (the median is shown)")
    p.add_argument("--no-daemons", action="store_true", help="skip the daemon-level figures")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    repeat = max(1, args.repeat)
    reason = mooncake_missing()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from tiers.mooncake.tier import MooncakeConfig, MooncakeTier

    from remote_daemon import Daemons, daemon_rates

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    total = parse_size(args.total)
    span = max(sizes) * max(batches)
    rows = []
    with LocalMaster() as master:
        # Room for every put of a measurement (they are removed between measurements).
        peer = LocalSegment(master, 3 * (total + span) + (256 << 20)).start()
        raw = Raw(master, span)
        tier = MooncakeTier(MooncakeConfig(master=master.address, metadata_server=master.metadata_server,
                                           segment_bytes=0, capacity_bytes=8 << 30, staging_bytes=span + (8 << 20),
                                           timeout_s=5.0), name="bench", wait_connected_s=60)
        samples: dict[tuple, list[float]] = {}
        daemons = None
        try:
            if not args.no_daemons:
                daemons = Daemons(master, host_bytes=total + 2 * span + (64 << 20), staging_bytes=span + (8 << 20))
            # The machine is shared and its load drifts: every repetition measures each
            # case's TE, store and tier figures back to back, and each figure is the
            # median over repetitions.
            for _ in range(repeat):
                for size in sizes:
                    for batch in batches:
                        case = (size, batch)
                        for kind, write in (("put", True), ("get", False)):
                            samples.setdefault(case + ("te", kind), []).append(raw.te_rate(size, batch, total, write))
                        samples.setdefault(case + ("store", "put"), []).append(
                            raw.store_put(size, batch, total, f"raw{size}x{batch}/"))
                        samples.setdefault(case + ("store", "get"), []).append(
                            raw.store_get(size, batch, total, f"rawg{size}x{batch}/"))
                        for op, rate in tier_rates(tier, raw, size, batch, total).items():
                            samples.setdefault(case + ("tier", op), []).append(rate)
                        if daemons is not None:
                            blocks = [raw.buf[i * size:(i + 1) * size] for i in range(batch)]
                            for op, rate in daemon_rates(daemons, tier, blocks, size, batch, total).items():
                                samples.setdefault(case + ("daemon", op), []).append(rate)
            rows = _rows(samples)
        finally:
            if daemons is not None:
                daemons.close()
            tier.close()
            raw.close()
            peer.kill()
    print(f"{'block':>6} {'batch':>5} {'op':<27} {'GB/s':>7} {'store':>7} {'TE':>7} {'local':>7} {'/store':>7} "
          f"{'/TE':>6} {'/local':>7}")
    for r in rows:
        local = f"{r['local_GBps']:7.3f}" if r["local_GBps"] else f"{'':7}"
        ratio = f"{r['over_local']:7.2f}" if r["local_GBps"] else f"{'':7}"
        print(f"{format_size(r['block']):>6} {r['batch']:>5} {r['op']:<27} {r['GBps']:7.3f} {r['store_GBps']:7.3f} "
              f"{r['te_GBps']:7.3f} {local} {r['over_store']:7.2f} {r['over_te']:6.2f} {ratio}")
    print(f"GB/s (1e9 B/s), medians of {repeat} interleaved runs; store = raw Mooncake batch_put_from/"
          "batch_get_into, TE = raw Transfer Engine batch write/read, local = the same daemon call on blocks "
          "the daemon holds (puts: no write-through); same blocks, same run")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
