#!/usr/bin/env python3
"""One engine step's load of a 32-layer model: a ``get_into`` per layer (before) against one
leased read of every layer (``store_io.load_stages``, after), with the daemon's block table
and without it (leased), measured in the same run.

Both arms fill the same per-layer staging tensors with the rank's KV heads of every block
(two byte ranges per layer, ``docs/block_layout.md``), as the vLLM worker's loader thread does:

- **before**: ``store_io.load_blocks`` once per layer (a Lease per layer, or more when the
  load is larger than one lease may hold);
- **after**: ``store_io.load_stages`` (blocks in the daemon's block table read with no lease,
  the others leased once; layers copied one after the other);
- **leased**: the same with the block table off (``KVSTORE_BLOCK_TABLE=0`` for that client's
  mapping): every block leased once, one Lease round trip per step.

Two cases, each against its own daemon in its own process (unix socket, shared arena):

- **host**: ``--blocks`` blocks held in a 64 MiB host tier;
- **nvme**: ``--nvme-blocks`` blocks of 128 KiB (default 160: 20 MiB, more than the host
  tier) only on NVMe behind a 16 MiB host tier (a lease holds a quarter of it: 4 MiB),
  demoted again before every load.

Per load: its wall time (every layer in place), the time until layer 0 was in place, the
Lease and GetRaw calls the daemon counted (its ``kvstore:request_seconds`` histogram) and
the promotions it made (``Stats``). Medians over ``--rounds`` rounds, the two arms taking
turns (their order swapped every round); every load is checked bit for bit. A benchmark
reports; it does not judge.

    python bench/step_load.py [--rounds 7] [--blocks 48] [--nvme-blocks 160] [--layers 32] [--tp 1]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_DAEMON = r"""
import sys
from kvstore import config
from kvstore.service.startup import start_server
d = start_server(config.load(sys.argv[1]))
print("ready", d.address, d.metrics.port, flush=True)
for line in sys.stdin:                      # a line of hex keys: demote them out of the host tier
    for k in line.split():
        d.manager.demote(bytes.fromhex(k), 0)
    d.manager.drain()
    print("done", flush=True)
