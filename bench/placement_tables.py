"""The tables of docs/placement.md, measured by the shipped code.

    python bench/placement_tables.py [--write docs/placement.md] [--only policies,hints,agent]
                                     [--trace PATH] [--jobs 2] [--json OUT] [--from-json OUT]

Each table of the page sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``;
``--write`` replaces what is between the markers of the sections run (the rest of the
page is prose, kept as it is) and leaves the others alone; ``--from-json`` renders the
tables from the rows a previous run saved with ``--json`` instead of measuring. Sections:

- ``policies``: LRU, ARC, S3-FIFO, next_use and OPT on the Mooncake conversation trace,
  one tier of 1,500 / 6,000 / 12,000 blocks and unbounded; the whole trace and its
  second half (the first half warming the caches and models; what was tuned on the
  first half is reported there).
- ``hints``: next_use with simulated session hints (:mod:`kvstore.tools.sim_hints`):
  none, the realistic models (finish-only, continue-only, state known with a per-request
  log-normal time error of sigma 1.5, the same believed as given, always wrong) and the
  oracle ``noisy:P,F`` (a bound), against OPT; whole trace and second half.
- ``agent``: ``bench/agent_placement.py`` (readiness of every resume and waste on the
  published gap shape; fitted on seeds 1-2, reported on 3-5).

Every run is :func:`kvstore.tools.simulate.run` (the daemon's TierManager and policies
over byte-less tiers). It measures and writes; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import agent_placement  # noqa: E402
from kvstore.tools import sim_hints, simulate  # noqa: E402
from kvstore.tools.trace import read_mooncake_trace  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 1 << 20
CAPS = (1500, 6000, 12000)
POLICIES = (("LRU", "lru"), ("ARC", "arc"), ("S3-FIFO", "s3fifo"), ("next_use", "next_use"))
HINTS = (   # (row label, hint model or None, trust off)
    ("none", None, False),
    ("finish-only", "finish-only", False),
    ("continue-only, time error sigma 1.5", "continue-only:sigma=1.5", False),
    ("**realistic**: state known, time error sigma 1.5 per request", "realistic:sigma=1.5", False),
    ("realistic, believed as given (no trust)", "realistic:sigma=1.5", True),
    ("always wrong (every state flipped)", "realistic:wrong=1", False),
    ("oracle bound `noisy:0.05,e`", "noisy:0.05,e", False),
    ("oracle bound `noisy:0,1` (Belady's next use)", "noisy:0,1", False),
)

_REQUESTS: list = []


def _init(path: str) -> None:
    global _REQUESTS
    _REQUESTS = read_mooncake_trace(path)


def _trace_job(job: tuple) -> dict:
    """(policy, blocks or None, hint model or None, trust off) -> whole and second-half rates."""
    policy, blocks, spec, no_trust = job
    reqs = _REQUESTS
    windows = {"second": simulate.halves(reqs)[1]}
    cap = (blocks or 1 << 40) * BLOCK
    if policy == "opt":
        r = simulate.opt_hit_rate(reqs, cap, block_bytes=BLOCK, windows=windows)
    else:
        hints = None
        if spec:
            hints = sim_hints.derive(reqs, simulate.virtual_times(reqs), sim_hints.parse_hints_spec(spec),
                                     simulate.TraceKeys())
        r = simulate.run(reqs, [simulate.TierSpec("host", cap, policy)], block_bytes=BLOCK, session_hints=hints,
                         windows=windows, trust={"off": True} if no_trust else None)
    return {"policy": policy, "blocks": blocks, "hints": spec, "no_trust": no_trust, "whole": r.hit_rate,
            "second": r.window_rate("second"), "sessions": r.sessions, "seconds": r.seconds}


def _cell(rate: float, opt: float | None) -> str:
    return f"{rate:.4f} ({rate / opt:.3f}x)" if opt else f"{rate:.4f}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _opt(rows, half: str) -> dict:
    return {r["blocks"]: r[half] for r in rows if r["policy"] == "opt"}


def policies_section(rows: list[dict]) -> str:
    out = []
    for half, title in (("whole", "Whole trace"), ("second", "Second half (the first half warms)")):
        opt = _opt(rows, half)
        body = []
        for label, name in POLICIES + (("OPT", "opt"),):
            cells = [_cell(next(r[half] for r in rows if r["policy"] == name and r["blocks"] == c),
                           None if name == "opt" else opt[c]) for c in CAPS]
            cells.append(f"{next(r[half] for r in rows if r['policy'] == name and r['blocks'] is None):.4f}")
            body.append([label] + cells)
        out.append(f"{title}, token hit rate (ratio to OPT):\n\n"
                   + _table(["policy"] + [f"{c:,} blocks" for c in CAPS] + ["unbounded"], body))
    return "\n\n".join(out)


def hints_section(rows: list[dict]) -> str:
    out = []
    for half, title in (("whole", "Whole trace"), ("second", "Second half (held out: the first half warms)")):
        opt = _opt(rows, half)
        body = []
        for label, spec, no_trust in HINTS:
            body.append([label] + [_cell(next(r[half] for r in rows if r["policy"] == "next_use" and r["blocks"] == c
                                              and r["hints"] == spec and r["no_trust"] == no_trust), opt[c])
                                   for c in CAPS])
        body.append(["OPT"] + [f"{opt[c]:.4f}" for c in CAPS])
        out.append(f"{title}, next_use, token hit rate (ratio to OPT):\n\n"
                   + _table(["hints"] + [f"{c:,} blocks" for c in CAPS], body))
    return "\n\n".join(out)


def agent_section(out: dict) -> str:
    shape = "; ".join(f"seed {s}: " + " / ".join(f"{v:.3f}" for v in g.values()) for s, g in out["gap_shape"].items())
    fit = []
    for g in agent_placement.GRID:
        rows = [r for r in out["fit"] if r["options"] == g]
        name = ("issue-#5 scheduler (promote when due, re-promote, no protection)" if g["confidence"] == 0.0 else
                f"confidence {g['confidence']:g}, horizon = protection {g['horizon_s']:g} s")
        if g == out["chosen"]:
            name = f"**{name}** (chosen)"
        fit.append([name, f"{agent_placement._mean(rows, 'ready_tokens'):.3f}",
                    f"{agent_placement._mean(rows, 'waste'):.3f}", f"{agent_placement._mean(rows, 'promoted_blocks'):.0f}"])
    rep = []
    for share, policy, enabled, events, rows in agent_placement.report_rows(out):
        f = lambda k: " / ".join(f"{r[k]:.3f}" for r in rows)   # noqa: E731
        rep.append([f"{share:.0%} ({' / '.join(str(r['hbm']) for r in rows)})", policy, "on" if enabled else "off",
                    "tools only" if events == "tools" else "tools, ends",
                    f("ready_tokens"), f("ready"), f("waste") if enabled else "-"])
    resumes = " / ".join(f"{r['resumes']:,}" for r in sorted(
        {r["seed"]: r for r in out["report"]}.values(), key=lambda r: r["seed"]))
    return (f"Gap shape of the generated tool calls (resumed within 1 s / 10 s / 60 s / 300 s): {shape}.\n\n"
            f"Prefetch options, seeds {agent_placement.FIT_SEEDS}, HBM {agent_placement.HBM_SHARES[0]:.0%} of the "
            "working set, next_use (token-weighted readiness of every resume / waste, mean of the seeds):\n\n"
            + _table(["prefetch options", "readiness", "waste", "promoted blocks"], fit)
            + f"\n\nReported on seeds {' / '.join(map(str, agent_placement.REPORT_SEEDS))} (per seed; "
            f"{resumes} resumes, every one scored):\n\n"
            + _table(["HBM (blocks)", "policy", "prefetch", "hints", "readiness (token-weighted)",
                      "ready (whole prefix)", "waste"], rep))


def write_sections(path: pathlib.Path, sections: dict[str, str]) -> None:
    """Replace the text between each section's markers in ``path``. Raises SystemExit
    when a marker pair is missing."""
    text = path.read_text()
    for name, body in sections.items():
        pat = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"{path}: no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
        text = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    path.write_text(text)


def measure_trace(only: list[str], trace: str, jobs: int) -> list[dict] | None:
    """The trace runs the sections in ``only`` need (None: the trace is missing)."""
    todo = []
    if "policies" in only:
        todo += [(p, c, None, False) for _, p in POLICIES for c in CAPS + (None,)]
    if "hints" in only:
        todo += [("next_use", c, spec, nt) for _, spec, nt in HINTS for c in CAPS]
    if not todo:
        return []
    if not pathlib.Path(trace).exists():
        return None
    todo += [("opt", c, None, False) for c in CAPS + (None,)]
    with cf.ProcessPoolExecutor(jobs, initializer=_init, initargs=(trace,)) as ex:
        return list(ex.map(_trace_job, list(dict.fromkeys(todo))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--only", default="policies,hints,agent", help="comma-separated sections")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write", help="the page whose marked sections to replace (docs/placement.md)")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--from-json", help="render the tables from the rows a run saved with --json")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    if set(only) - {"policies", "hints", "agent"}:
        ap.error(f"unknown sections in --only {args.only!r}")
    started = time.perf_counter()
    if args.from_json:
        raw = json.loads(pathlib.Path(args.from_json).read_text())
        rows = raw["trace"]
    else:
        raw, rows = {}, measure_trace(only, args.trace, args.jobs)
        if rows is None:
            print(f"trace {args.trace} not found", file=sys.stderr)
            return 2
        raw["trace"] = rows
    sections: dict[str, str] = {}
    if "policies" in only:
        sections["policies"] = policies_section(rows)
    if "hints" in only:
        sections["hints"] = hints_section(rows)
    if "agent" in only:
        if not args.from_json:
            raw["agent"] = agent_placement.measure(args.jobs)
        sections["agent"] = agent_section(raw["agent"])
    for name, body in sections.items():
        print(f"<!-- table:{name} -->\n{body}\n<!-- /table:{name} -->\n")
    print(f"(wall time {time.perf_counter() - started:.0f} s with {args.jobs} job(s))")
    if args.write:
        write_sections(pathlib.Path(args.write), sections)
    if args.json and not args.from_json:
        pathlib.Path(args.json).write_text(json.dumps(raw, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
