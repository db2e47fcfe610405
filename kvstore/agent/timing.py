"""When the prefetch scheduler acts: expiry, the due queue, resume-time estimates, its thread.

:class:`TimingMixin` is mixed into :class:`kvstore.agent.prefetch.PrefetchScheduler`. It owns
the timed half of the scheduler: :meth:`~TimingMixin.tick` (the work due now: expiry,
session TTLs, due promotions and renewed hints, headroom), :meth:`~TimingMixin.next_due`,
the expiry of trajectories waiting too long and the compaction of the heaps, the
estimates of when a waiting trajectory resumes (given the time it already waited, from
the tool's or the session ratios' learned distribution) and the background thread
(``kvstore-prefetch``). It uses the scheduler's state (``_lock``, ``_waiting``,
``_due``, ``_expiry``, ``_expired``, ``_active``, ``_expect_cache``, ``predictor``,
``session_ratios``, ``sessions``, ``stats``, ``config``, options) and its ``_release``;
promotions go through :class:`~kvstore.agent.promoter.PromotionMixin`.

**Bounded state.** A trajectory that never resumes *expires* ``expire_factor`` times
its predicted (median) wait after its call started, at most ``max_wait_s`` later: it
leaves the waiting table, nothing is promoted for it again, and a late Resume still
teaches the predictor (the last ``max_waiting`` expired calls are remembered by tool and
start time only). At most ``max_waiting`` trajectories wait (past it the one due to
expire first expires now) and at most ``max_waiting`` recently resumed ones are
protected; the due-time heaps are compacted when stale entries outnumber live ones;
error statistics keep running sums and a fixed-size reservoir
(:data:`kvstore.agent.stats.RESERVOIR`). Every time is on the scheduler's clock
(``time.monotonic`` in the daemon: stepping the wall clock moves nothing).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from typing import TYPE_CHECKING

from kvstore.agent.promoter import _PROMOTE, _REFRESH

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.agent.prefetch import _Waiting

log = logging.getLogger("kvstore.agent.prefetch")

SESSION_TOOL = "(session hint)"
"""The ``tool`` of a wait that a session hint started; its duration is learned as the ratio
observed gap / hinted gap, in a predictor of its own (``session_ratios``)."""


class TimingMixin:
    """The timed work of the prefetch scheduler (see the module docstring)."""

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
            self._expired[tid] = (w.tool, w.start, w.predicted_resume)
            while len(self._expired) > self.config.max_waiting:
                self._expired.popitem(last=False)
            log.debug("trajectory %s expired after waiting %.1f s for %s", tid, now - w.start, w.tool)
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
        """Do the work due at ``now`` (seconds): expiry of trajectories waiting too long and
        TTLs of session hints (also when only observing), promotions whose
        start time has come, renewed hints (and re-promotions) for trajectories waiting
        past their predicted resume, and demotions when tier 0's free space is below
        the headroom."""
        now = self.clock() if now is None else now
        with self._lock:
            self._expire(now)
            self.sessions.tick(now)
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
                    if w.promoted:
                        continue
                    if self._confident(w, now):
                        self._promote(w, now)
                    else:
                        heapq.heappush(self._due, (now + self.refresh_s, seq, tid, _PROMOTE))
                    continue
                # waiting past the predicted resume: renew the hint, re-promote what left
                if w.started and now - w.promoted_at < self.protect_s:   # keep them until it resumes
                    self._protect(w, now)
                else:
                    self.sessions.expect(tid, w.keys, self._expect(w, now), now, hinted_at=now)
                if self.repromote and w.promoted and not all(self.port.in_fast(k) for k in w.keys):
                    self._promote(w, now)
                heapq.heappush(self._due, (now + self.refresh_s, seq, tid, _REFRESH))
            if self.headroom_fraction > 0:
                self._keep_headroom(now)

    def _session_ratios(self) -> bool:
        return self.session_ratios.tools().get(SESSION_TOOL, 0) >= self.session_ratios.min_samples

    def _remaining(self, w: _Waiting, now: float, q: float) -> float:
        """The ``q``-quantile of the seconds ``w`` still waits, given the time waited."""
        elapsed = now - w.start
        if w.tool == SESSION_TOOL:   # in units of the hinted gap, from the learned ratios
            gap = max(w.predicted_resume - w.start, 1e-3)
            if self._session_ratios():
                return gap * self.session_ratios.predict_remaining(SESSION_TOOL, elapsed / gap, q)
            return max(gap - elapsed, min(elapsed * 0.5, 600.0), self.refresh_s)
        return self.predictor.predict_remaining(w.tool, elapsed, q)

    def _confident(self, w: _Waiting, now: float) -> bool:
        """Whether ``w`` resumes within ``horizon_s`` with probability >= ``confidence``
        (a conservative estimate: few observations beyond the time waited count against)."""
        if self.confidence <= 0:
            return True
        elapsed = now - w.start
        if w.tool == SESSION_TOOL:   # in units of the hinted gap
            gap = max(w.predicted_resume - w.start, 1e-3)
            p = self.session_ratios.prob_within(SESSION_TOOL, elapsed / gap, self.horizon_s / gap)
        else:
            p = self.predictor.prob_within(w.tool, elapsed, self.horizon_s)
        return p >= self.confidence

    def _expect(self, w: _Waiting, now: float) -> float:
        """Expected resume time of ``w`` (seconds): the median of the duration given the
        time already waited. Cached per tick."""
        t = self._expect_cache.get(w.trajectory_id)
        if t is None:
            if now <= w.predicted_resume or now <= w.start:
                t = w.predicted_resume
            else:
                t = now + self._remaining(w, now, 0.5)
            self._expect_cache[w.trajectory_id] = t
        return t

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
