"""Eviction policies vs Belady's OPT on the whole Mooncake conversation trace, one cache tier.

Token hit rate of LRU, ARC, S3-FIFO and next_use at 1,500 / 6,000 / 12,000 blocks, OPT at
the same capacity, and each policy's ratio to OPT; then every policy with unbounded
capacity (must be 0.3736). ``kvstore simulate TRACE --one-tier --sweep 1500,6000,12000``
prints the same table. The issue-#13 runs (fitted on the first half, reported on the
second; simulated hints; the agent benchmark) are ``bench/placement_trace.py`` and
``bench/agent_placement.py``.

Everything runs through :func:`kvstore.tools.simulate.run`, i.e. the daemon's TierManager and
policy classes over byte-less tiers. It measures and prints; it does not pass or fail.

    python bench/simulate_policies.py [--trace PATH] [--jobs 2] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.tools import simulate, simulate_cli  # noqa: E402
from kvstore.tools.trace import Request, read_mooncake_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITIES = (1500, 6000, 12000)
POLICIES = ("lru", "arc", "s3fifo", "next_use")
BLOCK = 1 << 20                      # bytes per trace block (only the ratio matters)

_REQUESTS: list[Request] = []


def _init(path: str) -> None:
    global _REQUESTS
    _REQUESTS = read_mooncake_trace(path)


def _run_trace(job: tuple[str, int | None]) -> dict:
    policy, blocks = job
    cap = (blocks or 1 << 40) * BLOCK
    if policy == "opt":
        r = simulate.opt_hit_rate(_REQUESTS, cap, block_bytes=BLOCK)
    else:
        r = simulate.run(_REQUESTS, [simulate.TierSpec("host", cap, policy)], block_bytes=BLOCK)
    return {"policy": policy, "blocks": blocks, "hit_rate": r.hit_rate, "seconds": r.seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--plot", help="hit rate vs capacity per policy, OPT dashed (needs matplotlib)")
    args = ap.parse_args()
    out: dict = {}

    if not pathlib.Path(args.trace).exists():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    jobs = [(p, c) for c in CAPACITIES for p in POLICIES + ("opt",)] + [(p, None) for p in POLICIES + ("opt",)]
    started = time.perf_counter()
    with cf.ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.trace,)) as ex:
        rows = list(ex.map(_run_trace, jobs))
    out["trace"] = rows
    opt = {r["blocks"]: r["hit_rate"] for r in rows if r["policy"] == "opt"}
    print(f"\n{args.trace}, one tier, token hit rate (ratio to OPT), run time per config")
    print(f"{'policy':<10}" + "".join(f"{c:>24,}" for c in CAPACITIES) + f"{'unbounded':>12}")
    for p in POLICIES + ("opt",):
        cells = []
        for c in CAPACITIES:
            r = next(x for x in rows if x["policy"] == p and x["blocks"] == c)
            cells.append(f"{r['hit_rate']:.4f} ({r['hit_rate'] / opt[c]:.3f}x) {r['seconds']:4.1f}s")
        u = next(x for x in rows if x["policy"] == p and x["blocks"] is None)
        print(f"{p:<10}" + "".join(f"{cell:>24}" for cell in cells) + f"{u['hit_rate']:>12.4f}")
    print(f"(wall time {time.perf_counter() - started:.0f} s with {args.jobs} job(s))")
    if args.plot:
        simulate_cli.plot_points([(r["policy"], r["blocks"], r["hit_rate"], opt[r["blocks"]]) for r in rows
                                  if r["blocks"] is not None and r["policy"] != "opt"], args.plot)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