d.stop(0)
"""


class Daemon:
    """A daemon in its own process; :meth:`demote` moves blocks out of its host tier."""

    def __init__(self, folder: pathlib.Path, host: str, nvme: bool):
        cfg = folder / "node.toml"
        cfg.write_text(f'[server]\nlisten = "unix:{folder}/kvstore.sock"\nworkers = 8\n'
                       f'[metrics]\nlisten = "127.0.0.1:0"\n[tiers.host]\ncapacity = "{host}"\n'
                       f'[tiers.nvme]\nenabled = {"true" if nvme else "false"}\npath = "{folder}/nvme"\n'
                       f'capacity = "2GiB"\n')
        self.proc = subprocess.Popen([sys.executable, "-c", _DAEMON, str(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError(f"daemon did not start: {line!r}")
        self.address, self.metrics = line[1], f"http://127.0.0.1:{line[2]}/metrics"

    def demote(self, keys) -> None:
        self.proc.stdin.write(" ".join(k.hex() for k in keys) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def rpcs(self) -> dict[str, int]:
        text = urllib.request.urlopen(self.metrics, timeout=30).read().decode()
        return {m: int(float(v)) for m, v in
                re.findall(r'kvstore:request_seconds_count\{method="(\w+)",tenant=""\} (\S+)', text)}

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def load_before(store_io, client, keys, layout, heads, staging) -> float:
    """A ``load_blocks`` per layer; returns the seconds until layer 0 was in place."""
    t0 = time.perf_counter()
    first = None
    for layer in range(layout.num_layers):
        ok = store_io.load_blocks(client, keys, staging[layer], ranges=layout.layer_ranges(layer, heads))
        assert all(ok), f"layer {layer}: {ok.count(False)} blocks missing"
        first = first if first is not None else time.perf_counter() - t0
    return first


def load_after(store_io, client, keys, layout, heads, staging) -> float:
    """One ``load_stages``; returns the seconds until layer 0 was in place."""
    t0 = time.perf_counter()
    first: list[float] = []
    want = staging[0][0].nbytes

    def publish(layer, sizes):
        assert all(s == want for s in sizes), f"layer {layer}: blocks missing"
        if not first:
            first.append(time.perf_counter() - t0)
    stages = [store_io.ReadStage(layout.layer_ranges(layer, heads), staging[layer])
              for layer in range(layout.num_layers)]
    store_io.load_stages(client, keys, stages, publish=publish)
    return first[0]


def run_case(name: str, daemon: Daemon, args, n: int, head_dim: int, nvme: bool) -> dict:
    import torch

    from engine_adapter import store_io
    from engine_adapter.layout import BlockLayout
    from kvstore.client.client import KVStoreClient

    layout = BlockLayout(num_layers=args.layers, num_kv_heads=2 * args.tp, block_tokens=16, head_dim=head_dim,
                         dtype=torch.float16)
    heads = (0, 2)                                   # rank 0's KV heads
    keys = [f"{name}-{i}".encode().ljust(32, b".") for i in range(n)]
    blocks = torch.randn((n,) + layout.block_shape(), generator=torch.Generator().manual_seed(1)).to(torch.float16)
    want = [blocks[:, layer:layer + 1, :, heads[0]:heads[1]].contiguous() for layer in range(layout.num_layers)]
    arms = {"before": load_before, "after": load_after, "leased": load_after}
    rows: dict[str, dict[str, list[float]]] = {a: {"load": [], "first": [], "lease": [], "get": [], "promotions": []}
                                               for a in arms}
    os.environ["KVSTORE_BLOCK_TABLE"] = "0"          # read when a client maps the arena
    leased = KVStoreClient(daemon.address, shared_memory=True, timeout=120)
    assert leased.arena() is not None and leased.arena().table is None
    del os.environ["KVSTORE_BLOCK_TABLE"]
    with KVStoreClient(daemon.address, shared_memory=True, timeout=120) as c, leased:
        assert c.put_from(keys, blocks, sizes=layout.block_bytes).stored == n
        assert c.shared_memory and c.arena() is not None
        client = {"before": c, "after": c, "leased": leased}
        staging = [torch.empty_like(w) for w in want]
        order = list(arms)
        for r in range(args.rounds):
            for arm in (order if r % 2 == 0 else order[::-1]):
                if nvme:
                    daemon.demote(keys)
                for s in staging:
                    s.zero_()
                rpc, promo = daemon.rpcs(), c.stats()["counters"].get("promotions", 0)
                t0 = time.perf_counter()
                first = arms[arm](store_io, client[arm], keys, layout, heads, staging)
                took = time.perf_counter() - t0
                after_rpc = daemon.rpcs()
                assert all(torch.equal(s, w) for s, w in zip(staging, want)), f"{arm}: wrong bytes"
                row = rows[arm]
                row["load"].append(took)
                row["first"].append(first)
                row["lease"].append(after_rpc.get("Lease", 0) - rpc.get("Lease", 0))
                row["get"].append(after_rpc.get("GetRaw", 0) - rpc.get("GetRaw", 0))
                row["promotions"].append(c.stats()["counters"].get("promotions", 0) - promo)
    return {"layout": layout, "rows": rows}


def report(name: str, res: dict, n: int, tp: int) -> None:
    med = {a: {k: statistics.median(v) for k, v in r.items()} for a, r in res["rows"].items()}
    lay = res["layout"]
    print(f"\n{name}: {n} blocks of {lay.block_bytes >> 10} KiB, {lay.num_layers} layers "
          f"({n * lay.block_bytes / 2 ** 20:.1f} MiB leased, {n * lay.block_bytes / tp / 2 ** 20:.1f} MiB "
          f"copied: rank 0 of TP={tp})")
    print(f"  {'arm':8} {'load ms':>9} {'layer 0 ms':>11} {'Lease/step':>11} {'GetRaw/step':>12} {'promotions':>11}")
    for arm in ("before", "after", "leased"):
        m = med[arm]
        print(f"  {arm:8} {m['load'] * 1e3:9.2f} {m['first'] * 1e3:11.2f} {m['lease']:11.0f} {m['get']:12.0f} "
              f"{m['promotions']:11.0f}")
    for base in ("before", "leased"):
        print(f"  after/{base}: load {med['after']['load'] / med[base]['load']:.2f}x, "
              f"layer 0 {med['after']['first'] / med[base]['first']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--nvme-blocks", type=int, default=160, help="blocks of the nvme case (0: skip it)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1, help="rank 0 of this TP size (2 KV heads per rank)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvs-step-") as tmp:
        cases = [("host", "64MiB", False, args.blocks, 64), ("nvme", "16MiB", True, args.nvme_blocks, 32 // args.tp)]
        for name, host, nvme, n, head_dim in cases:
            if n <= 0:
                continue
            folder = pathlib.Path(tmp) / name
            folder.mkdir()
            d = Daemon(folder, host, nvme)
            try:
                report(name, run_case(name, d, args, n, head_dim, nvme), n, args.tp)
            finally:
                d.stop()


if __name__ == "__main__":
    main()
