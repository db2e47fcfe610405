#!/usr/bin/env python3
"""A trace replayed round robin over two daemons of one Mooncake cluster, next to one daemon.

Starts a loopback master, then for each mode two daemons (host tier only, big enough
for the whole trace: unbounded capacity) joined to it, and replays the trace with
request ``i`` sent to daemon ``i mod 2`` (``kvstore/tools/replay.py``). Baseline, in the same
run: the same replay through a single daemon without a cluster. Modes:

- ``write_through``: ``[policy] write = "write_through"``: a put returns once the
  cluster holds its blocks (so the next request, on the other daemon, finds them);
- ``all``: ``publish = "all"``: puts are copied to the cluster in the background
  (batched); the replay runs as fast as it can, so a request may arrive on the other
  daemon before its prefix was published: the hit rate shows whether publishing keeps up.

Prints, per mode, the token hit rate, the single-node ideal (an unbounded cache, prefix
semantics), the tokens served from the cluster, and seconds with the ratio to the
single daemon. Daemons run in this process (as in the tests).

    python bench/cluster_replay.py ../shared/data/traces/mooncake_conversation_trace.jsonl [--limit N]
        [--bytes-per-token 1] [--modes write_through,all]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import config  # noqa: E402
from kvstore.client.client import KVStoreClient  # noqa: E402
from kvstore.tools.replay import block_token_counts, replay  # noqa: E402
from kvstore.service.startup import start_server  # noqa: E402
from kvstore.tools.trace import read_mooncake_trace  # noqa: E402
from tiers.mooncake.client import mooncake_missing  # noqa: E402


def ideal(requests) -> float:
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        tokens = block_token_counts(r.input_length, len(r.hash_ids))
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hit, total = hit + sum(tokens[:n]), total + r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def node(folder: pathlib.Path, host: str, remote: dict | None, write: str = "write_back") -> config.Config:
    folder.mkdir(parents=True, exist_ok=True)
    tiers: dict = {"host": {"capacity": host}, "nvme": {"enabled": False}}
    if remote is not None:
        tiers["remote"] = remote
    sock = pathlib.Path(tempfile.mkdtemp(prefix="kvcr-")) / "kvstore.sock"
    return config.from_dict({"server": {"listen": f"unix:{sock}", "workers": 8}, "tiers": tiers,
                             "policy": {"write": write}})


def run(requests, configs, bpt: int):
    daemons = [start_server(c) for c in configs]
    try:
        for d in daemons:
            tier = d.manager.tiers[-1]
            if hasattr(tier, "wait_connected"):
                assert tier.wait_connected(60), tier.health
        clients = [KVStoreClient(d.address, timeout=120) for d in daemons]
        try:
            return replay(requests, clients, bytes_per_token=bpt, progress=False)
        finally:
            for c in clients:
                c.close()
    finally:
        for d in daemons:
            d.stop(0, persist_s=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=pathlib.Path)
    p.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--bytes-per-token", type=int, default=1)
    p.add_argument("--modes", default="write_through,all")
    p.add_argument("--host", default="1GiB", help="host tier of each daemon (unbounded: holds the trace)")
    args = p.parse_args()
    reason = mooncake_missing()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from tiers.mooncake.local_cluster import LocalMaster

    requests = read_mooncake_trace(args.trace)
    if args.limit:
        requests = requests[:args.limit]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvcr-"))
    rows = [("single daemon", run(requests, [node(folder / "single", args.host, None)], args.bytes_per_token))]
    for mode in args.modes.split(","):
        with LocalMaster(client_ttl_s=10) as master:
            remote = {"enabled": True, "master": master.address, "metadata_server": master.metadata_server,
                      "capacity": "1GiB", "segment": "512MiB", "staging": "16MiB",
                      "publish": "all" if mode == "all" else "demoted"}
            write = "write_through" if mode == "write_through" else "write_back"
            configs = [node(folder / f"{mode}-{n}", args.host, remote, write) for n in "ab"]
            rows.append((f"2 daemons, {mode}", run(requests, configs, args.bytes_per_token)))
    best = ideal(requests)
    base = rows[0][1].seconds
    print(f"{len(requests)} requests, {args.bytes_per_token} B/token; single-node ideal token hit rate {best:.4f}")
    print(f"{'setup':<26} {'token hit':>9} {'of ideal':>8} {'remote tokens':>14} {'corrupt':>7} {'seconds':>8} "
          f"{'/single':>7}")
    for name, rep in rows:
        print(f"{name:<26} {rep.token_hit_rate:9.4f} {rep.token_hit_rate / best if best else 0:8.4f} "
              f"{rep.hits_by_tier.get('remote', 0):14d} {rep.corrupt_blocks:7d} {rep.seconds:8.1f} "
              f"{rep.seconds / base:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
