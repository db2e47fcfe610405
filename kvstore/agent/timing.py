"""When the prefetch scheduler acts: the due queue, expected resume times, its thread.

- :class:`Timeline` owns the due queue of a
  :class:`~kvstore.agent.prefetch.PrefetchScheduler`: one heap of ``(time, seq,
  trajectory, action)`` entries, :data:`PAGE_BACK` (a wait's page back is due) or
  :data:`REFRESH` (a wait past its predicted resume: renew its hint, page back what
  left). Entries of closed waits are dropped lazily and compacted when they outnumber the
  live ones (at most 4 x (2 x waiting + 64) entries). It also gives a waiting
  trajectory's expected resume time (the median of its remaining wait given the time it
  already waited, from :class:`~kvstore.agent.tool_durations.WaitDurations`; cached for
  one scheduler pass) and whether a due page back is likely enough to be used soon.
- :class:`Ticker` is the background thread (``kvstore-prefetch``) that runs the
  scheduler's passes.

Every time is on the scheduler's clock (seconds; ``time.monotonic`` in the daemon,
virtual in the simulator). Not thread-safe on its own: the scheduler's lock is held
around every :class:`Timeline` call.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from typing import Callable, Iterator

from kvstore.agent.tool_durations import WaitDurations
from kvstore.agent.waiting import Wait, WaitTable

log = logging.getLogger("kvstore.agent.prefetch")

PAGE_BACK, REFRESH = 0, 1
"""The due queue's actions."""


class Timeline:
    """The due queue and the resume-time estimates of the waiting trajectories.

    Args:
        durations: the learned wait durations.
        refresh_s: a wait's first :data:`REFRESH` is due this many seconds after its
            predicted resume (or after it was scheduled, if later).
        confidence: a due page back runs only when the trajectory resumes within
            ``horizon_s`` seconds with at least this probability (0: always).
        horizon_s: see ``confidence`` (seconds).
    """

    def __init__(self, durations: WaitDurations, *, refresh_s: float, confidence: float, horizon_s: float):
        self.durations = durations
        self.refresh_s = refresh_s
        self.confidence = confidence
        self.horizon_s = horizon_s
        self._due: list[tuple[float, int, str, int]] = []   # (time, seq, trajectory, action)
        self._expected: dict[str, float] = {}                # trajectory -> expected resume, this pass

    def __len__(self) -> int:
        """Entries in the due queue (live and stale)."""
        return len(self._due)

    # ------------------------------------------------------------------ the due queue

    def schedule(self, w: Wait, now: float) -> None:
        """Queue a new wait's page back (at ``w.page_back_at``) and its first refresh."""
        heapq.heappush(self._due, (w.page_back_at, w.seq, w.trajectory_id, PAGE_BACK))
        heapq.heappush(self._due, (max(w.predicted_resume, now) + self.refresh_s, w.seq, w.trajectory_id, REFRESH))

    def push(self, at: float, w: Wait, action: int) -> None:
        """Queue ``action`` for ``w`` at ``at`` (seconds)."""
        heapq.heappush(self._due, (at, w.seq, w.trajectory_id, action))

    def _live(self, waits: WaitTable, seq: int, tid: str, action: int) -> Wait | None:
        w = waits.current(tid, seq)
        if w is None or (action == PAGE_BACK and w.paged_back):
            return None
        return w

    def next_due(self, waits: WaitTable) -> float:
        """Earliest time (seconds) at which an entry of an open wait is due; ``inf`` if none."""
        while self._due:
            t, seq, tid, action = self._due[0]
            if self._live(waits, seq, tid, action) is None:
                heapq.heappop(self._due)
                continue
            return t
        return math.inf

    def due(self, now: float, waits: WaitTable) -> Iterator[tuple[Wait, int]]:
        """Pop and yield ``(wait, action)`` for every live entry due at ``now`` (seconds),
        earliest first, including entries pushed while iterating that are due by then."""
        while self._due and self._due[0][0] <= now:
            _, seq, tid, action = heapq.heappop(self._due)
            w = self._live(waits, seq, tid, action)
            if w is not None:
                yield w, action

    def compact(self, waits: WaitTable) -> None:
        """Rebuild the heap when entries of closed waits outnumber the live ones."""
        if len(self._due) > 4 * (2 * len(waits) + 64):
            self._due = [e for e in self._due if waits.current(e[2], e[1]) is not None]
            heapq.heapify(self._due)

    # ------------------------------------------------------------------ estimates

    def new_pass(self) -> None:
        """A scheduler pass begins: expected resume times are computed afresh."""
        self._expected = {}

    def expect(self, w: Wait, now: float) -> float:
        """Expected resume time of ``w`` (seconds): the median of the wait given the time
        already waited. Cached for the pass."""
        t = self._expected.get(w.trajectory_id)
        if t is None:
            if now <= w.predicted_resume or now <= w.start:
                t = w.predicted_resume
            else:
                t = now + self.durations.remaining(w.tool, now - w.start, w.predicted_resume - w.start, 0.5)
            self._expected[w.trajectory_id] = t
        return t

    def confident(self, w: Wait, now: float) -> bool:
        """Whether ``w`` resumes within ``horizon_s`` with probability >= ``confidence``
        (a conservative estimate: few observations beyond the time waited count against)."""
        if self.confidence <= 0:
            return True
        p = self.durations.prob_within(w.tool, now - w.start, w.predicted_resume - w.start, self.horizon_s)
        return p >= self.confidence


class Ticker:
    """The ``kvstore-prefetch`` daemon thread: runs a pass, then sleeps until the next due
    time, at most ``poll_s`` seconds, or until :meth:`wake`."""

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()

    def wake(self) -> None:
        """Run the next pass now rather than after the sleep (any thread; never blocks)."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, tick: Callable[[], None], next_due: Callable[[], float], clock: Callable[[], float]) -> None:
        """Call ``tick()`` until :meth:`stop`; ``next_due()`` and ``clock()`` (seconds) say
        how long to sleep. A pass that raises is logged and the thread goes on."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    tick()
                except Exception:  # keep prefetching alive; the error is logged loudly
                    log.exception("prefetch tick failed")
                wait = min(self.poll_s, max(next_due() - clock(), 0.0))
                self._wake.wait(wait if wait > 0 else 0.001)
                self._wake.clear()

        self._thread = threading.Thread(target=loop, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits for the current pass)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
