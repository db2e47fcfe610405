"""``kvstore simulate``: replay a trace through the real tier manager, with no data.

The simulator builds the daemon's :class:`kvstore.store.manager.TierManager` over byte-less
tiers (:class:`SimTier`, a :class:`tiers.null.NullTier`) with the policies the config
names, and drives it with a virtual clock, so placement decisions are the daemon's
own. Per request, exactly as ``kvstore replay`` does against a daemon:

1. (``next_use``) the request's keys feed the reuse model
   (:meth:`kvstore.agent.prefetch.PrefetchScheduler.observe_request`);
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
:class:`~kvstore.agent.prefetch.PrefetchScheduler` and reports the resume-HBM-ready rate,
prefetch waste and resume-time prediction error, with and/or without prefetch;
``prefetch["every_resume"]`` scores every resume of the trace, those the scheduler had
stopped waiting for as not ready (:class:`kvstore.tools.sim_events.ResumeScore`).

Session hints (``--hints MODEL``, :mod:`kvstore.tools.sim_hints`; or ``session_end``
events of a generated agent trace) go through a :class:`~kvstore.agent.sessions.SessionTable`
as the daemon's would: before the request's lookup, as if they came in its ``kv_hints``.

``measure`` restricts the counted requests to a time window (e.g. the second half of
the trace), while every request still drives the caches: parameters tuned on the first
half are reported on the second (docs/placement.md, "Tuning discipline").

Block sizes: every trace block is ``--block-bytes`` bytes (default 1 MiB, so a tier of
``"1500MiB"`` holds 1,500 blocks); capacities given in blocks are converted with it.

The CLI is in :mod:`kvstore.tools.simulate_cli`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tiers.base import ByteRanges, TierKind
from tiers.null import NullTier

from kvstore import config as config_mod
from kvstore.common.errors import TierFull
from kvstore.agent.hint_model import HintCalibration
from kvstore.agent.hint_trust import HintTrust
from kvstore.store.manager import TierManager
from kvstore.policy import AcceptsNextUse, EvictionEvent, UsesReuseModel, make_policy
from kvstore.policy.reuse_model import ReuseModel
from kvstore.agent.prefetch import PrefetchScheduler
from kvstore.agent.sessions import SessionHint, SessionTable
from kvstore.service import build
from kvstore.tools.sim_events import ResumeScore
from kvstore.tools.trace import TRACE_BLOCK_TOKENS, Request, block_key

DEFAULT_BLOCK_BYTES = 1 << 20
ONLINE_POLICIES = ("lru", "arc", "s3fifo", "next_use")
TIER_KINDS = {"hbm": TierKind.HBM, "host": TierKind.HOST, "nvme": TierKind.NVME}


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
        return TIER_KINDS.get(self.name, TierKind.HOST)


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
    sessions: dict | None = None
    measure: tuple[float, float] | None = None
    windows: dict[str, list[int]] | None = None     # name -> [input tokens, hit tokens]

    @property
    def hit_rate(self) -> float:
        """Token hit rate over all tiers."""
        return sum(self.hit_tokens.values()) / self.input_tokens if self.input_tokens else 0.0

    def window_rate(self, name: str) -> float:
        """Token hit rate of the requests in the extra window ``name`` (``windows``)."""
        inp, hit = self.windows[name]
        return hit / inp if inp else 0.0

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


def virtual_times(requests: Sequence[Request]) -> list[float]:
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


class TraceKeys:
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
        label: str | None = None, reuse_model: ReuseModel | None = None,
        session_hints: Sequence[SessionHint | None] | None = None,
        measure: tuple[float, float] | None = None, windows: dict[str, tuple[float, float]] | None = None,
        on_eviction: Callable[[EvictionEvent], None] | None = None,
        scheduler_options: dict | None = None, calibration: dict | None = None, trust: dict | None = None,
        session_config: config_mod.SessionsConfig | None = None, promote_on_get: bool = True) -> SimResult:
    """Simulate ``requests`` through a :class:`TierManager` over ``tiers``.

    Args:
        requests: trace requests, sorted by time.
        tiers: fastest first.
        block_bytes: bytes of every trace block.
        write_policy: ``write_back`` or ``write_through``.
        oracle: feed each policy that accepts next-use hints the true next use of every
            key (for ``opt``).
        events: tool-call and session events (:class:`kvstore.tools.agent_trace.ToolEvent`) to
            drive the prefetch scheduler with; readiness etc. are reported in ``prefetch``.
        prefetch: the ``[prefetch]`` config (``enabled`` false: observe only); its keys
            reach the scheduler as in the daemon (:func:`kvstore.service.build.prefetch_options`)
            except ``measure_bandwidth`` (off: time is virtual) and ``dedupe_s`` (0: one
            lookup per request).
        hop_bandwidth: bytes/s per (source, destination) tier kind for the scheduler, over
            the config's ``[prefetch.hop_bandwidth]``.
        label: name of the run in reports (default: the policies).
        reuse_model: the model ``next_use`` learns in (default: a fresh one).
        session_hints: one hint (or None) per request, applied before its lookup.
        measure: count only requests arriving in ``[start, end)`` seconds.
        windows: more named ``[start, end)`` windows (seconds) whose token hit rates are
            counted too (:meth:`SimResult.window_rate`), from the same run.
        on_eviction: called with every pressure eviction of every tier.
        scheduler_options: more keyword arguments of the
            :class:`~kvstore.agent.prefetch.PrefetchScheduler` (e.g. ``victim_margin``).
        calibration: keyword arguments of the session table's
            :class:`~kvstore.agent.hint_model.HintCalibration`; ``{"off": True}``: no calibration.
        trust: keyword arguments of its :class:`~kvstore.agent.hint_trust.HintTrust`;
            ``{"off": True}``: every hint believed as given.
        session_config: the ``[sessions]`` config of the session table (default: the defaults).
        promote_on_get: ``[policy] promote_on_get`` of the manager.
    Returns:
        the hit rates and counters (:class:`SimResult`).
    """
    started = time.perf_counter()
    clock = [0.0]
    sim_tiers = [SimTier(t.kind, t.capacity_bytes, name=t.name) for t in tiers]
    policies = [make_policy(t.policy, t.capacity_bytes, t.params, tier_name=t.name) for t in tiers]
    for p in policies:
        p.listener = on_eviction
    manager = TierManager(sim_tiers, policies, write_policy=write_policy, clock=lambda: clock[0],
                          promote_on_get=promote_on_get)
    needs_model = any(isinstance(p, UsesReuseModel) for p in policies)
    cal = dict(calibration or {})
    off = cal.pop("off", False)
    table = build.session_options(session_config or config_mod.SessionsConfig())
    table["calibrate"] = table["calibrate"] and not off
    tr = dict(trust or {})
    trusting = not tr.pop("off", False)
    sessions = SessionTable(policies, calibration=HintCalibration(**cal), trust=HintTrust(**tr) if trusting else None,
                            trusting=trusting, **table)
    scheduler = None
    if needs_model or events is not None:
        pf = prefetch or config_mod.PrefetchConfig()
        options = build.prefetch_options(pf)
        options.update(hop_bandwidth={**options["hop_bandwidth"], **(hop_bandwidth or {})},
                       measure_bandwidth=False, dedupe_s=0.0, **(scheduler_options or {}))
        scheduler = PrefetchScheduler(manager, pf, clock=lambda: clock[0], reuse_model=reuse_model,
                                      sessions=sessions, **options)
    oracle_policies = [p for p in policies if isinstance(p, AcceptsNextUse)] if oracle else []
    vt = virtual_times(requests)
    nxt = _next_use_times(requests, vt) if oracle_policies else None
    keys_of = TraceKeys()
    payload = bytes(block_bytes)
    hit_tokens = {t.name: 0 for t in tiers}
    kind_name = {t.kind: t.name for t in tiers}
    input_tokens = blocks = hit_blocks = refused = 0
    lo, hi = measure if measure is not None else (-math.inf, math.inf)
    extra = {name: [w, [0, 0]] for name, w in (windows or {}).items()}

    # one time-ordered stream: (time, order, index); resumes before the request they
    # announce, tool-call starts and session ends after the request they follow
    stream: list[tuple[float, int, int]] = [(vt[j], 1, j) for j in range(len(requests))]
    score = ResumeScore()
    if events is not None:
        stream.extend((e.time_s, 0 if e.kind == "resume" else 2, i) for i, e in enumerate(events))
        stream.sort()

    for t, order, idx in stream:
        if scheduler is not None:
            due = scheduler.next_due()
            while due <= t:
                clock[0] = due
                scheduler.tick(due)
                due = scheduler.next_due()
            clock[0] = t
            scheduler.tick(t)      # the daemon's thread polls; here every event is a poll
        else:
            sessions.tick(t)
        clock[0] = t
        if order != 1:
            if scheduler is not None:
                score.event(scheduler, events[idx], t, keys_of)
            continue
        req = requests[idx]
        keys = keys_of(req.hash_ids)
        hint = session_hints[idx] if session_hints is not None else None
        if hint is not None:
            if scheduler is not None:
                scheduler.session_hint(hint)
            else:
                sessions.apply(hint, t)
        if scheduler is not None:
            scheduler.observe_request(keys, t)
        if nxt is not None:
            for p in oracle_policies:
                p.set_next_use(keys, nxt[idx], t)
        look = manager.lookup(keys)
        k = look.hit_blocks
        for (wlo, whi), counts in extra.values():
            if wlo <= t < whi:
                counts[0] += req.input_length
                counts[1] += req.prefix_tokens(k, block_tokens)
        n = len(keys)
        if lo <= t < hi:
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
                stored = manager.put(key, payload)
            except TierFull:
                stored = False
            if not stored and not manager.lookup([key]).hit_blocks:   # not already there: refused
                refused += 1
    pf = None
    if scheduler is not None and events is not None:
        scheduler.finish()
        pf = scheduler.stats.summary()
        pf["enabled"] = scheduler.enabled
        pf["every_resume"] = score.summary()
    st = dataclasses.asdict(sessions.stats) if sessions.stats.hints else None
    return SimResult(
        label=label or "+".join(f"{t.name}:{t.policy}" for t in tiers),
        tiers=[{"name": t.name, "capacity_bytes": t.capacity_bytes, "capacity_blocks": t.capacity_bytes // block_bytes,
                "policy": t.policy, "params": t.params} for t in tiers],
        requests=len(requests), blocks=blocks, input_tokens=input_tokens, hit_tokens=hit_tokens,
        hit_blocks=hit_blocks, refused_puts=refused, seconds=time.perf_counter() - started,
        counters=dict(manager.counters), prefetch=pf, sessions=st, measure=measure,
        windows={name: counts for name, (_, counts) in extra.items()} or None)


def opt_hit_rate(requests: Sequence[Request], capacity_bytes: int, *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, measure: tuple[float, float] | None = None,
                 windows: dict[str, tuple[float, float]] | None = None) -> SimResult:
    """Belady's MIN (with bypass, prefix order ties) in one tier of ``capacity_bytes``,
    counting the requests in ``measure`` (seconds) only."""
    return run(requests, [TierSpec("host", capacity_bytes, "opt")], block_bytes=block_bytes,
               oracle=True, label="opt", measure=measure, windows=windows)


def halves(requests: Sequence[Request]) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first and second half of the trace's time span, as ``measure`` windows (seconds)."""
    if not requests:
        return (0.0, 0.0), (0.0, 0.0)
    mid = (requests[0].time_s + requests[-1].time_s) / 2.0
    return (-math.inf, mid), (mid, math.inf)
