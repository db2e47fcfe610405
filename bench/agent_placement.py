"""Agent benchmark: resume-HBM readiness and prefetch waste, fitted on some seeds, reported on others.

Workload: ``kvstore gen-agent-trace`` (32 agents, 30 minutes, finished and abandoned
trajectories, competing chat traffic; :mod:`kvstore.tools.agent_trace`) with the tool
mix :data:`TOOLS`, whose durations (the gaps between an agent's turns) follow the
published shape of a coding-agent trace (vllm-project/router#285: 86.5% of same-agent
returns within 1 s, 95.1% within 10 s) with a long tail of test runs and human waits
(the mixture gives 86.5% / 95.1%, 97.3% within a minute, 99.3% within five). Three
tiers of 64 MiB blocks (a Llama-3-8B-like KV of 128 KiB per token, 512-token blocks):
HBM at 54% and 39% of each seed's live working set (the prefix blocks of the
trajectories between their first tool call and their end, time-averaged), a host tier
below the total so NVMe matters, and NVMe; host -> HBM 25 GB/s, NVMe -> HBM / host 3 GB/s
(configured in the simulator), so paging a 30-block prefix back from NVMe takes ~0.7 s.

Every resume is scored (:class:`kvstore.tools.sim_events.ResumeScore`): per resume, the
blocks of the longest prefix in HBM with every page back finished, over the prefix's
blocks (token-weighted readiness; a trajectory the scheduler expired or never knew
counts as not ready). Waste: promoted bytes that left HBM before their trajectory
resumed, or never resumed, over promoted bytes.

The prefetch options (``PrefetchScheduler``: confidence, horizon, protection) are chosen
on generator seeds 1-2 (best readiness with waste <= 0.1) and reported on seeds 3-5,
against LRU with and without prefetch in the same run. It measures and prints.

    python bench/agent_placement.py [--jobs 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.tools import simulate  # noqa: E402
from kvstore.tools.agent_trace import AgentWorkload, Tool, generate  # noqa: E402
from kvstore.config.node import PrefetchConfig  # noqa: E402
from kvstore.tools.trace import Request  # noqa: E402
from tiers.base import TierKind as K  # noqa: E402

BLOCK = 64 << 20
HBM_SHARES = (0.54, 0.39)        # HBM as a share of each seed's live working set
TOOLS = (                        # name, duration median s / sigma, observation tokens / sigma, weight
    Tool("read", 0.2, 0.8, 800, 1.0, 0.69),       # file reads, greps, listings
    Tool("edit", 0.5, 0.7, 300, 0.8, 0.22),       # edits, searches
    Tool("bash", 3.0, 1.0, 400, 1.2, 0.04),       # shell and code execution
    Tool("tests", 40.0, 1.5, 900, 0.8, 0.03),     # test suites, builds
    Tool("human", 123.0, 1.04, 80, 0.8, 0.02),    # a question to the user (Mooncake conversation gaps)
)
HOST_BLOCKS = 700
NVME_BLOCKS = 100_000
BANDWIDTH = {(K.HOST, K.HBM): 25e9, (K.NVME, K.HBM): 3e9, (K.NVME, K.HOST): 3e9,
             (K.HBM, K.HOST): 25e9, (K.HOST, K.NVME): 2e9}
PREFETCH = dict(quantile=0.1, lead_time_s=0.05)
FIT_SEEDS = (1, 2)
REPORT_SEEDS = (3, 4, 5)
GRID = [{"confidence": 0.0, "protect_s": 0.0, "victim_margin": 1.0, "repromote": True}]   # the issue-#5 scheduler
GRID += [{"confidence": c, "horizon_s": h, "protect_s": h, "victim_margin": 2.0, "repromote": False}
         for c, h in ((0.5, 30.0), (0.7, 10.0), (0.7, 30.0), (0.9, 30.0))]   # (0.7, 30 s): the defaults


def _working_set(events) -> float:
    """Time-averaged prefix blocks of the live trajectories (first tool call to end)."""
    live: dict[str, int] = {}
    area, last = 0.0, events[0].time_s if events else 0.0
    start = last
    for e in events:
        area += sum(live.values()) * (e.time_s - last)
        last = e.time_s
        if e.kind == "tool_call_start":
            live[e.trajectory] = len(e.hash_ids)
        elif e.kind == "session_end":
            live.pop(e.trajectory, None)
    return area / (last - start) if last > start else 0.0


def workload(seed: int):
    """The seed's requests and events (the published gap shape, :data:`TOOLS`)."""
    return generate(AgentWorkload(seed=seed, tools=TOOLS))


def gap_shape(events) -> dict[str, float]:
    """Share of tool calls whose trajectory resumed within 1 s, 10 s, 60 s, 300 s."""
    start: dict[str, float] = {}
    gaps = []
    for e in events:
        if e.kind == "tool_call_start":
            start[e.trajectory] = e.time_s
        elif e.kind == "resume" and e.trajectory in start:
            gaps.append(e.time_s - start.pop(e.trajectory))
    return {f"{x:g}s": sum(g <= x for g in gaps) / len(gaps) for x in (1.0, 10.0, 60.0, 300.0)} if gaps else {}


