"""``kvstore simulate``: the command line of the simulator (:mod:`kvstore.tools.simulate`).

Prints one line per configuration (hit rate per tier and total, OPT at the same
capacity and the ratio), optionally JSON and a plot. ``--hints MODEL`` adds
simulated session hints (:mod:`kvstore.tools.sim_hints`: ``realistic``, ``finish-only``,
``continue-only``, or the oracle ``noisy:P,F``, a bound); ``--measure`` counts one half
of the trace only (``second-half`` is where tuned parameters are reported). The ``--json``
and ``--plot`` files are checked before the runs (a missing folder, a file that cannot be
written, no matplotlib, a plot suffix matplotlib cannot write: exit status 2 at once, not
after the work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Iterable, Sequence

from kvstore import config as config_mod
from kvstore.common.errors import ConfigError
from kvstore.tools.cliargs import MAX_BLOCK_BYTES, at_most, non_empty_path, output_error, positive_int
from kvstore.tools.sim_hints import derive, parse_hints_spec
from kvstore.tools.simulate import (
    DEFAULT_BLOCK_BYTES,
    ONLINE_POLICIES,
    SimResult,
    TIER_KINDS,
    TraceKeys,
    virtual_times,
    halves,
    opt_hit_rate,
    run,
    tiers_from_config,
)
from kvstore.tools.trace import TraceError, read_mooncake_trace


def _parse_blocks_list(text: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block counts like 1500,6000,12000, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("block counts must be > 0")
    return vals


def _parse_bandwidth(items: Sequence[str]) -> dict:
    out = {}
    for item in items or ():
        try:
            hop, gbps = item.split("=")
            src, dst = hop.split(":")
            rate = float(gbps)
            if not 0 < rate < float("inf"):
                raise ValueError(f"a bandwidth of {rate} GB/s")
            out[(TIER_KINDS[src.strip()], TIER_KINDS[dst.strip()])] = rate * 1e9
        except (ValueError, KeyError):
            raise SystemExit(f"kvstore simulate: --bandwidth expects SRC:DST=GBPS with tiers hbm/host/nvme "
                             f"and GBPS a number > 0, got {item!r}")
    return out


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def print_table(results: Sequence[SimResult], out=None) -> None:
    """One line per run: capacities (blocks), hit rate per tier, total, OPT, ratio, seconds."""
    out = out or sys.stdout
    tier_names: list[str] = []
    for r in results:
        for t in r.tiers:
            if t["name"] not in tier_names:
                tier_names.append(t["name"])
    head = f"{'policy':<28} {'capacity (blocks)':<24}" + "".join(f" {n:>8}" for n in tier_names)
    head += f" {'total':>8} {'OPT':>8} {'/OPT':>6} {'secs':>6}"
    print(head, file=out)
    for r in results:
        caps = "/".join(str(t["capacity_blocks"]) for t in r.tiers)
        rates = r.tier_hit_rates
        line = f"{r.label:<28} {caps:<24}" + "".join(f" {_fmt_rate(rates.get(n)):>8}" for n in tier_names)
        ratio = f"{r.hit_rate / r.opt_hit_rate:.3f}" if r.opt_hit_rate else "-"
        line += f" {r.hit_rate:>8.4f} {_fmt_rate(r.opt_hit_rate):>8} {ratio:>6} {r.seconds:>6.1f}"
        print(line, file=out)
        if r.prefetch:
            p = r.prefetch
            print(f"{'':<28} prefetch {'on' if p['enabled'] else 'off'}: ready {p['ready_rate']:.3f} "
                  f"(token-weighted {p['ready_token_rate']:.3f}) of {p['resumes']} resumes, waste {p['waste']:.3f} "
                  f"({p['wasted_bytes']}/{p['promoted_bytes']} bytes), prediction MAE "
                  f"{p['prediction_mae_s']:.2f} s, median rel. error {p['prediction_median_rel_error']:.2f}",
                  file=out)
            e = p.get("every_resume")
            if e:
                print(f"{'':<28} every resume: ready {e['ready_rate']:.3f} (token-weighted {e['ready_token_rate']:.3f}) "
                      f"of {e['resumes']}, {e['not_waited']} not waited for (counted not ready)", file=out)


def plot(results: Sequence[SimResult], out: str) -> None:
    """Hit rate vs first-tier capacity per policy, OPT dashed, as a PNG at ``out``. Needs matplotlib."""
    plot_points([(r.label, r.tiers[0]["capacity_blocks"], r.hit_rate, r.opt_hit_rate) for r in results], out)


def _outputs_error(args: argparse.Namespace) -> str | None:
    """Why the ``--json`` or ``--plot`` output cannot be made, or None (checked before the runs)."""
    for flag, out in (("--json", args.json), ("--plot", args.plot)):
        why = output_error(out) if out else None
        if why:
            return f"cannot write {flag} {out}: {why}"
    if args.plot:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return "--plot needs matplotlib (pip install matplotlib)"
        kinds = FigureCanvasBase.get_supported_filetypes()
        suffix = pathlib.PurePath(args.plot).suffix[1:].lower()
        if suffix and suffix not in kinds:     # no suffix: matplotlib's default format (PNG)
            return (f"cannot write --plot {args.plot}: matplotlib does not write .{suffix} files "
                    f"(give one of .{', .'.join(sorted(kinds))})")
    return None


def plot_points(points: Iterable[tuple[str, int, float, float | None]], path: str) -> None:
    """Plot ``(label, capacity in blocks, hit rate, OPT hit rate or None)`` points to a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("kvstore simulate: --plot needs matplotlib (pip install matplotlib)")
    series: dict[str, list[tuple[int, float]]] = {}
    opt: dict[int, float] = {}
    for label, cap, rate, opt_rate in points:
        series.setdefault(label, []).append((cap, rate))
        if opt_rate is not None:
            opt[cap] = opt_rate
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if opt:
        xs = sorted(opt)
        ax.plot(xs, [opt[x] for x in xs], "k--", marker="x", label="OPT (Belady)")
    ax.set_xlabel("capacity of the first tier (blocks)")
    ax.set_ylabel("token hit rate (prefix)")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    why = _outputs_error(args)
    if why:
        print(f"kvstore simulate: {why}", file=sys.stderr)
        return 2
    try:
        cfg = config_mod.load(args.config)
        requests = read_mooncake_trace(args.trace)
    except (ConfigError, TraceError) as e:
        print(f"kvstore simulate: {e}", file=sys.stderr)
        return 2
    if args.limit:
        requests = requests[:args.limit]
    if not requests:
        print("kvstore simulate: the trace has no requests", file=sys.stderr)
        return 2
    events = None
    ev_path = pathlib.Path(args.events) if args.events else None
    if ev_path is None:
        from kvstore.tools.agent_trace import events_path
        cand = events_path(args.trace)
        ev_path = cand if cand.exists() else None
    if ev_path is not None:
        from kvstore.tools.agent_trace import read_tool_events
        try:
            events = read_tool_events(ev_path)
        except TraceError as e:
            print(f"kvstore simulate: {e}", file=sys.stderr)
            return 2
        if args.limit:
            last = requests[-1].time_s
            events = [e for e in events if e.time_s <= last]
    bb = args.block_bytes
    measure = {"all": None, "first-half": halves(requests)[0], "second-half": halves(requests)[1]}[args.measure]
    hints = None
    if args.hints:
        try:
            spec = parse_hints_spec(args.hints, args.hint_seed)
        except ValueError as e:
            print(f"kvstore simulate: {e}", file=sys.stderr)
            return 2
        hints = derive(requests, virtual_times(requests), spec, TraceKeys())
    capacities = args.sweep or ([args.capacity] if args.capacity else [None])
    if args.unbounded:
        capacities = [None]
    policies = args.policies.split(",") if args.policies else ([None] if not args.sweep else list(ONLINE_POLICIES))
    prefetch_modes = {"config": [cfg.prefetch.enabled], "on": [True], "off": [False],
                      "both": [False, True]}[args.prefetch] if events is not None else [cfg.prefetch.enabled]
    bandwidth = _parse_bandwidth(args.bandwidth)
    results: list[SimResult] = []
    opt_cache: dict[int, float] = {}
    try:
        for cap in capacities:
            first = cap * bb if cap else None
            for pol in policies:
                specs = tiers_from_config(cfg, first_tier_bytes=first, policy=pol)
                if args.one_tier:
                    specs = specs[:1]
                if args.unbounded:
                    specs = [dataclasses.replace(s, capacity_bytes=1 << 62) for s in specs]
                for enabled in prefetch_modes:
                    pf = dataclasses.replace(cfg.prefetch, enabled=enabled)
                    label = "+".join(f"{s.name}:{s.policy}" for s in specs)
                    if events is not None:
                        label += " prefetch" if enabled else ""
                    if hints is not None:
                        label += f" {spec.label}"
                    r = run(requests, specs, block_bytes=bb, write_policy=cfg.policy.write,
                            events=events, prefetch=pf, hop_bandwidth=bandwidth, label=label,
                            oracle=any(s.policy == "opt" for s in specs), session_hints=hints, measure=measure,
                            session_config=cfg.sessions, promote_on_get=cfg.policy.promote_on_get,
                            trust={"off": True} if args.no_trust else None)
                    if not args.no_opt:
                        total = min(sum(s.capacity_bytes for s in specs), 1 << 62)
                        if total not in opt_cache:
                            opt_cache[total] = opt_hit_rate(requests, total, block_bytes=bb,
                                                            measure=measure).hit_rate
                        r.opt_hit_rate = opt_cache[total]
                    results.append(r)
                    if args.verbose_runs:
                        print_table([r])
    except ConfigError as e:
        print(f"kvstore simulate: {e}", file=sys.stderr)
        return 2
    print_table(results)
    try:
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2, default=str))
        if args.plot:
            plot(results, args.plot)
    except OSError as e:      # checked before the runs; gone since (a folder removed, a full disk)
        print(f"kvstore simulate: cannot write {e.filename or args.json or args.plot}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="replay a trace through the tier manager's placement logic (no data, virtual time)",
        description="Replay a Mooncake-format trace through the real tier manager over byte-less tiers and "
                    "report token hit rates per tier and total, and Belady's OPT at the same capacity. "
                    "With a tool-call events file (X.events.jsonl next to X.jsonl) also report the "
                    "resume-HBM-ready rate, prefetch waste and resume-time prediction error.")
    p.add_argument("trace", type=non_empty_path, help="Mooncake-format JSONL trace")
    p.add_argument("--config", type=non_empty_path,
                   help="node TOML config (tiers, policies, prefetch); default: built-in")
    p.add_argument("--block-bytes", type=at_most(positive_int, MAX_BLOCK_BYTES), default=DEFAULT_BLOCK_BYTES,
                   help="bytes per 512-token trace block (default 1 MiB: a '1500MiB' tier holds 1500 blocks; at most 1 GiB)")
    p.add_argument("--capacity", type=positive_int, help="capacity of the fastest tier, in blocks (overrides the config)")
    p.add_argument("--sweep", type=_parse_blocks_list,
                   help="comma-separated capacities of the fastest tier, in blocks, e.g. 1500,6000,12000 "
                        "(runs every policy of --policies; default all online policies)")
    p.add_argument("--policies", help=f"comma-separated eviction policies for every tier, e.g. "
                                      f"{','.join(ONLINE_POLICIES)} (default: the config's)")
    p.add_argument("--unbounded", action="store_true", help="make every tier unbounded (ideal hit rate check)")
    p.add_argument("--no-opt", action="store_true", help="skip the OPT (Belady) ceiling")
    p.add_argument("--events", type=non_empty_path,
                   help="tool-call events file (default: TRACE with .events.jsonl, if present)")
    p.add_argument("--prefetch", choices=("config", "on", "off", "both"), default="config",
                   help="with events: run with prefetch as configured, on, off, or both (default config)")
    p.add_argument("--bandwidth", action="append", metavar="SRC:DST=GBPS",
                   help="hop bandwidth for prefetch timing, e.g. host:hbm=25 (repeatable; over the "
                        "config's [prefetch.hop_bandwidth])")
    p.add_argument("--one-tier", action="store_true",
                   help="simulate only the config's fastest tier (as the tables in docs/placement.md)")
    p.add_argument("--hints", metavar="MODEL",
                   help="simulated session hints from the trace's future, as a framework could send them: "
                        "realistic[:sigma=S,wrong=P,notime] (state misjudged with probability P, default 0; "
                        "return time off by exp(N(0, S)) per request, default S=1.5), finish-only[:wrong=P], "
                        "continue-only[:sigma=S,wrong=P,notime]; or noisy:P,F, an ORACLE that knows each "
                        "next request's time up to one factor within F per conversation (a bound, not a "
                        "framework: noisy:0,1 is Belady's next use); any model takes source=NAME")
    p.add_argument("--no-trust", action="store_true",
                   help="believe every hint as given (no per-source trust; for comparison)")
    p.add_argument("--hint-seed", type=int, default=0, help="seed of the simulated hints' errors (default 0)")
    p.add_argument("--measure", choices=("all", "first-half", "second-half"), default="all",
                   help="count only these requests (all still drive the caches); default all")
    p.add_argument("--limit", type=positive_int, help="only the first N requests")
    p.add_argument("--json", type=non_empty_path, help="write all results as JSON here (the folder must exist)")
    p.add_argument("--plot", type=non_empty_path, help="write hit rate vs capacity (PNG) here; needs matplotlib")
    p.add_argument("--verbose-runs", action="store_true", help="print each run as it finishes")
    p.set_defaults(func=cmd_simulate)
