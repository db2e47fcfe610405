"""``kvstore simulate``: replay a trace through the real tier manager, with no data.

The simulator builds the daemon's :class:`kvstore.manager.TierManager` over byte-less
tiers (:class:`SimTier`, a :class:`tiers.null.NullTier`) with the policies the config
names, and drives it with a virtual clock, so placement decisions are the daemon's
own. Per request, exactly as ``kvstore replay`` does against a daemon:

1. (``next_use``) the request's keys feed the reuse model
   (:meth:`kvstore.prefetch.PrefetchScheduler.observe_request`);
2. ``lookup`` the keys: the hit prefix, and the tier of each hit block;
3. ``get`` each hit block (the access the policies see; a hit in a lower tier is
   promoted when the manager does so);
4. ``put`` each missed block (a block the policies refuse everywhere is not stored).

Token hit rates use prefix semantics: block ``i`` counts only when blocks ``0..i-1``
hit too; every block counts ``block_tokens`` (512) tokens except the last, which counts
``input_length - 512 * (n - 1)``. A hit is credited to the fastest tier holding the
block at lookup time. On the Mooncake conversation trace an unbounded cache gives
0.3736 (``../shared/data/README.md``).

The ceiling, OPT, is Belady's MIN with bypass (:mod:`kvstore.policy.opt`) in one tier
of the summed capacity of all tiers, fed each key's true next use.

With a tool-call events file (``kvstore gen-agent-trace`` writes ``X.events.jsonl``
next to ``X.jsonl``) the simulator also runs the
:class:`~kvstore.prefetch.PrefetchScheduler` and reports the resume-HBM-ready rate,
prefetch waste and resume-time prediction error, with and/or without prefetch.

Block sizes: every trace block is ``--block-bytes`` bytes (default 1 MiB, so a tier of
``"1500MiB"`` holds 1,500 blocks); capacities given in blocks are converted with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from tiers.base import ByteRanges, TierKind
from tiers.null import NullTier

from . import config as config_mod
from .errors import ConfigError, TierFull
from .manager import TierManager
from .policy import AcceptsNextUse, UsesReuseModel, make_policy
from .predictor import ReuseModel
from .prefetch import PrefetchScheduler
from .trace import TRACE_BLOCK_TOKENS, Request, TraceError, block_key, read_mooncake_trace

DEFAULT_BLOCK_BYTES = 1 << 20
ONLINE_POLICIES = ("lru", "arc", "s3fifo", "next_use")
_KINDS = {"hbm": TierKind.HBM, "host": TierKind.HOST, "nvme": TierKind.NVME}


class SimTier(NullTier):
    """A :class:`NullTier` whose reads return one shared zero buffer per block size, so a
    simulated get costs no allocation (the manager never looks at the bytes)."""

    _zeros: dict[int, bytes] = {}

    def read(self, key: bytes, ranges: ByteRanges | None = None) -> bytes:
        size = sum(n for _, n in ranges) if ranges else self.size_of(key)
        buf = self._zeros.get(size)
        if buf is None:
            buf = self._zeros[size] = bytes(size)
        return buf


@dataclass(frozen=True)
class TierSpec:
    """One simulated tier: ``name`` (hbm/host/nvme), capacity in bytes, policy and params."""

    name: str
    capacity_bytes: int
    policy: str
    params: dict = field(default_factory=dict)

    @property
    def kind(self) -> TierKind:
        return _KINDS.get(self.name, TierKind.HOST)


@dataclass
class SimResult:
    """Outcome of one simulated configuration (token counts, rates in [0, 1], seconds)."""

    label: str
    tiers: list[dict]
    requests: int
    blocks: int
    input_tokens: int
    hit_tokens: dict[str, int]
    hit_blocks: int
    refused_puts: int
    seconds: float
    counters: dict[str, int]
    opt_hit_rate: float | None = None
    prefetch: dict | None = None

    @property
    def hit_rate(self) -> float:
        """Token hit rate over all tiers."""
        return sum(self.hit_tokens.values()) / self.input_tokens if self.input_tokens else 0.0

    @property
    def tier_hit_rates(self) -> dict[str, float]:
        return {k: (v / self.input_tokens if self.input_tokens else 0.0) for k, v in self.hit_tokens.items()}

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(hit_rate=self.hit_rate, tier_hit_rates=self.tier_hit_rates, block_hit_rate=self.block_hit_rate)
        if self.opt_hit_rate:
            d["ratio_to_opt"] = self.hit_rate / self.opt_hit_rate
        return d


def tiers_from_config(cfg: config_mod.Config, *, first_tier_bytes: int | None = None,
                      policy: str | None = None, params: dict | None = None) -> list[TierSpec]:
    """The enabled tiers of ``cfg``, fastest first, with their policies.

    ``first_tier_bytes`` overrides the fastest tier's capacity; ``policy``/``params``
    override every tier's eviction policy.
    """
    specs = []
    for name in ("hbm", "host", "nvme"):
        t = getattr(cfg.tiers, name)
        if not t.enabled:
            continue
        pc = cfg.tier_policy(name)
        cap = t.capacity
        if first_tier_bytes is not None and not specs:
            cap = first_tier_bytes
        specs.append(TierSpec(name, cap, policy or pc.eviction,
                              dict(params if params is not None and policy else pc.params)))
    return specs


def _virtual_times(requests: Sequence[Request]) -> list[float]:
    """Arrival times in seconds, made strictly increasing (ties get 1 ns steps)."""
    out, last = [], -math.inf
    for r in requests:
        t = max(r.time_s, last + 1e-9)
        out.append(t)
        last = t
    return out


def _next_use_times(requests: Sequence[Request], vt: Sequence[float]) -> list[list[float]]:
    """For each request and block, the virtual time of the next request using that block."""
    nxt: list[list[float]] = [[]] * len(requests)
    last: dict[int, float] = {}
    for j in range(len(requests) - 1, -1, -1):
        ids = requests[j].hash_ids
        nxt[j] = [last.get(x, math.inf) for x in ids]
        t = vt[j]
        for x in ids:
            last[x] = t
    return nxt


class _Keys:
    """Trace block id -> 32-byte key, memoised."""

    def __init__(self) -> None:
        self._cache: dict[int, bytes] = {}

    def __call__(self, ids: Iterable[int]) -> list[bytes]:
        cache = self._cache
        out = []
        for x in ids:
            k = cache.get(x)
            if k is None:
                k = cache[x] = block_key(x)
            out.append(k)
        return out


def run(requests: Sequence[Request], tiers: Sequence[TierSpec], *,
        block_bytes: int = DEFAULT_BLOCK_BYTES, write_policy: str = "write_back",
        oracle: bool = False, events: Sequence | None = None,
        prefetch: config_mod.PrefetchConfig | None = None,
        hop_bandwidth: dict | None = None, block_tokens: int = TRACE_BLOCK_TOKENS,
        label: str | None = None, reuse_model: ReuseModel | None = None) -> SimResult:
    """Simulate ``requests`` through a :class:`TierManager` over ``tiers``.

    Args:
        requests: trace requests, sorted by time.
        tiers: fastest first.
        block_bytes: bytes of every trace block.
        write_policy: ``write_back`` or ``write_through``.
        oracle: feed each policy that accepts next-use hints the true next use of every
            key (for ``opt``).
        events: tool-call events (:class:`kvstore.agent_trace.ToolEvent`) to drive the
            prefetch scheduler with; readiness etc. are reported in ``prefetch``.
        prefetch: the ``[prefetch]`` config (``enabled`` false: observe only).
        hop_bandwidth: bytes/s per (source, destination) tier kind for the scheduler.
        label: name of the run in reports (default: the policies).
        reuse_model: the model ``next_use`` learns in (default: a fresh one).
    Returns:
        the hit rates and counters (:class:`SimResult`).
    """
    started = time.perf_counter()
    clock = [0.0]
    sim_tiers = [SimTier(t.kind, t.capacity_bytes, name=t.name) for t in tiers]
    policies = [make_policy(t.policy, t.capacity_bytes, t.params) for t in tiers]
    manager = TierManager(sim_tiers, policies, write_policy=write_policy, clock=lambda: clock[0])
    needs_model = any(isinstance(p, UsesReuseModel) for p in policies)
    scheduler = None
    if needs_model or events is not None:
        scheduler = PrefetchScheduler(manager, prefetch or config_mod.PrefetchConfig(),
                                      clock=lambda: clock[0], hop_bandwidth=hop_bandwidth,
                                      measure_bandwidth=False, reuse_model=reuse_model, dedupe_s=0.0)
    oracle_policies = [p for p in policies if isinstance(p, AcceptsNextUse)] if oracle else []
    vt = _virtual_times(requests)
    nxt = _next_use_times(requests, vt) if oracle_policies else None
    keys_of = _Keys()
    payload = bytes(block_bytes)
    hit_tokens = {t.name: 0 for t in tiers}
    kind_name = {t.kind: t.name for t in tiers}
    input_tokens = blocks = hit_blocks = refused = 0

    # one time-ordered stream: (time, order, index); resumes before the request they
    # announce, tool-call starts after the request they follow
    stream: list[tuple[float, int, int]] = [(vt[j], 1, j) for j in range(len(requests))]
    if events is not None:
        stream.extend((e.time_s, 0 if e.kind == "resume" else 2, i) for i, e in enumerate(events))
        stream.sort()

    for t, order, idx in stream:
        if scheduler is not None and scheduler.enabled:
            due = scheduler.next_due()
            while due <= t:
                clock[0] = due
                scheduler.tick(due)
                due = scheduler.next_due()
            clock[0] = t
            scheduler.tick(t)      # the daemon's thread polls; here every event is a poll
        clock[0] = t
        if order == 0:
            scheduler.resume(events[idx].trajectory, t)
            continue
        if order == 2:
            e = events[idx]
            scheduler.tool_call_start(e.trajectory, e.tool, t, keys_of(e.hash_ids))
            continue
        req = requests[idx]
        keys = keys_of(req.hash_ids)
        if scheduler is not None:
            scheduler.observe_request(keys, t)
        if nxt is not None:
            for p in oracle_policies:
                p.set_next_use(keys, nxt[idx], t)
        look = manager.lookup(keys)
        k = look.hit_blocks
        n = len(keys)
        blocks += n
        hit_blocks += k
        input_tokens += req.input_length
        for i in range(k):
            tok = block_tokens if i < n - 1 else req.input_length - block_tokens * (n - 1)
            hit_tokens[kind_name[look.tiers[i]]] += tok
        for key in keys[:k]:
            manager.get(key)
        for key in keys[k:]:
            try:
                manager.put(key, payload)
            except TierFull:
                refused += 1
    pf = None
    if scheduler is not None and events is not None:
        scheduler.finish()
        pf = scheduler.stats.summary()
        pf["enabled"] = scheduler.enabled
    return SimResult(
        label=label or "+".join(f"{t.name}:{t.policy}" for t in tiers),
        tiers=[{"name": t.name, "capacity_bytes": t.capacity_bytes, "capacity_blocks": t.capacity_bytes // block_bytes,
                "policy": t.policy, "params": t.params} for t in tiers],
        requests=len(requests), blocks=blocks, input_tokens=input_tokens, hit_tokens=hit_tokens,
        hit_blocks=hit_blocks, refused_puts=refused, seconds=time.perf_counter() - started,
        counters=dict(manager.counters), prefetch=pf)


def opt_hit_rate(requests: Sequence[Request], capacity_bytes: int, *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES) -> SimResult:
    """Belady's MIN (with bypass, prefix order ties) in one tier of ``capacity_bytes``."""
    return run(requests, [TierSpec("host", capacity_bytes, "opt")], block_bytes=block_bytes,
               oracle=True, label="opt")