def _job(job: tuple) -> dict:
    seed, share, policy, enabled, options, events_kind = job
    raw, events = workload(seed)
    working_set = _working_set(events)
    hbm = max(1, round(share * working_set))
    if events_kind == "tools":                  # no session ends: tool calls only
        events = [e for e in events if e.kind != "session_end"]
    reqs = [Request(float(x["timestamp"]), x["input_length"], x["output_length"], x["hash_ids"]) for x in raw]
    tiers = [simulate.TierSpec("hbm", hbm * BLOCK, policy), simulate.TierSpec("host", HOST_BLOCKS * BLOCK, policy),
             simulate.TierSpec("nvme", NVME_BLOCKS * BLOCK, policy)]
    t0 = time.perf_counter()
    r = simulate.run(reqs, tiers, block_bytes=BLOCK, events=events, hop_bandwidth=BANDWIDTH,
                     prefetch=PrefetchConfig(enabled=enabled, **PREFETCH), scheduler_options=options)
    p = r.prefetch
    e = p["every_resume"]
    return {"seed": seed, "share": share, "hbm": hbm, "policy": policy, "prefetch": enabled, "options": options,
            "events": events_kind, "ready_tokens": e["ready_token_rate"], "ready": e["ready_rate"],
            "resumes": e["resumes"], "not_waited": e["not_waited"], "waste": p["waste"],
            "promoted_blocks": p["promoted_blocks"], "waste_by": p["waste_by"], "expired": p["expired"],
            "hbm_hit": r.tier_hit_rates["hbm"], "hit": r.hit_rate, "working_set": working_set,
            "seconds": time.perf_counter() - t0}


def _mean(rows, key) -> float:
    return statistics.fmean(r[key] for r in rows)


CONFIGS = (("lru", False, "chosen", "all"), ("lru", True, "chosen", "all"), ("next_use", False, "chosen", "all"),
           ("next_use", True, "chosen", "all"), ("next_use", True, "chosen", "tools"))


def measure(jobs: int) -> dict:
    """Fit on :data:`FIT_SEEDS`, report on :data:`REPORT_SEEDS`; returns every row."""
    with cf.ProcessPoolExecutor(jobs) as ex:
        fit = list(ex.map(_job, [(s, HBM_SHARES[0], "next_use", True, g, "all") for g in GRID for s in FIT_SEEDS]))
        scored = []
        for g in GRID:
            rows = [r for r in fit if r["options"] == g]
            scored.append((_mean(rows, "waste") <= 0.1, _mean(rows, "ready_tokens"), -_mean(rows, "waste"), g))
        chosen = max(scored, key=lambda x: x[:3])[3]
        jobs_ = [(s, h, p, en, chosen, ev) for h in HBM_SHARES for p, en, _, ev in CONFIGS for s in REPORT_SEEDS]
        rep = list(ex.map(_job, jobs_))
    shapes = {s: gap_shape(workload(s)[1]) for s in FIT_SEEDS + REPORT_SEEDS}
    return {"fit": fit, "chosen": chosen, "report": rep, "gap_shape": shapes}


def report_rows(out: dict):
    """(share, policy, prefetch, events, rows sorted by seed) per reported configuration."""
    for h in HBM_SHARES:
        for p, en, _, ev in CONFIGS:
            rows = sorted((r for r in out["report"] if (r["share"], r["policy"], r["prefetch"], r["events"])
                           == (h, p, en, ev)), key=lambda r: r["seed"])
            yield h, p, en, ev, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    started = time.perf_counter()
    out = measure(args.jobs)
    print(f"Gap shape (share of tool calls resumed within 1 s / 10 s / 60 s / 300 s): "
          + "; ".join(f"seed {s}: " + " / ".join(f"{v:.3f}" for v in g.values()) for s, g in out["gap_shape"].items()))
    print(f"Fit on seeds {FIT_SEEDS}, HBM {HBM_SHARES[0]:.0%} of the working set, next_use + prefetch:")
    for g in GRID:
        rows = [r for r in out["fit"] if r["options"] == g]
        print(f"  {json.dumps(g):<96} ready(tokens) {_mean(rows, 'ready_tokens'):.3f}  waste {_mean(rows, 'waste'):.3f}  "
              f"promoted {_mean(rows, 'promoted_blocks'):.0f}")
    print(f"  chosen: {out['chosen']}")
    print(f"\nReport on seeds {REPORT_SEEDS} (per seed), every resume scored; host {HOST_BLOCKS} blocks, NVMe; "
          f"host->HBM 25 GB/s, NVMe 3 GB/s")
    print(f"{'HBM':>4} {'policy':<9} {'prefetch':<8} {'events':<6} {'ready(tok)':<20} {'ready':<20} "
          f"{'waste':<20} {'HBM hit':<8} {'ws':>5}")
    for h, p, en, ev, rows in report_rows(out):
        f = lambda k: " / ".join(f"{r[k]:.3f}" for r in rows)   # noqa: E731
        print(f"{h:>4.0%} {p:<9} {'on' if en else 'off':<8} {ev:<6} {f('ready_tokens'):<20} {f('ready'):<20} "
              f"{f('waste'):<20} {_mean(rows, 'hbm_hit'):<8.3f} {_mean(rows, 'working_set'):>5.0f}")
    print(f"(resumes per seed: {sorted({r['seed']: r['resumes'] for r in out['report']}.items())}; "
          f"wall time {time.perf_counter() - started:.0f} s with {args.jobs} job(s))")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
