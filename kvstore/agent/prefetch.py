"""Tool-call- and session-timed prefetch: page a waiting trajectory's prefix back before it resumes.

A worker tells the daemon (gRPC ``ToolCallStart``) that trajectory T called tool X at
time t and that its prefix is keys K; later (``Resume``) that T came back. Or, with a
session hint (:mod:`kvstore.agent.sessions`), that session T continues and is expected back
in about g seconds, or that it finished. The :class:`PrefetchScheduler`:

1. predicts the resume time from X's learned duration distribution
   (:class:`kvstore.policy.tool_durations.ToolPredictor`) and returns the median; for a session
   hint, from the hinted gap scaled by the learned ratio of observed to hinted gaps;
2. tells the eviction policies when K will be needed, through the
   :class:`~kvstore.agent.sessions.SessionTable` (so ``next_use`` evicts blocks needed later
   first, and a finished session's blocks go first under every policy);
3. schedules T's promotion back to HBM to *finish* ``lead_time_s`` before the
   ``quantile``-quantile of the predicted duration (a low quantile: ready for most
   resumes), starting early enough for the transfer at each hop's bandwidth (measured
   on the daemon, configured in the simulator; transfers on one hop queue behind each
   other); while T waits past its median, renews the hints and re-promotes what left;
4. optionally (``headroom_fraction``, off by default) demotes the blocks of the
   trajectories expected last to keep free space in HBM.

Promotion never evicts a pinned block, a block of a running trajectory, a block it
promoted that has not been used yet, or a block of a trajectory expected to resume no
later than T (expected: the median of the duration given the time already waited):
victims are first blocks of trajectories expected later (farthest first, tail first),
then the tier policy's choice among unprotected blocks (``next_use``'s only if that
block is predicted to be needed later than T); if none is left the promotion stops
and is retried shortly. Every call into the tier manager goes through
:class:`kvstore.agent.store_port.ManagerPort`.

The scheduler also measures what it is for (:class:`~kvstore.agent.stats.PrefetchStats`):
readiness at each resume (whole prefix, and token-weighted), the bytes it promoted that
were evicted before use (waste), and the error of its resume-time predictions. With
``enabled = false`` it only observes (requests, predictions, hints, readiness) and
moves nothing.

**Bounded state.** A trajectory that never resumes expires, and every table has a bound;
the expiry, the due queue and the background thread are
:class:`~kvstore.agent.timing.TimingMixin` (its module says how).

The daemon calls :meth:`PrefetchScheduler.tool_call_start` / :meth:`resume` /
:meth:`session_hint` from its gRPC handlers, :meth:`observe_request` from Lookup (it
feeds the ``next_use`` policy's :class:`~kvstore.policy.reuse_model.ReuseModel`), and runs
:meth:`start` (a background thread calling :meth:`tick`). ``kvstore simulate`` calls
the same methods with virtual time.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tiers.base import TierKind

from kvstore.config.node import PrefetchConfig
from kvstore.policy import UsesReuseModel
from kvstore.policy.reuse_model import ReuseModel
from kvstore.agent.tool_durations import ToolPredictor
from kvstore.agent.promoter import _PROMOTE, _REFRESH, PromotionMixin
from kvstore.agent.store_port import ManagerPort
from kvstore.agent.stats import PrefetchStats
from kvstore.agent.timing import SESSION_TOOL, TimingMixin
from kvstore.agent.sessions import SessionHint, SessionState, SessionTable

DEFAULT_HOP_BANDWIDTH: dict[tuple[TierKind, TierKind], float] = {
    (TierKind.HOST, TierKind.HBM): 64e9,   # PCIe Gen5 x16
    (TierKind.NVME, TierKind.HBM): 1.5e9,  # NVMe read (fio O_DIRECT, measured on our machines)
    (TierKind.NVME, TierKind.HOST): 1.5e9,
    (TierKind.HBM, TierKind.HOST): 64e9,
    (TierKind.HOST, TierKind.NVME): 4e9,
    (TierKind.REMOTE, TierKind.HOST): 0.8e9,   # Mooncake over loopback TCP (docs/remote_tier.md)
    (TierKind.REMOTE, TierKind.HBM): 0.8e9,
}
"""Bytes per second per (source, destination) hop, before any measurement."""

__all__ = ["PrefetchScheduler", "PrefetchStats", "DEFAULT_HOP_BANDWIDTH", "SESSION_TOOL"]


@dataclass
class _Waiting:
    trajectory_id: str
    tool: str                        # SESSION_TOOL for a session hint
    start: float
    keys: list[bytes]
    predicted_resume: float          # median (returned to the worker)
    ready_by: float                  # quantile time minus lead: HBM must hold keys by then
    promote_at: float
    promoted_at: float = math.inf    # when the (first) promotion ran
    promoted: bool = False           # promotion done (or in flight); False: due / retry
    started: bool = False            # some promotion for this wait has begun
    done_at: float = 0.0             # when the last transfer of the promotion finishes
    seq: int = 0
    paged_in: bool = False           # blocks only in the cluster were asked for
    expires_at: float = math.inf     # dropped from the waiting table then, resumed or not


class PrefetchScheduler(PromotionMixin, TimingMixin):
    """Tool-call and session hints -> resume predictions, eviction hints and timed promotion.

    Args:
        manager: the tier manager (tier 0 is HBM, or the fastest tier present).
        prefetch_config: ``[prefetch]`` section: ``enabled``, ``predictor``
            (``quantile`` | ``lognormal``), ``lead_time_s`` (seconds the promotion should
            finish before the need), ``quantile`` (of the predicted duration at which the
            blocks must be back, e.g. 0.1), ``window`` (observations per tool).
        clock: time source in seconds (``time.monotonic`` in the daemon, virtual in the
            simulator); every time passed in is on this clock.
        hop_bandwidth: bytes/s per (source kind, destination kind); defaults
            :data:`DEFAULT_HOP_BANDWIDTH`. Replaced by measurements when
            ``measure_bandwidth`` is on.
        measure_bandwidth: time each promotion with ``time.perf_counter`` and keep an
            exponentially weighted average per hop (daemon; off in the simulator).
        headroom_fraction: free share of tier 0 kept by demoting the blocks of the waiting
            trajectories expected last (0: off; see docs/placement.md).
        active_protect_s: seconds after a resume during which the trajectory's prefix is
            treated as in use (never evicted by a promotion).
        reuse_model: the learned reuse model fed by :meth:`observe_request`; attached to
            every policy that uses one.
        sessions: the session table the hints go through (default: a new one over the
            manager's policies).
        poll_s: the background thread's longest sleep (seconds).
        refresh_s: once a trajectory waits past its predicted (median) resume, every
            ``refresh_s`` seconds its next-use hint is renewed and blocks evicted
            meanwhile are promoted again.
        retry_s: a promotion that found no room is retried after this many seconds.
        margin_s: a promotion displaces another waiting trajectory's blocks only when
            that one is expected to resume at least this many seconds later.
        dedupe_s: :meth:`observe_request` counts a prefix seen again within this many
            seconds once (every TP rank looks the prefix up; the simulator passes 0).
        victim_margin: with a policy that predicts distances (``next_use``), a promotion
            evicts a block only when that block's predicted next use is at least this
            many times farther than the promoted prefix's.
        repromote: while a trajectory waits past its predicted resume, promote again the
            blocks of it that were evicted meanwhile.
        protect_s: promoted blocks are hinted as needed now (kept, ``next_use``) for up
            to this many seconds after their promotion, renewed every ``refresh_s``;
            then the tool's prediction applies again (0: not protected).
        confidence: a due promotion runs only when the trajectory resumes within
            ``horizon_s`` seconds with at least this probability (from the tool's
            duration given the time already waited); else it is checked again every
            ``refresh_s``. For heavy-tailed tools this holds back promotions that would
            wait in HBM long (0: promote when due).
        horizon_s: see ``confidence`` (seconds).
    """

    def __init__(self, manager, prefetch_config: PrefetchConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 hop_bandwidth: Mapping[tuple[TierKind, TierKind], float] | None = None,
                 measure_bandwidth: bool = True, headroom_fraction: float = 0.0,
                 active_protect_s: float = 30.0, reuse_model: ReuseModel | None = None,
                 sessions: SessionTable | None = None,
                 poll_s: float = 0.05, refresh_s: float = 2.0, retry_s: float = 0.5,
                 margin_s: float = 1.0, dedupe_s: float = 0.5, victim_margin: float = 2.0,
                 repromote: bool = False, protect_s: float = 30.0, confidence: float = 0.7,
                 horizon_s: float = 30.0):
        cfg = prefetch_config or PrefetchConfig()
        self.port = ManagerPort(manager)
        self.config = cfg
        self.enabled = cfg.enabled
        self.clock = clock
        self.predictor = ToolPredictor(cfg.predictor, cfg.window)
        self.session_ratios = ToolPredictor(cfg.predictor, cfg.window, default_s=1.0)
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
        self.victim_margin = victim_margin
        self.repromote = repromote
        self.protect_s = protect_s
        self.confidence = confidence
        self.horizon_s = horizon_s
        self._recent: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self._expect_cache: dict[str, float] = {}
        self.model = reuse_model or ReuseModel()
        for p in self.port.policies():
            if isinstance(p, UsesReuseModel):
                p.attach(self.model)
        self.sessions = sessions or SessionTable(self.port.policies())
        self.stats = PrefetchStats()
        self._lock = threading.RLock()
        self._waiting: dict[str, _Waiting] = {}
        self._due: list[tuple[float, int, str, int]] = []   # (time, seq, trajectory, action)
        self._seq = 0
        self._active: dict[str, tuple[float, list[bytes]]] = {}   # resumed: (time, keys), oldest first
        self._expiry: list[tuple[float, int, str]] = []            # (expires_at, seq, trajectory)
        self._expired: OrderedDict[str, tuple[str, float, float]] = OrderedDict()   # id -> (tool, start, median)
        self._promoted: dict[bytes, tuple[str, int, float]] = {}   # key -> (trajectory, bytes, ready at)
        self._link_free: dict[tuple[TierKind, TierKind], float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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

    # ------------------------------------------------------------------ hints

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
            median = start + self.predictor.predict(tool, 0.5)
            ready_by = start + self.predictor.predict(tool, self.config.quantile) - self.config.lead_time_s
            self._wait(trajectory_id, tool, start, list(keys), median, ready_by, now)
            return median

    def session_hint(self, hint: SessionHint) -> float:
        """Apply a session hint (:class:`~kvstore.agent.sessions.SessionHint`). A hint for a
        session that was waiting counts as its resume. Returns the expected-back time
        (seconds, same clock; ``inf`` for a finished or abandoned session)."""
        now = self.clock()
        t = hint.time if hint.time is not None else now
        if not math.isfinite(t):
            raise ValueError(f"session hint time {t!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            self.stats.session_hints += 1
            if hint.session_id in self._waiting and hint.state != SessionState.ABANDONED:
                self._resume(hint.session_id, t)
            if hint.state != SessionState.CONTINUES:
                old = self._waiting.pop(hint.session_id, None)
                if old is not None:
                    self._release(old)
                self._active.pop(hint.session_id, None)
                return self.sessions.apply(hint, t)
            self._active.pop(hint.session_id, None)
            expected = self.sessions.apply(hint, t)
            s = self.sessions.get(hint.session_id)
            keys = list(s.keys) if s is not None else list(hint.keys)
            gap = max(expected - t, 0.0)
            ratio = self.session_ratios.predict(SESSION_TOOL, self.config.quantile) if self._session_ratios() else 1.0
            ready_by = t + gap * ratio - self.config.lead_time_s
            self._wait(hint.session_id, SESSION_TOOL, t, keys, expected, ready_by, now, hint_sessions=False)
            return expected

    def _wait(self, tid: str, tool: str, start: float, keys: list[bytes], median: float,
              ready_by: float, now: float, hint_sessions: bool = True) -> None:
        self._active.pop(tid, None)
        self._expired.pop(tid, None)
        old = self._waiting.pop(tid, None)
        if old is not None:
            self._release(old)
        self._seq += 1
        w = _Waiting(tid, tool, start, keys, median, ready_by, ready_by, seq=self._seq)
        w.promote_at = ready_by - self.transfer_seconds(keys, assume=TierKind.HOST)
        w.expires_at = start + min(self.config.max_wait_s, self.config.expire_factor * max(median - start, 0.0))
        self._waiting[tid] = w
        heapq.heappush(self._expiry, (w.expires_at, w.seq, tid))
        while len(self._waiting) > self.config.max_waiting:
            self._expire(now, force=True)
        self._compact()
        if hint_sessions:
            self.sessions.expect(tid, keys, median, now, hinted_at=start, calibrate=True)
        if self.enabled:
            heapq.heappush(self._due, (w.promote_at, w.seq, tid, _PROMOTE))
            heapq.heappush(self._due, (max(median, now) + self.refresh_s, w.seq, tid, _REFRESH))

    def resume(self, trajectory_id: str, time: float | None = None) -> tuple[bool, float]:
        """Trajectory ``trajectory_id`` resumed at ``time`` (seconds; None or 0: now).

        Returns ``(known, observed_seconds)``: whether a tool call or session hint was
        open for it, and its measured duration (0.0 when unknown). Updates the
        predictor and the readiness / waste / error statistics.
        """
        now = time if time else self.clock()
        if not math.isfinite(now):
            raise ValueError(f"resume time {now!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            return self._resume(trajectory_id, now)

    def _learn(self, tool: str, start: float, median: float, observed: float) -> None:
        """Teach the predictor one observed wait (seconds)."""
        if tool == SESSION_TOOL:
            hinted = median - start
            if hinted > 0 and observed > 0:
                self.session_ratios.observe(SESSION_TOOL, observed / hinted)
        else:
            self.predictor.observe(tool, observed)

    def _resume(self, trajectory_id: str, now: float) -> tuple[bool, float]:
        w = self._waiting.pop(trajectory_id, None)
        if w is None:
            late = self._expired.pop(trajectory_id, None)
            if late is None:
                self.stats.resumes_unknown += 1
                return False, 0.0
            observed = max(now - late[1], 0.0)     # expired while waiting: still learn from it
            self._learn(late[0], late[1], late[2], observed)
            self.stats.resumes_expired += 1
            return True, observed
        observed = max(now - w.start, 0.0)
        self._learn(w.tool, w.start, w.predicted_resume, observed)
        if w.tool != SESSION_TOOL:
            self.sessions.returned(trajectory_id, now)
        st = self.stats
        st.resumes += 1
        err = w.predicted_resume - now
        st.add_error(abs(err), abs(err) / observed if observed > 0 else 0.0)
        ready = self.ready_prefix(w.keys, now)
        st.resume_blocks += len(w.keys)
        st.ready_blocks += ready
        if ready == len(w.keys):
            st.resumes_ready += 1
        self._release(w, used=True)
        self._active[trajectory_id] = (now, w.keys)
        while len(self._active) > self.config.max_waiting:
            del self._active[next(iter(self._active))]
        return True, observed

    def ready_prefix(self, keys: Sequence[bytes], now: float) -> int:
        """Blocks of the longest prefix of ``keys`` in tier 0 whose promotion finished."""
        n = 0
        for key in keys:
            rec = self._promoted.get(key)
            if not self.port.in_fast(key) or (rec is not None and rec[2] > now):
                break
            n += 1
        return n

    def is_ready(self, keys: Sequence[bytes], now: float) -> bool:
        """Whether all of ``keys`` are in tier 0 and any promotion of them has finished."""
        return self.ready_prefix(keys, now) == len(keys)

    def _release(self, w: _Waiting, used: bool = False) -> None:
        """Account the promoted blocks of ``w``: used if still in HBM, else wasted."""
        for key in w.keys:
            rec = self._promoted.get(key)
            if rec is None or rec[0] != w.trajectory_id:
                continue
            del self._promoted[key]
            if used and self.port.in_fast(key):
                self.stats.used_bytes += rec[1]
            else:
                self.stats.waste_of(rec[1], "evicted before the resume" if used else "never resumed")

    def finish(self) -> PrefetchStats:
        """End of a simulation: promotions whose trajectory never resumed are waste."""
        with self._lock:
            for w in list(self._waiting.values()):
                self._release(w)
            for key, rec in list(self._promoted.items()):
                self.stats.waste_of(rec[1], "never resumed")
            self._promoted.clear()
            return self.stats
