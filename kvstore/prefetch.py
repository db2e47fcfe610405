"""Tool-call-timed prefetch: page a waiting trajectory's prefix back before it resumes.

A worker tells the daemon (gRPC ``ToolCallStart``) that trajectory T called tool X at
time t and that its prefix is keys K; later (``Resume``) that T came back. The
:class:`PrefetchScheduler`:

1. predicts the resume time from X's learned duration distribution
   (:class:`kvstore.predictor.ToolPredictor`) and returns the median;
2. tells hint-aware eviction policies (``next_use``) when K will be needed, so they
   evict blocks needed later first (and, once promoted, keep K until T resumes);
3. schedules T's promotion back to HBM to *finish* ``lead_time_s`` before the
   ``quantile``-quantile of X's duration (a low quantile: ready for most resumes),
   starting early enough for the transfer at each hop's bandwidth (measured on the
   daemon, configured in the simulator; transfers on one hop queue behind each other);
   while T waits past its median, renews the hints and re-promotes what was evicted;
4. optionally (``headroom_fraction``, off by default) demotes the blocks of the
   trajectories expected last to keep free space in HBM.

Promotion never evicts a pinned block, a block of a running trajectory, a block it
promoted that has not been used yet, or a block of a trajectory expected to resume no
later than T (expected: the median of the tool's duration given the time already
waited): victims are first blocks of trajectories expected later (farthest first,
tail first), then the tier policy's choice among unprotected blocks (``next_use``'s
only if that block is predicted to be needed later than T); if none is left the
promotion stops and is retried shortly.

The scheduler also measures what it is for (:class:`PrefetchStats`): the share of
resumes whose whole prefix K was in HBM (and its transfer finished) when T resumed,
the bytes it promoted that were evicted before use (waste), and the error of its
resume-time predictions. With ``enabled = false`` it only observes (requests,
predictions, readiness) and moves nothing.

**Bounded state.** A trajectory that never resumes *expires* ``expire_factor`` times
its tool's predicted (median) duration after its call started, at most ``max_wait_s``
later: it leaves the waiting table, nothing is promoted for it again, and a late
Resume still teaches the predictor (the last ``max_waiting`` expired calls are
remembered by tool and start time only). At most ``max_waiting`` trajectories wait
(past it the one due to expire first expires now) and at most ``max_waiting`` recently
resumed ones are protected; the due-time heap is compacted when stale entries
outnumber live ones; error statistics keep running sums and a fixed-size reservoir
(:data:`RESERVOIR`). Every time is on the scheduler's clock (``time.monotonic`` in the
daemon: stepping the wall clock moves nothing).

The daemon calls :meth:`PrefetchScheduler.tool_call_start` / :meth:`resume` from its
gRPC handlers, :meth:`observe_request` from Lookup (it feeds the ``next_use`` policy's
:class:`~kvstore.predictor.ReuseModel`), and runs :meth:`start` (a background thread
calling :meth:`tick`). ``kvstore simulate`` calls the same methods with virtual time.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tiers.base import TierKind

from .config import PrefetchConfig
from .manager import TierManager
from .catalogue import BlockEvent
from .predictor import ReuseModel, ToolPredictor

log = logging.getLogger("kvstore.prefetch")

DEFAULT_HOP_BANDWIDTH: dict[tuple[TierKind, TierKind], float] = {
    (TierKind.HOST, TierKind.HBM): 64e9,   # PCIe Gen5 x16
    (TierKind.NVME, TierKind.HBM): 1.5e9,  # NVMe read (fio O_DIRECT, measured on our machines)
    (TierKind.NVME, TierKind.HOST): 1.5e9,
    (TierKind.HBM, TierKind.HOST): 64e9,
    (TierKind.HOST, TierKind.NVME): 4e9,
}
"""Bytes per second per (source, destination) hop, before any measurement."""

_PROMOTE, _REFRESH = 0, 1

RESERVOIR = 4096
"""Prediction errors kept for the medians of :meth:`PrefetchStats.summary` (a uniform
sample of all resumes: Vitter 1985, "Random sampling with a reservoir", Algorithm R)."""


@dataclass
class PrefetchStats:
    """What the scheduler did and how well it did it (bytes, seconds, counts)."""

    tool_calls: int = 0
    resumes: int = 0
    resumes_unknown: int = 0
    resumes_ready: int = 0            # whole prefix in HBM (transfer finished) at resume
    promoted_blocks: int = 0
    promoted_bytes: int = 0
    used_bytes: int = 0               # promoted and still in HBM at resume
    wasted_bytes: int = 0             # promoted, evicted from HBM before use, or never used
    demoted_blocks: int = 0
    promotions_blocked: int = 0       # no room without evicting a protected block
    expired: int = 0                  # waiting trajectories dropped without a resume
    resumes_expired: int = 0          # resumes of expired trajectories (learned from, not scored)
    abs_error_s: list[float] = field(default_factory=list)     # reservoir of |predicted - actual| (s)
    rel_error: list[float] = field(default_factory=list)       # the same resumes' relative errors
    errors_seen: int = 0
    abs_error_sum_s: float = 0.0
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False, compare=False)

    def add_error(self, abs_error_s: float, rel_error: float) -> None:
        """One resume's prediction error, kept in O(:data:`RESERVOIR`) memory."""
        self.errors_seen += 1
        self.abs_error_sum_s += abs_error_s
        if len(self.abs_error_s) < RESERVOIR:
            self.abs_error_s.append(abs_error_s)
            self.rel_error.append(rel_error)
            return
        j = self._rng.randrange(self.errors_seen)
        if j < RESERVOIR:
            self.abs_error_s[j], self.rel_error[j] = abs_error_s, rel_error

    @property
    def ready_rate(self) -> float:
        """Share of known resumes whose prefix was wholly in HBM when they arrived."""
        return self.resumes_ready / self.resumes if self.resumes else 0.0

    @property
    def waste(self) -> float:
        """Wasted promoted bytes / promoted bytes (0 when nothing was promoted)."""
        return self.wasted_bytes / self.promoted_bytes if self.promoted_bytes else 0.0

    def summary(self) -> dict:
        errs = sorted(self.abs_error_s)
        rel = sorted(self.rel_error)
        return {
            "tool_calls": self.tool_calls, "resumes": self.resumes,
            "resumes_unknown": self.resumes_unknown, "ready_rate": self.ready_rate,
            "promoted_blocks": self.promoted_blocks, "promoted_bytes": self.promoted_bytes,
            "wasted_bytes": self.wasted_bytes, "waste": self.waste,
            "demoted_blocks": self.demoted_blocks, "promotions_blocked": self.promotions_blocked,
            "expired": self.expired, "resumes_expired": self.resumes_expired,
            "prediction_mae_s": self.abs_error_sum_s / self.errors_seen if self.errors_seen else 0.0,
            "prediction_median_abs_error_s": errs[len(errs) // 2] if errs else 0.0,
            "prediction_median_rel_error": rel[len(rel) // 2] if rel else 0.0,
        }


@dataclass
class _Waiting:
    trajectory_id: str
    tool: str
    start: float
    keys: list[bytes]
    predicted_resume: float          # median (returned to the worker)
    ready_by: float                  # quantile time minus lead: HBM must hold keys by then
    promote_at: float
    promoted: bool = False           # promotion done (or in flight); False: due / retry
    started: bool = False            # some promotion for this wait has begun
    done_at: float = 0.0             # when the last transfer of the promotion finishes
    seq: int = 0
    expires_at: float = math.inf     # dropped from the waiting table then, resumed or not


class PrefetchScheduler:
    """Tool-call hints -> resume predictions, eviction hints, demotion and timed promotion.

    Args:
        manager: the tier manager (tier 0 is HBM, or the fastest tier present).
        prefetch_config: ``[prefetch]`` section: ``enabled``, ``predictor``
            (``quantile`` | ``lognormal``), ``lead_time_s`` (seconds the promotion should
            finish before the need), ``quantile`` (of the tool's duration at which the
            blocks must be back, e.g. 0.1), ``window`` (observations per tool).
        clock: time source in seconds (``time.monotonic`` in the daemon, virtual in the
            simulator); every time passed in is on this clock.
        hop_bandwidth: bytes/s per (source kind, destination kind); defaults
            :data:`DEFAULT_HOP_BANDWIDTH`. Replaced by measurements when
            ``measure_bandwidth`` is on.
        measure_bandwidth: time each promotion with ``time.perf_counter`` and keep an
            exponentially weighted average per hop (daemon; off in the simulator,
            where copies take no real time).
        headroom_fraction: free share of tier 0 kept by demoting the blocks of the waiting
            trajectories expected last (0: off; the simulations showed the churn costs
            more than it saves, see docs/placement.md).
        active_protect_s: seconds after a resume during which the trajectory's prefix is
            treated as in use (never evicted by a promotion).
        reuse_model: the learned reuse model fed by :meth:`observe_request`; attached to
            every policy that uses one.
        poll_s: the background thread's longest sleep (seconds).
        refresh_s: once a trajectory waits past its predicted (median) resume, every
            ``refresh_s`` seconds its next-use hint is renewed from the tool's duration
            given the time already waited, and blocks evicted meanwhile are promoted again.
        retry_s: a promotion that found no room is retried after this many seconds.
        margin_s: a promotion displaces another waiting trajectory's blocks only when
            that one is expected to resume at least this many seconds later, and never
            the blocks of one it already promoted (no ping-pong).
        dedupe_s: :meth:`observe_request` counts a prefix seen again within this many
            seconds once (every TP rank looks the prefix up; the simulator passes 0).
    """

    def __init__(self, manager: TierManager, prefetch_config: PrefetchConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 hop_bandwidth: Mapping[tuple[TierKind, TierKind], float] | None = None,
                 measure_bandwidth: bool = True, headroom_fraction: float = 0.0,
                 active_protect_s: float = 30.0, reuse_model: ReuseModel | None = None,
                 poll_s: float = 0.05, refresh_s: float = 2.0, retry_s: float = 0.5,
                 margin_s: float = 1.0, dedupe_s: float = 0.5):
        cfg = prefetch_config or PrefetchConfig()
        self.manager = manager
        self.config = cfg
        self.enabled = cfg.enabled
        self.clock = clock
        self.predictor = ToolPredictor(cfg.predictor, cfg.window)
        self.bandwidth = dict(DEFAULT_HOP_BANDWIDTH)
        self.bandwidth.update(hop_bandwidth or {})
        self.measure_bandwidth = measure_bandwidth
        self.headroom_fraction = headroom_fraction
        self.active_protect_s = active_protect_s
        self.poll_s = poll_s
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.margin_s = margin_s
        self.dedupe_s = dedupe_s
        self._recent: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self._expect_cache: dict[str, float] = {}
        self.model = reuse_model or ReuseModel()
        manager.attach_reuse_model(self.model)
        self.stats = PrefetchStats()
        self._removed: collections.deque[bytes] = collections.deque()   # keys that left tier 0
        self._fast_name = manager.tier_name(0)
        manager.events.subscribe(self._on_event)
        self._lock = threading.RLock()
        self._waiting: dict[str, _Waiting] = {}
        self._due: list[tuple[float, int, str, int]] = []   # (time, seq, trajectory, action)
        self._seq = 0
        self._active: dict[str, tuple[float, list[bytes]]] = {}   # resumed: (time, keys), oldest first
        self._expiry: list[tuple[float, int, str]] = []            # (expires_at, seq, trajectory)
        self._expired: OrderedDict[str, tuple[str, float]] = OrderedDict()   # trajectory -> (tool, start)
        self._promoted: dict[bytes, tuple[str, int]] = {}          # key -> (trajectory, bytes)
        self._link_free: dict[tuple[TierKind, TierKind], float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ helpers

    def _on_event(self, event: BlockEvent) -> None:
        """Catalogue events (the manager's lock is held: only queue them)."""
        if event.kind == "removed" and event.tier == self._fast_name and event.key in self._promoted:
            self._removed.append(event.key)      # only promoted keys matter: bounded by them

    def _account_removed(self) -> None:
        """Promoted blocks that left tier 0 before their trajectory resumed are waste."""
        while self._removed:
            key = self._removed.popleft()
            rec = self._promoted.pop(key, None)
            if rec is not None:
                self.stats.wasted_bytes += rec[1]

    def _in_fast(self, key: bytes) -> bool:
        loc = self.manager.locate(key)
        return loc is not None and loc[1] == 0

    def _hint(self, keys: Sequence[bytes], t: float, now: float) -> None:
        self.manager.hint_next_use(keys, t, now)

    def _size_of(self, key: bytes) -> int:
        loc = self.manager.locate(key)
        return 0 if loc is None else loc[0]

    def _source_kind(self, key: bytes) -> TierKind | None:
        loc = self.manager.locate(key)
        return None if loc is None else self.manager.tier_kind(loc[1])

    def transfer_seconds(self, keys: Sequence[bytes], assume: TierKind | None = None) -> float:
        """Seconds to bring ``keys`` into tier 0 at the current hop bandwidths.

        ``assume``: plan for the worst plausible case, every block (even one in tier 0
        now, which may be demoted while it waits) one hop away in tier ``assume``, or
        where it is when that is slower (NVMe).
        """
        dst = self.manager.tier_kind(0)
        total = 0.0
        for key in keys:
            src = self._source_kind(key)
            if src is None:
                continue
            if assume is not None and src != TierKind.NVME:
                src = assume
            if src == dst:
                continue
            total += self._size_of(key) / self.bandwidth.get((src, dst), 1e9)
        return total

    # ------------------------------------------------------------------ requests

    def observe_request(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """A request for prefix ``keys`` arrived: feed the reuse model (call before the
        request's Get/Put reach the manager, e.g. from the Lookup handler).

        The same prefix seen again within ``dedupe_s`` seconds (every tensor-parallel
        rank looks it up) is counted once.
        """
        if not keys:
            return
        now = self.clock() if now is None else now
        sig = (keys[-1], len(keys))
        with self._lock:
            last = self._recent.get(sig)
            if last is not None and now - last < self.dedupe_s:
                return
            self._recent[sig] = now
            self._recent.move_to_end(sig)
            while len(self._recent) > 4096:
                self._recent.popitem(last=False)
            self.model.observe_request(keys, now)

    # ------------------------------------------------------------------ tool calls

    def tool_call_start(self, trajectory_id: str, tool: str, start_time: float | None,
                        keys: Sequence[bytes]) -> float:
        """Trajectory ``trajectory_id`` called ``tool`` at ``start_time`` (seconds; None
        or 0: now); ``keys`` is its stored prefix, in order. Returns the predicted resume
        time (seconds, same clock): the median of the tool's learned duration."""
        now = self.clock()
        start = start_time if start_time else now
        if not math.isfinite(start):
            raise ValueError(f"tool call start time {start!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            self.stats.tool_calls += 1
            self._active.pop(trajectory_id, None)
            self._expired.pop(trajectory_id, None)
            old = self._waiting.pop(trajectory_id, None)
            if old is not None:
                self._release(old)
            median = start + self.predictor.predict(tool, 0.5)
            ready_by = start + self.predictor.predict(tool, self.config.quantile) - self.config.lead_time_s
            keys = list(keys)
            self._seq += 1
            w = _Waiting(trajectory_id, tool, start, keys, median, ready_by, ready_by, seq=self._seq)
            w.promote_at = ready_by - self.transfer_seconds(keys, assume=TierKind.HOST)
            w.expires_at = start + min(self.config.max_wait_s, self.config.expire_factor * (median - start))
            self._waiting[trajectory_id] = w
            heapq.heappush(self._expiry, (w.expires_at, w.seq, trajectory_id))
            while len(self._waiting) > self.config.max_waiting:
                self._expire(now, force=True)
            self._compact()
            if self.enabled:
                heapq.heappush(self._due, (w.promote_at, w.seq, trajectory_id, _PROMOTE))
                heapq.heappush(self._due, (max(median, now) + self.refresh_s, w.seq, trajectory_id, _REFRESH))
                self._hint(keys, median, now)
            return median

    def resume(self, trajectory_id: str, time: float | None = None) -> tuple[bool, float]:
        """Trajectory ``trajectory_id`` resumed at ``time`` (seconds; None or 0: now).

        Returns ``(known, observed_seconds)``: whether a tool call was open for it, and
        that call's measured duration (0.0 when unknown). Updates the predictor and
        the readiness / waste / error statistics.
        """
        now = time if time else self.clock()
        if not math.isfinite(now):
            raise ValueError(f"resume time {now!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            w = self._waiting.pop(trajectory_id, None)
            if w is None:
                late = self._expired.pop(trajectory_id, None)
                if late is None:
                    self.stats.resumes_unknown += 1
                    return False, 0.0
                observed = max(now - late[1], 0.0)     # expired while waiting: still learn from it
                self.predictor.observe(late[0], observed)
                self.stats.resumes_expired += 1
                return True, observed
            observed = max(now - w.start, 0.0)
            self.predictor.observe(w.tool, observed)
            st = self.stats
            st.resumes += 1
            err = w.predicted_resume - now
            st.add_error(abs(err), abs(err) / observed if observed > 0 else 0.0)
            if self.is_ready(w.keys, now, w):
                st.resumes_ready += 1
            self._release(w, used=True)
            self._active[trajectory_id] = (now, w.keys)
            while len(self._active) > self.config.max_waiting:
                del self._active[next(iter(self._active))]
            return True, observed

    def _expire(self, now: float, force: bool = False) -> None:
        """Drop the waiting trajectories whose time is up (lock held); with ``force``, the
        one due to expire first, whatever the time (the table is over its bound)."""
        heap = self._expiry
        while heap and (force or heap[0][0] <= now):
            _, seq, tid = heapq.heappop(heap)
            w = self._waiting.get(tid)
            if w is None or w.seq != seq:
                continue
            del self._waiting[tid]
            self._release(w)
            self.stats.expired += 1
            self._expired[tid] = (w.tool, w.start)
            while len(self._expired) > self.config.max_waiting:
                self._expired.popitem(last=False)
            log.debug("trajectory %s expired after waiting %.1f s for tool %s", tid, now - w.start, w.tool)
            force = False

    def _compact(self) -> None:
        """Rebuild the heaps when entries of resumed or expired trajectories (dropped
        lazily) outnumber the live ones, so their size stays O(waiting trajectories)."""
        live = 2 * len(self._waiting) + 64
        if len(self._due) > 4 * live:
            self._due = [e for e in self._due if (w := self._waiting.get(e[2])) is not None and w.seq == e[1]]
            heapq.heapify(self._due)
        if len(self._expiry) > 2 * live:
            self._expiry = [e for e in self._expiry if (w := self._waiting.get(e[2])) is not None and w.seq == e[1]]
            heapq.heapify(self._expiry)

    def is_ready(self, keys: Sequence[bytes], now: float, w: _Waiting | None = None) -> bool:
        """Whether all of ``keys`` are in tier 0 and any promotion of them has finished."""
        self._account_removed()
        return all(self._in_fast(k) for k in keys) and (w is None or w.done_at <= now)

    def _release(self, w: _Waiting, used: bool = False) -> None:
        """Account the promoted blocks of ``w``: used if still in HBM, else wasted."""
        self._account_removed()
        for key in w.keys:
            rec = self._promoted.get(key)
            if rec is None or rec[0] != w.trajectory_id:
                continue
            del self._promoted[key]
            if used and self._in_fast(key):
                self.stats.used_bytes += rec[1]
            else:
                self.stats.wasted_bytes += rec[1]

    def finish(self) -> PrefetchStats:
        """End of a simulation: promotions whose trajectory never resumed are waste."""
        with self._lock:
            for w in list(self._waiting.values()):
                self._release(w)
            for key, (_, nbytes) in list(self._promoted.items()):
                self.stats.wasted_bytes += nbytes
            self._promoted.clear()
            return self.stats

    # ------------------------------------------------------------------ timed work

    def next_due(self) -> float:
        """Earliest time (seconds) at which :meth:`tick` has work; ``inf`` if none."""
        with self._lock:
            while self._due:
                t, seq, tid, action = self._due[0]
                w = self._waiting.get(tid)
                if w is None or w.seq != seq or (action == _PROMOTE and w.promoted):
                    heapq.heappop(self._due)
                    continue
                return t
            return math.inf

    def tick(self, now: float | None = None) -> None:
        """Do the work due at ``now`` (seconds): expiry of trajectories waiting too long
        (also when only observing), promotions whose start time has come, renewed hints
        (and re-promotions) for trajectories waiting past their predicted resume, and
        demotions when tier 0's free space is below the headroom."""
        now = self.clock() if now is None else now
        with self._lock:
            self._expire(now)
            active = self._active                 # oldest resume first
            while active:
                tid, (t, _) = next(iter(active.items()))
                if now - t <= self.active_protect_s:
                    break
                del active[tid]
            if not self.enabled:
                return
            self._expect_cache = {}
            while self._due and self._due[0][0] <= now:
                _, seq, tid, action = heapq.heappop(self._due)
                w = self._waiting.get(tid)
                if w is None or w.seq != seq:
                    continue
                if action == _PROMOTE:
                    if not w.promoted:
                        self._promote(w, now)
                    continue
                # waiting past the predicted resume: renew the hint, re-promote what left
                if w.started:   # promoted for it: keep them near until it resumes
                    remaining = self.predictor.predict_remaining(w.tool, now - w.start, self.config.quantile)
                    self._hint(w.keys, now + min(remaining, 2 * self.refresh_s), now)
                else:
                    self._hint(w.keys, self._expect(w, now), now)
                if w.promoted and not all(self._in_fast(k) for k in w.keys):
                    self._promote(w, now)
                heapq.heappush(self._due, (now + self.refresh_s, seq, tid, _REFRESH))
            if self.headroom_fraction > 0:
                self._keep_headroom(now)

    def _expect(self, w: _Waiting, now: float) -> float:
        """Expected resume time of ``w`` (seconds): the median of the tool's duration
        given the time already waited. Cached per tick."""
        t = self._expect_cache.get(w.trajectory_id)
        if t is None:
            elapsed = now - w.start
            t = now + self.predictor.predict_remaining(w.tool, elapsed, 0.5) if elapsed > 0 else w.predicted_resume
            self._expect_cache[w.trajectory_id] = t
        return t

    def _protected(self, w: _Waiting, now: float, include_self: bool = True) -> Callable[[bytes], bool]:
        """Keys that moving blocks for ``w`` must not evict: running trajectories', those
        already promoted, and those of trajectories expected to resume no later than
        ``w`` (``w``'s own unless ``include_self`` is false)."""
        keep: set[bytes] = set()
        for _, keys in self._active.values():
            keep.update(keys)
        mine = self._expect(w, now)
        for other in self._waiting.values():
            if other is w:
                if include_self:
                    keep.update(other.keys)
            elif self._expect(other, now) <= mine:
                keep.update(other.keys)
        keep.update(self._promoted)          # promoted and not used yet: no ping-pong
        return keep.__contains__

    def _make_room(self, w: _Waiting, nbytes: int, now: float, protected: Callable[[bytes], bool]) -> bool:
        """Room for ``nbytes`` in tier 0 for ``w`` (the manager demotes; no lock taken here).

        Candidates first: blocks of trajectories expected to resume later than ``w`` (by
        a margin) that were not promoted yet, farthest first, tail first; then the tier
        policy's choice among unprotected blocks, unless it predicts that block is needed
        sooner than ``w`` (``next_use``)."""
        m = self.manager
        if m.fits(0, nbytes):
            return True
        mine = self._expect(w, now)
        later = sorted((o for o in self._waiting.values()
                        if o is not w and not o.promoted and self._expect(o, now) > mine + self.margin_s),
                       key=lambda o: self._expect(o, now), reverse=True)
        candidates = [key for o in later for key in reversed(o.keys)]
        need_in = max(mine - now, 0.0)

        def sooner(victim: bytes) -> bool:
            d = m.distance(0, victim, now)
            return d is not None and d < need_in
        before = m.counters[f"evictions_{self._fast_name}"]
        ok = m.make_room(0, nbytes, protect=protected, candidates=candidates, give_up=sooner)
        self.stats.demoted_blocks += m.counters[f"evictions_{self._fast_name}"] - before
        self._account_removed()
        return ok

    def _promote(self, w: _Waiting, now: float) -> None:
        """Bring ``w``'s blocks into tier 0, head first; retry later if room ran out."""
        w.promoted = w.started = True
        dst = self.manager.tier_kind(0)
        done = max(now, w.done_at)
        blocked = False
        protected = self._protected(w, now)
        for key in w.keys:                # head first: a partial promotion still hits
            src = self._source_kind(key)
            if src is None or src == dst:
                continue
            nbytes = self._size_of(key)
            if not self._make_room(w, nbytes, now, protected):
                blocked = True
                break
            t0 = time.perf_counter()
            if not self.manager.promote(key, 0):
                blocked = True
                break
            elapsed = time.perf_counter() - t0
            hop = (src, dst)
            bw = self.bandwidth.get(hop, 1e9)
            if self.measure_bandwidth and elapsed > 0:
                self.bandwidth[hop] = bw = 0.8 * bw + 0.2 * (nbytes / elapsed)
            start = max(now, self._link_free.get(hop, now))
            finish = start + nbytes / bw
            self._link_free[hop] = finish
            done = max(done, finish)
            old = self._promoted.get(key)
            if old is not None:            # promoted before and evicted since
                self.stats.wasted_bytes += old[1]
            self._promoted[key] = (w.trajectory_id, nbytes)
            self.stats.promoted_blocks += 1
            self.stats.promoted_bytes += nbytes
        w.done_at = done
        self._hint(w.keys, max(w.ready_by, now), now)   # due: keep them (next_use)
        if blocked:
            self.stats.promotions_blocked += 1
            w.promoted = False
            heapq.heappush(self._due, (now + self.retry_s, w.seq, w.trajectory_id, _PROMOTE))

    def _keep_headroom(self, now: float) -> None:
        m = self.manager
        if m.num_tiers < 2:
            return
        cap = m.capacity_bytes(0)
        want = self.headroom_fraction * cap
        free = cap - m.used_bytes(0)
        if free >= want:
            return
        later = sorted((w for w in self._waiting.values() if not w.promoted and w.promote_at > now),
                       key=lambda w: self._expect(w, now), reverse=True)
        for w in later:
            protected = self._protected(w, now, include_self=False)
            before = m.counters[f"evictions_{self._fast_name}"]
            m.make_room(0, int(want), protect=protected, candidates=list(reversed(w.keys)),
                        give_up=lambda victim: True)
            self.stats.demoted_blocks += m.counters[f"evictions_{self._fast_name}"] - before
            if cap - m.used_bytes(0) >= want:
                return

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        """Run :meth:`tick` on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.tick()
                except Exception:  # keep prefetching alive; the error is logged loudly
                    log.exception("prefetch tick failed")
                wait = min(self.poll_s, max(self.next_due() - self.clock(), 0.0))
                self._stop.wait(wait if wait > 0 else 0.001)

        self._thread = threading.Thread(target=loop, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (waits for the current tick)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
