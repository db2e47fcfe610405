"""Tool-call- and session-timed prefetch: page a waiting trajectory's prefix back before it resumes.

A worker tells the daemon (gRPC ``ToolCallStart``) that trajectory T called tool X at
time t and that its prefix is keys K; later (``Resume``) that T came back. Or, with a
session hint (:mod:`kvstore.agent.sessions`), that session T continues and is expected back
in about g seconds, or that it finished. The :class:`PrefetchScheduler`:

1. predicts the resume time from X's learned duration distribution and returns the
   median; for a session hint, from the hinted gap scaled by the learned ratio of
   observed to hinted gaps (both :class:`~kvstore.agent.tool_durations.WaitDurations`);
2. tells the eviction policies when K will be needed, through the
   :class:`~kvstore.agent.sessions.SessionTable` (so ``next_use`` evicts blocks needed later
   first, and a finished session's blocks go first under every policy);
3. schedules T's page back to HBM to *finish* ``lead_time_s`` before the
   ``quantile``-quantile of the predicted duration (a low quantile: ready for most
   resumes), starting early enough for the transfer at each hop's bandwidth (measured
   on the daemon, configured in the simulator; transfers on one hop queue behind each
   other); while T waits past its median, renews the hints and pages back again what left;
4. optionally (``headroom_fraction``, off by default) demotes the blocks of the
   trajectories expected last to keep free space in HBM.

It is a facade over collaborators that own their state, built here and passed to each
other through their constructors:

- :class:`~kvstore.agent.waiting.WaitTable` (``waits``): the waiting trajectories, the
  running ones, the expired ones; expiry and bounds;
- :class:`~kvstore.agent.timing.Timeline` (``timeline``): the due queue, expected resume
  times, confidence; :class:`~kvstore.agent.timing.Ticker` (``ticker``): the thread;
- :class:`~kvstore.agent.page_back.Pager` (``pager``): what moves for a waiting
  trajectory (through :class:`~kvstore.agent.store_port.ManagerPort`), bandwidths, what
  it paged back;
- :class:`~kvstore.agent.observations.RequestObserver` (``observer``): the lookups fed to
  the reuse model, queued while a pass holds the lock;
- :class:`~kvstore.agent.stats.PrefetchStats` (``stats``): readiness at each resume
  (whole prefix, and token-weighted), the bytes paged back that were evicted before use
  (waste), and the error of the resume-time predictions.

With ``enabled = false`` it only observes (requests, predictions, hints, readiness) and
moves nothing. The daemon calls :meth:`PrefetchScheduler.tool_call_start` / :meth:`resume`
/ :meth:`session_hint` from its gRPC handlers, :meth:`observe_request` from Lookup (it
feeds the ``next_use`` policy's :class:`~kvstore.policy.reuse_model.ReuseModel`), and runs
:meth:`start` (a background thread calling :meth:`tick`). ``kvstore simulate`` calls
the same methods with virtual time.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Mapping, Sequence

from kvstore.common.types import TierKind
from kvstore.config.node import PrefetchConfig
from kvstore.policy import UsesReuseModel
from kvstore.policy.reuse_model import ReuseModel
from kvstore.agent.observations import RequestObserver
from kvstore.agent.page_back import Pager
from kvstore.agent.sessions import SessionHint, SessionState, SessionTable
from kvstore.agent.stats import PrefetchStats
from kvstore.agent.store_port import ManagerPort
from kvstore.agent.timing import PAGE_BACK, REFRESH, Ticker, Timeline
from kvstore.agent.tool_durations import SESSION_TOOL, WaitDurations
from kvstore.agent.waiting import EXPIRE_TAIL_QUANTILE, Wait, WaitTable

__all__ = ["PrefetchScheduler"]


class PrefetchScheduler:
    """Tool-call and session hints -> resume predictions, eviction hints and timed page back.

    Args:
        manager: the tier manager (tier 0 is HBM, or the fastest tier present).
        prefetch_config: ``[prefetch]`` section: ``enabled``, ``predictor``
            (``quantile`` | ``lognormal``), ``lead_time_s`` (seconds the page back should
            finish before the need), ``quantile`` (of the predicted duration at which the
            blocks must be back, e.g. 0.1), ``window`` (observations per tool),
            ``expire_factor``, ``max_wait_s``, ``max_waiting`` (bounds: :mod:`kvstore.agent.waiting`).
        clock: time source in seconds (``time.monotonic`` in the daemon, virtual in the
            simulator); every time passed in is on this clock.
        hop_bandwidth: bytes/s per (source kind, destination kind); defaults
            :data:`kvstore.agent.page_back.DEFAULT_HOP_BANDWIDTH`. Replaced by
            measurements when ``measure_bandwidth`` is on.
        measure_bandwidth: time each promotion with ``time.perf_counter`` and keep an
            exponentially weighted average per hop (daemon; off in the simulator).
        headroom_fraction: free share of tier 0 kept by demoting the blocks of the waiting
            trajectories expected last (0: off; see docs/placement.md).
        active_protect_s: seconds after a resume during which the trajectory's prefix is
            treated as in use (never evicted by a page back).
        reuse_model: the learned reuse model fed by :meth:`observe_request`; attached to
            every policy that uses one.
        sessions: the session table the hints go through (default: a new one over the
            manager's policies).
        poll_s: the background thread's longest sleep (seconds).
        refresh_s: once a trajectory waits past its predicted (median) resume, every
            ``refresh_s`` seconds its next-use hint is renewed and blocks evicted
            meanwhile are paged back again.
        retry_s: a page back that found no room is retried after this many seconds.
        margin_s: a page back displaces another waiting trajectory's blocks only when
            that one is expected to resume at least this many seconds later.
        dedupe_s: :meth:`observe_request` counts a prefix seen again within this many
            seconds once (every TP rank looks the prefix up; the simulator passes 0).
        victim_margin: with a policy that predicts distances (``next_use``), a page back
            evicts a block only when that block's predicted next use is at least this
            many times farther than the paged-back prefix's.
        repromote: while a trajectory waits past its predicted resume, page back again
            the blocks of it that were evicted meanwhile.
        protect_s: paged-back blocks are hinted as needed now (kept, ``next_use``) for up
            to this many seconds after their page back, renewed every ``refresh_s``;
            then the tool's prediction applies again (0: not protected).
        confidence: a due page back runs only when the trajectory resumes within
            ``horizon_s`` seconds with at least this probability (from the tool's
            duration given the time already waited); else it is checked again every
            ``refresh_s``. For heavy-tailed tools this holds back page backs that would
            wait in HBM long (0: page back when due).
        horizon_s: see ``confidence`` (seconds).
        engines: what the engines still hold in their own caches
            (:class:`~kvstore.agent.engine_holdings.EngineHoldings`, ``[engines] kv_events``):
            a page back leaves those blocks out, and runs again for a waiting trajectory
            whose page back started once an engine drops some; with ``enabled``, their
            copies in the faster tiers are the first victims when a lower tier holds one
            (None: unknown, every block is paged back).
        exclusive_after_s: of those, only blocks predicted (``next_use``) to be used more
            than this many seconds from now and stored by the engine longer ago than that: a
            block needed sooner keeps its copy, since an engine under pressure may drop it
            just before that use, too late to page it back (0: every engine-held block).
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
                 horizon_s: float = 30.0, engines=None, exclusive_after_s: float = 2.0):
        cfg = prefetch_config or PrefetchConfig()
        self.port = ManagerPort(manager, engines)
        if cfg.enabled:
            self.port.evict_engine_held_first(exclusive_after_s, lambda: self.clock())
        self.config = cfg
        self.enabled = cfg.enabled
        self.clock = clock
        self.durations = WaitDurations(cfg.predictor, cfg.window, floor_s=refresh_s)
        self.predictor = self.durations.tools
        self.session_ratios = self.durations.session_ratios
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.dedupe_s = dedupe_s
        self.repromote = repromote
        self.protect_s = protect_s
        self.model = reuse_model or ReuseModel()
        for p in self.port.policies():
            if isinstance(p, UsesReuseModel):
                p.attach(self.model)
        self.sessions = sessions or SessionTable(self.port.policies())
        self.stats = PrefetchStats()
        self._lock = threading.RLock()
        self.observer = RequestObserver(self.model, self._lock, lambda: self.clock(), dedupe_s)
        self.waits = WaitTable(cfg.max_waiting, cfg.expire_factor, cfg.max_wait_s, running_s=active_protect_s)
        self.timeline = Timeline(self.durations, refresh_s=refresh_s, confidence=confidence, horizon_s=horizon_s)
        self.ticker = Ticker(poll_s)
        self.pager = Pager(self.port, self.waits, self.timeline, self.sessions, self.stats, self._lock,
                           hop_bandwidth=hop_bandwidth, measure_bandwidth=measure_bandwidth,
                           headroom_fraction=headroom_fraction, margin_s=margin_s, victim_margin=victim_margin,
                           protect_s=protect_s, refresh_s=refresh_s)
        self.bandwidth = self.pager.bandwidth
        if engines is not None and self.enabled:
            # a block a page back left to its engine is dropped: page it back now, not at the
            # next poll (a turn often resumes within tens of milliseconds of vLLM's drop)
            pager, ticker = self.pager, self.ticker
            engines.on_removed = lambda hashes: pager.watches(hashes) and ticker.wake()

    # ------------------------------------------------------------------ requests

    def observe_request(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """A request for prefix ``keys`` arrived: feed the reuse model (call before the
        request's Get/Put reach the manager, e.g. from the Lookup handler). Without ``now``
        it never waits for a pass that is paging blocks back
        (:class:`~kvstore.agent.observations.RequestObserver`); a prefix seen again within
        ``dedupe_s`` seconds (every tensor-parallel rank looks it up) counts once."""
        self.observer.observe(keys, now)

    # ------------------------------------------------------------------ hints

    def tool_call_start(self, trajectory_id: str, tool: str, start_time: float | None,
                        keys: Sequence[bytes]) -> float:
        """Trajectory ``trajectory_id`` called ``tool`` at ``start_time`` (seconds; None
        or 0: now); ``keys`` is its stored prefix, in order. Returns the predicted resume
        time (seconds, same clock): the median of the tool's learned duration.
        Raises ValueError for a start time that is not finite."""
        now = self.clock()
        start = start_time if start_time else now
        if not math.isfinite(start):
            raise ValueError(f"tool call start time {start!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            self.stats.tool_calls += 1
            median = start + self.durations.tool_quantile(tool, 0.5)
            ready_by = start + self.durations.tool_quantile(tool, self.config.quantile) - self.config.lead_time_s
            self._wait(trajectory_id, tool, start, list(keys), median, ready_by, now)
            return median

    def session_hint(self, hint: SessionHint) -> float:
        """Apply a session hint (:class:`~kvstore.agent.sessions.SessionHint`). A hint for a
        session that was waiting counts as its resume. Returns the expected-back time
        (seconds, same clock; ``inf`` for a finished or abandoned session).
        Raises ValueError for a hint time that is not finite."""
        now = self.clock()
        t = hint.time if hint.time is not None else now
        if not math.isfinite(t):
            raise ValueError(f"session hint time {t!r} is not a finite number of seconds")
        sid = hint.session_id
        with self._lock:
            self._expire(now)
            self.stats.session_hints += 1
            if sid in self.waits and hint.state != SessionState.ABANDONED:
                self._resume(sid, t)
            if hint.state != SessionState.CONTINUES:
                old = self.waits.pop(sid)
                if old is not None:
                    self.pager.settle(old)
                self.waits.stop_running(sid)
                return self.sessions.apply(hint, t)
            self.waits.stop_running(sid)
            expected = self.sessions.apply(hint, t)
            s = self.sessions.get(sid)
            keys = list(s.keys) if s is not None else list(hint.keys)
            gap = max(expected - t, 0.0)
            ready_by = t + gap * self.durations.gap_scale(self.config.quantile) - self.config.lead_time_s
            self._wait(sid, SESSION_TOOL, t, keys, expected, ready_by, now, hint_sessions=False)
            return expected

    def _wait(self, tid: str, tool: str, start: float, keys: list[bytes], median: float,
              ready_by: float, now: float, hint_sessions: bool = True) -> None:
        """Open ``tid``'s wait (lock held), within the table's bound, and schedule it."""
        page_back_at = ready_by - self.pager.transfer_seconds(keys, assume=TierKind.HOST)
        w, old = self.waits.open(tid, tool, start, keys, median, ready_by, page_back_at)
        if old is not None:
            self.pager.settle(old)
        while self.waits.over_bound():
            self._expire(now, force=True)
        self.timeline.compact(self.waits)
        self.waits.compact()
        if hint_sessions:
            self.sessions.expect(tid, keys, median, now, hinted_at=start, calibrate=True)
        if self.enabled:
            self.timeline.schedule(w, now)

    def resume(self, trajectory_id: str, time: float | None = None) -> tuple[bool, float]:
        """Trajectory ``trajectory_id`` resumed at ``time`` (seconds; None or 0: now).

        Returns ``(known, observed_seconds)``: whether a tool call or session hint was
        open for it, and its measured duration (0.0 when unknown). Updates the
        predictor and the readiness / waste / error statistics. Raises ValueError for a
        time that is not finite.
        """
        now = time if time else self.clock()
        if not math.isfinite(now):
            raise ValueError(f"resume time {now!r} is not a finite number of seconds")
        with self._lock:
            self._expire(now)
            w = self.waits.get(trajectory_id)
            known, observed = self._resume(trajectory_id, now)
            if w is not None and w.tool == SESSION_TOOL:    # a session's wait: its return is now, not
                self.sessions.returned(trajectory_id, now)  # at its next hint (after the request ran)
            return known, observed

    def _resume(self, trajectory_id: str, now: float) -> tuple[bool, float]:
        w = self.waits.pop(trajectory_id)
        if w is None:
            late = self.waits.pop_late(trajectory_id)
            if late is None:
                self.stats.resumes_unknown += 1
                return False, 0.0
            observed = max(now - late.start, 0.0)     # expired while waiting: still learn from it
            self.durations.learn(late.tool, late.start, late.predicted_resume, observed)
            self.stats.resumes_expired += 1
            return True, observed
        observed = max(now - w.start, 0.0)
        self.durations.learn(w.tool, w.start, w.predicted_resume, observed)
        if w.tool != SESSION_TOOL:
            self.sessions.returned(trajectory_id, now)
        self.stats.resumed(w.predicted_resume, now, observed, len(w.keys), self.pager.ready_prefix(w.keys, now))
        self.pager.settle(w, used=True)
        self.waits.run(trajectory_id, now, w.keys)
        return True, observed

    def _tail(self, tool: str, start: float, median: float) -> float:
        """The :data:`~kvstore.agent.waiting.EXPIRE_TAIL_QUANTILE` quantile of a wait of
        ``tool`` (seconds): of the tool's observed waits, or of a session's hinted gap
        (``median - start``) times its learned ratios."""
        if tool == SESSION_TOOL:
            return max(median - start, 0.0) * self.durations.gap_scale(EXPIRE_TAIL_QUANTILE)
        return self.durations.tool_quantile(tool, EXPIRE_TAIL_QUANTILE)

    def _expire(self, now: float, force: bool = False) -> None:
        """Close the waits whose time is up (lock held; ``force``: see :meth:`WaitTable.expire`)."""
        for w in self.waits.expire(now, force, tail_of=lambda w: self._tail(w.tool, w.start, w.predicted_resume)):
            self.pager.settle(w)
            self.stats.expired += 1

    # ------------------------------------------------------------------ readiness

    def ready_prefix(self, keys: Sequence[bytes], now: float) -> int:
        """Blocks of the longest prefix of ``keys`` in tier 0 whose page back finished."""
        return self.pager.ready_prefix(keys, now)

    def is_ready(self, keys: Sequence[bytes], now: float) -> bool:
        """Whether all of ``keys`` are in tier 0 and any page back of them has finished."""
        return self.ready_prefix(keys, now) == len(keys)

    def finish(self) -> PrefetchStats:
        """End of a simulation: page backs whose trajectory never resumed are waste."""
        with self._lock:
            self.pager.settle_all(self.waits.waits())
            return self.stats

    # ------------------------------------------------------------------ timed work

    def next_due(self) -> float:
        """Earliest time (seconds) at which :meth:`tick` has work; ``inf`` if none."""
        with self._lock:
            return self.timeline.next_due(self.waits)

    def tick(self, now: float | None = None) -> None:
        """Do the work due at ``now`` (seconds): expiry of trajectories waiting too long and
        TTLs of session hints (also when only observing), page backs whose start time has
        come, renewed hints (and page backs again) for trajectories waiting past their
        predicted resume, and demotions when tier 0's free space is below the headroom."""
        now = self.clock() if now is None else now
        with self._lock:
            self.observer.drain()
            self._expire(now)
            self.sessions.tick(now)
            self.waits.expire_running(now)
            if not self.enabled:
                return
            self.timeline.new_pass()
            self._engines_dropped(now)
            for w, action in self.timeline.due(now, self.waits):
                if action == PAGE_BACK:
                    if self.timeline.confident(w, now):
                        self._page_back(w, now)
                    else:
                        self.timeline.push(now + self.refresh_s, w, PAGE_BACK)
                else:
                    self._refresh(w, now)
            self.pager.keep_headroom(now)
            self.observer.drain()

    def _engines_dropped(self, now: float) -> None:
        """Page back again the waiting trajectories whose page back left out blocks that
        an engine has dropped since (lock held)."""
        for tid in self.pager.dropped_by_engines():
            w = self.waits.get(tid)
            if w is not None and w.started:
                self.stats.engine_drop_page_backs += 1
                self._page_back(w, now)

    def _page_back(self, w: Wait, now: float) -> None:
        if not self.pager.page_back(w, now):
            self.timeline.push(now + self.retry_s, w, PAGE_BACK)

    def _refresh(self, w: Wait, now: float) -> None:
        """``w`` waits past its predicted resume: renew its hint, page back what left."""
        if w.started and now - w.paged_back_at < self.protect_s:   # keep them until it resumes
            self.pager.protect(w, now)
        else:
            self.sessions.expect(w.trajectory_id, w.keys, self.timeline.expect(w, now), now, hinted_at=now)
        if self.repromote and w.paged_back and not all(self.port.in_fast(k) for k in w.keys):
            self._page_back(w, now)
        self.timeline.push(now + self.refresh_s, w, REFRESH)

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        """Run :meth:`tick` on a daemon thread (``kvstore-prefetch``) until :meth:`stop`."""
        # looked up at every pass, so a wrapped tick (tests) or a replaced clock is used
        self.ticker.start(lambda: self.tick(), lambda: self.next_due(), lambda: self.clock())

    def stop(self) -> None:
        """Stop the background thread (waits for the current tick)."""
        self.ticker.stop()
