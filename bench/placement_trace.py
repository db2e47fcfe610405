"""Issue #13 on the Mooncake conversation trace: parameters fitted on the first half, reported on the second.

Part A, no hints. A small grid of ``next_use`` / reuse-model parameters runs on the first
half of the trace alone (requests before the midpoint of its time span, all counted,
OPT over the same requests); the configuration with the best mean ratio to OPT at
1,500 and 6,000 blocks is then run, with LRU, ARC, S3-FIFO, ``next_use`` with its
defaults and OPT, over the whole trace, counting only the second half's requests.

Part B, simulated session hints from the oracle ``noisy:P,F`` (:mod:`kvstore.tools.sim_hints`;
a bound: it knows each next request's time up to one factor per conversation). A grid
of hint parameters runs on the first half with P = 0.05, F = e; the best is reported on
the second half for P in {0, 0.05, 0.1} x F in {1, e, e^2} at 1,500 / 6,000 / 12,000
blocks, plus the hint errors drawn per request instead of per conversation (what the
per-session correction cannot learn). The realistic hint models, against no hints and
this bound, are in ``bench/placement_tables.py`` (docs/placement.md).

Also printed: the bound on how far OPT (optimal in block hits) can be below the best
token hit rate (docs/placement.md, "OPT").

Every run is :func:`kvstore.tools.simulate.run` (the daemon's TierManager and policies over
byte-less tiers). It measures and prints; it does not pass or fail.

    python bench/placement_trace.py [--trace PATH] [--jobs 2] [--json OUT] [--skip-a] [--skip-b]
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

from kvstore.tools import simulate, sim_hints  # noqa: E402
from kvstore.policy.reuse_model import ReuseModel  # noqa: E402
from kvstore.tools.trace import read_mooncake_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 1 << 20
FIT_CAPS = (1500, 6000)
CAPS = (1500, 6000, 12000)

# Part A grid: (policy params, reuse-model params)
GRID_A = [({}, {}), ({}, {"gap_buckets": (60.0, 180.0)}), ({}, {"window": 512}), ({}, {"window": 1024}),
          ({}, {"window": 512, "gap_buckets": (60.0, 180.0)}), ({}, {"window": 1024, "gap_buckets": (60.0, 180.0)}),
          ({}, {"smoothing": 1.0}), ({}, {"horizon_s": 1800.0})]
# Part B grid: (policy params, calibration options)
GRID_B = [({}, {}), ({}, {"prior_weight": 0.25}), ({}, {"prior_weight": 4.0}), ({}, {"off": True}),
          ({"hint_grace_s": 1200.0}, {}), ({"hint_grace_s": 60.0}, {})]
SPECS = [(p, f) for p in (0.0, 0.05, 0.1) for f in ("1", "e", "e^2")]

_ALL: list = []
_FIRST: list = []


def _init(path: str) -> None:
    global _ALL, _FIRST
    _ALL = read_mooncake_trace(path)
    mid = (_ALL[0].time_s + _ALL[-1].time_s) / 2.0
    _FIRST = [r for r in _ALL if r.time_s < mid]


def _hints(reqs, spec: str | None, per_request: bool = False):
    if spec is None:
        return None
    s = sim_hints.parse_hints_spec(spec)
    if per_request:
        s = sim_hints.NoisyHints(s.misjudge, s.factor, s.seed, per_conversation=False)
    return sim_hints.derive(reqs, simulate.virtual_times(reqs), s, simulate.TraceKeys())


def _job(job: tuple) -> dict:
    """(half, policy, blocks, policy params, model params, calibration, hints spec, per_request)."""
    half, policy, blocks, params, mparams, cal, spec, per_request = job
    reqs = _FIRST if half == "first" else _ALL
    measure = None if half == "first" else simulate.halves(_ALL)[1]
    cap = blocks * BLOCK
    t0 = time.perf_counter()
    if policy == "opt":
        r = simulate.opt_hit_rate(reqs, cap, block_bytes=BLOCK, measure=measure)
    else:
        r = simulate.run(reqs, [simulate.TierSpec("host", cap, policy, dict(params))], block_bytes=BLOCK,
                         session_hints=_hints(reqs, spec, per_request), measure=measure,
                         reuse_model=ReuseModel(**mparams) if mparams else None, calibration=cal)
    return {"half": half, "policy": policy, "blocks": blocks, "params": params, "model": mparams,
            "calibration": cal, "hints": spec, "per_request": per_request, "hit_rate": r.hit_rate,
            "seconds": time.perf_counter() - t0}


def _ratio(rows, opt, **match) -> dict[int, float]:
    out = {}
    for r in rows:
        if all(r[k] == v for k, v in match.items()):
            out[r["blocks"]] = r["hit_rate"] / opt[(r["half"], r["blocks"])]
    return out


def _best(rows, opt, grid, key_of) -> tuple:
    scored = []
    for g in grid:
        rs = _ratio(rows, opt, **key_of(g))
        scored.append((sum(rs.values()) / len(rs), g, rs))
    return max(scored, key=lambda x: x[0])


def opt_token_bound(reqs) -> tuple[int, float]:
    """Requests whose every id was seen before (only these can hit a partial last block),
    and the bound 512 * that / total tokens on token-OPT minus block-OPT."""
    seen: set[int] = set()
    repeats = 0
    for r in reqs:
        if all(x in seen for x in r.hash_ids):
            repeats += 1
        seen.update(r.hash_ids)
    return repeats, 512 * repeats / sum(r.input_length for r in reqs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    if not pathlib.Path(args.trace).exists():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    _init(args.trace)
    started = time.perf_counter()
    out: dict = {}
    with cf.ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.trace,)) as ex:
        opt_jobs = [(h, "opt", c, {}, {}, None, None, False) for h in ("first", "second") for c in CAPS]
        opt = {(r["half"], r["blocks"]): r["hit_rate"] for r in ex.map(_job, opt_jobs)}
        print("OPT: " + ", ".join(f"{h} half {c}: {v:.4f}" for (h, c), v in sorted(opt.items())))
        repeats, bound = opt_token_bound(_ALL)
        print(f"OPT token ceiling: {repeats} requests repeat all their ids; token-OPT - OPT <= {bound:.5f}")
        out["opt"] = {f"{h}:{c}": v for (h, c), v in opt.items()}
        if not args.skip_a:
            fit = [("first", "next_use", c, p, m, None, None, False) for c in FIT_CAPS for p, m in GRID_A]
            rows = list(ex.map(_job, fit))
            best = _best(rows, opt, GRID_A, lambda g: {"params": g[0], "model": g[1]})
            print("\nPart A, no hints. Fit on the first half (ratio to OPT at 1,500 / 6,000 blocks):")
            for g in GRID_A:
                rs = _ratio(rows, opt, params=g[0], model=g[1])
                print(f"  {json.dumps(g[0])} {json.dumps(g[1]):<50} " + " ".join(f"{rs[c]:.3f}" for c in FIT_CAPS))
            print(f"  chosen: {best[1]}")
            report = [("second", p, c, {}, {}, None, None, False) for p in ("lru", "arc", "s3fifo", "next_use")
                      for c in CAPS]
            report += [("second", "next_use", c, best[1][0], best[1][1], None, None, False) for c in CAPS]
            rep = list(ex.map(_job, report))
            print("\nPart A, second half (full run, second half counted): token hit rate (ratio to OPT)")
            for label, match in (("lru", {"policy": "lru"}), ("arc", {"policy": "arc"}),
                                 ("s3fifo", {"policy": "s3fifo"}),
                                 ("next_use defaults", {"policy": "next_use", "model": {}, "params": {}}),
                                 ("next_use fitted", {"policy": "next_use", "model": best[1][1], "params": best[1][0]})):
                cells = []
                for c in CAPS:
                    r = next(x for x in rep if x["blocks"] == c and all(x[k] == v for k, v in match.items()))
                    cells.append(f"{r['hit_rate']:.4f} ({r['hit_rate'] / opt[('second', c)]:.3f}x)")
                print(f"  {label:<18} " + "  ".join(cells))
            out["part_a"] = {"fit": rows, "chosen": best[1], "report": rep}
        if not args.skip_b:
            fit = [("first", "next_use", c, p, {}, cal, "noisy:0.05,e", False) for c in FIT_CAPS for p, cal in GRID_B]
            rows = list(ex.map(_job, fit))
            best = _best(rows, opt, GRID_B, lambda g: {"params": g[0], "calibration": g[1]})
            print("\nPart B, hints noisy:0.05,e. Fit on the first half (ratio to OPT at 1,500 / 6,000 blocks):")
            for g in GRID_B:
                rs = _ratio(rows, opt, params=g[0], calibration=g[1])
                print(f"  {json.dumps(g[0])} {json.dumps(g[1]):<30} " + " ".join(f"{rs[c]:.3f}" for c in FIT_CAPS))
            print(f"  chosen: {best[1]}")
            p_, cal = best[1]
            report = [("second", "next_use", c, p_, {}, cal, f"noisy:{p},{f}", False) for p, f in SPECS for c in CAPS]
            report += [("second", "next_use", c, p_, {}, cal, "noisy:0.05,e", True) for c in CAPS]
            report += [("second", "lru", c, {}, {}, None, "noisy:0.05,e", False) for c in CAPS]
            rep = list(ex.map(_job, report))
            print("\nPart B, second half: ratio to OPT (token hit rate) per hint quality")
            print(f"  {'hints':<28}" + "".join(f"{c:>18,}" for c in CAPS))
            for p, f in SPECS:
                spec = f"noisy:{p},{f}"
                rs = [next(x for x in rep if x["hints"] == spec and x["blocks"] == c and x["policy"] == "next_use"
                           and not x["per_request"]) for c in CAPS]
                print(f"  {'next_use ' + spec:<28}" + "".join(
                    f"{r['hit_rate'] / opt[('second', r['blocks'])]:>9.3f} ({r['hit_rate']:.4f})" for r in rs))
            for label, match in (("next_use per-request error", {"per_request": True}), ("lru noisy:0.05,e", {"policy": "lru"})):
                rs = [next(x for x in rep if x["blocks"] == c and all(x[k] == v for k, v in match.items())) for c in CAPS]
                print(f"  {label:<28}" + "".join(
                    f"{r['hit_rate'] / opt[('second', r['blocks'])]:>9.3f} ({r['hit_rate']:.4f})" for r in rs))
            out["part_b"] = {"fit": rows, "chosen": best[1], "report": rep}
    print(f"\n(wall time {time.perf_counter() - started:.0f} s with {args.jobs} job(s))")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