# --------------------------------------------------------------------------- CLI


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
            out[(_KINDS[src.strip()], _KINDS[dst.strip()])] = float(gbps) * 1e9
        except (ValueError, KeyError):
            raise SystemExit(f"kvstore simulate: --bandwidth expects SRC:DST=GBPS with tiers hbm/host/nvme, "
                             f"got {item!r}")
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
                  f"of {p['resumes']} resumes, waste {p['waste']:.3f} "
                  f"({p['wasted_bytes']}/{p['promoted_bytes']} bytes), prediction MAE "
                  f"{p['prediction_mae_s']:.2f} s, median rel. error {p['prediction_median_rel_error']:.2f}",
                  file=out)


def plot(results: Sequence[SimResult], path: str) -> None:
    """Hit rate vs first-tier capacity per policy, OPT dashed. Needs matplotlib."""
    plot_points([(r.label, r.tiers[0]["capacity_blocks"], r.hit_rate, r.opt_hit_rate) for r in results], path)


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
        from .agent_trace import events_path
        cand = events_path(args.trace)
        ev_path = cand if cand.exists() else None
    if ev_path is not None:
        from .agent_trace import read_tool_events
        try:
            events = read_tool_events(ev_path)
        except TraceError as e:
            print(f"kvstore simulate: {e}", file=sys.stderr)
            return 2
        if args.limit:
            last = requests[-1].time_s
            events = [e for e in events if e.time_s <= last]
    bb = args.block_bytes
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
                if args.unbounded:
                    specs = [dataclasses.replace(s, capacity_bytes=1 << 62) for s in specs]
                for enabled in prefetch_modes:
                    pf = dataclasses.replace(cfg.prefetch, enabled=enabled)
                    label = "+".join(f"{s.name}:{s.policy}" for s in specs)
                    if events is not None:
                        label += " prefetch" if enabled else ""
                    r = run(requests, specs, block_bytes=bb, write_policy=cfg.policy.write,
                            events=events, prefetch=pf, hop_bandwidth=bandwidth, label=label,
                            oracle=any(s.policy == "opt" for s in specs))
                    if not args.no_opt:
                        total = min(sum(s.capacity_bytes for s in specs), 1 << 62)
                        if total not in opt_cache:
                            opt_cache[total] = opt_hit_rate(requests, total, block_bytes=bb).hit_rate
                        r.opt_hit_rate = opt_cache[total]
                    results.append(r)
                    if args.verbose_runs:
                        print_table([r])
    except ConfigError as e:
        print(f"kvstore simulate: {e}", file=sys.stderr)
        return 2
    print_table(results)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2, default=str))
    if args.plot:
        plot(results, args.plot)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="replay a trace through the tier manager's placement logic (no data, virtual time)",
        description="Replay a Mooncake-format trace through the real tier manager over byte-less tiers and "
                    "report token hit rates per tier and total, and Belady's OPT at the same capacity. "
                    "With a tool-call events file (X.events.jsonl next to X.jsonl) also report the "
                    "resume-HBM-ready rate, prefetch waste and resume-time prediction error.")
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument("--config", help="node TOML config (tiers, policies, prefetch); default: built-in")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES,
                   help="bytes per 512-token trace block (default 1 MiB: a '1500MiB' tier holds 1500 blocks)")
    p.add_argument("--capacity", type=int, help="capacity of the fastest tier, in blocks (overrides the config)")
    p.add_argument("--sweep", type=_parse_blocks_list,
                   help="comma-separated capacities of the fastest tier, in blocks, e.g. 1500,6000,12000 "
                        "(runs every policy of --policies; default all online policies)")
    p.add_argument("--policies", help=f"comma-separated eviction policies for every tier, e.g. "
                                      f"{','.join(ONLINE_POLICIES)} (default: the config's)")
    p.add_argument("--unbounded", action="store_true", help="make every tier unbounded (ideal hit rate check)")
    p.add_argument("--no-opt", action="store_true", help="skip the OPT (Belady) ceiling")
    p.add_argument("--events", help="tool-call events file (default: TRACE with .events.jsonl, if present)")
    p.add_argument("--prefetch", choices=("config", "on", "off", "both"), default="config",
                   help="with events: run with prefetch as configured, on, off, or both (default config)")
    p.add_argument("--bandwidth", action="append", metavar="SRC:DST=GBPS",
                   help="hop bandwidth for prefetch timing, e.g. host:hbm=25 (repeatable)")
    p.add_argument("--limit", type=int, help="only the first N requests")
    p.add_argument("--json", help="write all results as JSON here")
    p.add_argument("--plot", help="write hit rate vs capacity (PNG) here; needs matplotlib")
    p.add_argument("--verbose-runs", action="store_true", help="print each run as it finishes")
    p.set_defaults(func=cmd_simulate)
