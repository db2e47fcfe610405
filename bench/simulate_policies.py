"""Acceptance runs of issue #5: eviction policies vs Belady's OPT, and tool-call prefetch.

Part 1 (Mooncake conversation trace, one cache tier of 1,500 / 6,000 / 12,000 blocks):
token hit rate of LRU, ARC, S3-FIFO and next_use, OPT at the same capacity, and each
policy's ratio to OPT; then every policy with unbounded capacity (must be 0.3736).

Part 2 (generated ReAct agent workloads, ``kvstore.agent_trace``, three seeds): HBM
smaller than the working set over a large host tier; resume-HBM-ready rate, prefetch
waste and resume-time prediction error, with and without prefetch, for LRU and next_use.

Everything runs through :func:`kvstore.simulate.run`, i.e. the daemon's TierManager and
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

from kvstore import simulate, simulate_cli  # noqa: E402
from kvstore.agent_trace import AgentWorkload, generate  # noqa: E402
from kvstore.config import PrefetchConfig  # noqa: E402
from kvstore.trace import Request, read_mooncake_trace  # noqa: E402
from tiers.base import TierKind  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITIES = (1500, 6000, 12000)
POLICIES = ("lru", "arc", "s3fifo", "next_use")
BLOCK = 1 << 20                      # bytes per trace block in part 1 (only the ratio matters)

# part 2: a Llama-3-8B-like KV (128 KiB per token) -> 64 MiB per 512-token block;
# HBM 300 or 350 blocks (19 / 22 GiB) below the working set; PCIe 4 x16 host -> HBM.
AGENT_BLOCK = 64 << 20
AGENT_HBM_SIZES = (300, 350)       # blocks; both below the working set (~370-400 blocks)
AGENT_HOST_BLOCKS = 4096
AGENT_BANDWIDTH = {(TierKind.HOST, TierKind.HBM): 25e9}
AGENT_PREFETCH = dict(quantile=0.1, lead_time_s=0.05, window=64)

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


def _run_agents(job: tuple[int, int, str, bool]) -> dict:
    hbm, seed, policy, enabled = job
    raw, events = generate(AgentWorkload(agents=32, duration_s=1800.0, seed=seed))
    reqs = [Request(float(x["timestamp"]), x["input_length"], x["output_length"], x["hash_ids"]) for x in raw]
    tiers = [simulate.TierSpec("hbm", hbm * AGENT_BLOCK, policy),
             simulate.TierSpec("host", AGENT_HOST_BLOCKS * AGENT_BLOCK, policy)]
    r = simulate.run(reqs, tiers, block_bytes=AGENT_BLOCK, events=events,
                     prefetch=PrefetchConfig(enabled=enabled, **AGENT_PREFETCH), hop_bandwidth=AGENT_BANDWIDTH)
    ws = _working_set(events)
    return {"hbm_blocks": hbm, "seed": seed, "policy": policy, "prefetch": enabled, "requests": len(reqs),
            "hbm_hit_rate": r.tier_hit_rates["hbm"], "hit_rate": r.hit_rate, "seconds": r.seconds,
            "working_set_mean_blocks": ws, **r.prefetch}


def _working_set(events) -> float:
    """Time-averaged prefix blocks of the live trajectories (from a trajectory's first
    tool call to its last resume, waiting or running; a lower bound of the working set)."""
    last_resume = {}
    for e in events:
        if e.kind == "resume":
            last_resume[e.trajectory] = e.time_s
    live: dict[str, int] = {}
    area = 0.0
    last = events[0].time_s if events else 0.0
    for e in events:
        area += sum(live.values()) * (e.time_s - last)
        last = e.time_s
        if e.kind == "tool_call_start":
            live[e.trajectory] = len(e.hash_ids)
        elif last_resume.get(e.trajectory) == e.time_s:
            live.pop(e.trajectory, None)
    span = last - (events[0].time_s if events else 0.0)
    return area / span if span else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-agents", action="store_true")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--plot", help="hit rate vs capacity per policy, OPT dashed (needs matplotlib)")
    args = ap.parse_args()
    out: dict = {}

    if not args.skip_trace:
        if not pathlib.Path(args.trace).exists():
            print(f"trace {args.trace} not found; skipping part 1", file=sys.stderr)
        else:
            jobs = [(p, c) for c in CAPACITIES for p in POLICIES + ("opt",)] + [(p, None) for p in POLICIES + ("opt",)]
            started = time.perf_counter()
            with cf.ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.trace,)) as ex:
                rows = list(ex.map(_run_trace, jobs))
            out["trace"] = rows
            opt = {r["blocks"]: r["hit_rate"] for r in rows if r["policy"] == "opt"}
            print(f"\nPart 1: {args.trace}, one tier, token hit rate (ratio to OPT), run time per config")
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

    if not args.skip_agents:
        jobs = [(hbm, seed, p, en) for hbm in AGENT_HBM_SIZES for seed in (1, 2, 3)
                for p in ("lru", "next_use") for en in (False, True)]
        with cf.ProcessPoolExecutor(args.jobs) as ex:
            rows = list(ex.map(_run_agents, jobs))
        out["agents"] = rows
        print(f"\nPart 2: 32 ReAct agents, 30 min, HBM of 64 MiB blocks over host "
              f"{AGENT_HOST_BLOCKS}; prefetch quantile {AGENT_PREFETCH['quantile']}, "
              f"lead {AGENT_PREFETCH['lead_time_s']} s, host->HBM 25 GB/s")
        print(f"{'HBM':>4} {'seed':>4} {'policy':<9} {'prefetch':<8} {'ready':>6} {'waste':>6} {'MAE s':>6} "
              f"{'med.rel':>7} {'HBM hit':>8} {'resumes':>7} {'working set':>11}")
        for r in rows:
            mode = "on" if r["prefetch"] else "off"
            print(f"{r['hbm_blocks']:>4} {r['seed']:>4} {r['policy']:<9} {mode:<8} {r['ready_rate']:>6.3f} "
                  f"{r['waste']:>6.3f} {r['prediction_mae_s']:>6.2f} {r['prediction_median_rel_error']:>7.2f} "
                  f"{r['hbm_hit_rate']:>8.3f} {r['resumes']:>7} {r['working_set_mean_blocks']:>11.0f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
