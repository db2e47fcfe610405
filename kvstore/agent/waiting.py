"""The wait table: trajectories waiting on a tool call or a session's return, their expiry and bounds.

A :class:`Wait` is one trajectory (or session) that stopped to wait: since when, for which
tool, with which stored prefix, when it is predicted back. :class:`WaitTable` owns every
wait of a :class:`~kvstore.agent.prefetch.PrefetchScheduler`, the trajectories that
resumed lately (*running*: their prefix is in use), and the memory of waits that expired.

**Bounded state.** A trajectory that never resumes *expires* ``expire_factor`` times its
predicted (median) wait after its call started, but not before the
:data:`EXPIRE_TAIL_QUANTILE` quantile of its tool's observed waits (a heavy-tailed tool's
late returns are still waits: of the published agent gap shape's returns, 86.5% come
within 1 s and 95.1% within 10 s), at most ``max_wait_s`` later: it leaves
the table, nothing is paged back for it again, and a late resume still teaches the
predictor (the last ``max_waiting`` expired waits are remembered by tool, start and
prediction only). At most ``max_waiting`` trajectories wait (past it the one due to expire
first expires now) and at most ``max_waiting`` running ones are remembered, each for
``running_s`` seconds after its resume; together they hold at most ``max_keys`` block
keys (a wait names up to ``MAX_HINT_KEYS``); the expiry heap is compacted when stale
entries outnumber live ones. Every time is on the scheduler's clock (``time.monotonic`` in the
daemon: stepping the wall clock moves nothing).

Not thread-safe on its own: the scheduler's lock is held around every call.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

log = logging.getLogger("kvstore.agent.prefetch")

EXPIRE_TAIL_QUANTILE = 0.99
"""A wait never expires before this quantile of its tool's observed waits (see above)."""

DEFAULT_MAX_KEYS = 4_000_000
"""Keys the open waits and running trajectories hold in all, by default (about 260 MB)."""


@dataclass
class Wait:
    """One trajectory waiting to resume (times in seconds, the scheduler's clock).

    Attributes:
        trajectory_id: the trajectory (or session).
        tool: the tool it called (:data:`~kvstore.agent.tool_durations.SESSION_TOOL` for
            a session hint).
        start: when the wait began.
        keys: its stored prefix (32-byte keys, prefix order).
        predicted_resume: the median resume time (returned to the worker).
        ready_by: the fastest tier must hold ``keys`` by then (the quantile's time minus
            the lead time).
        page_back_at: when its page back is due (``ready_by`` minus the transfer time).
        paged_back_at: when its (first) page back ran (``inf``: not yet).
        paged_back: its page back is done (or in flight); False: due, or to retry.
        started: some page back for this wait has begun.
        done_at: when the last transfer of its page back finishes.
        seq: tells this wait from an earlier one of the same trajectory.
        paged_in: its blocks held only in the cluster were asked for.
        expires_at: when it leaves the table, resumed or not.
    """

    trajectory_id: str
    tool: str
    start: float
    keys: list[bytes]
    predicted_resume: float
    ready_by: float
    page_back_at: float
    paged_back_at: float = math.inf
    paged_back: bool = False
    started: bool = False
    done_at: float = 0.0
    seq: int = 0
    paged_in: bool = False
    expires_at: float = math.inf


class LateWait(NamedTuple):
    """What is remembered of an expired wait, to learn from a late resume (seconds)."""

    tool: str
    start: float
    predicted_resume: float


class WaitTable:
    """Every open wait, the running trajectories and the expired waits, each bounded.

    Args:
        max_waiting: bound of each table (``prefetch.max_waiting``).
        expire_factor: a wait expires this many times its predicted (median) wait after
            its start (``prefetch.expire_factor``) ...
        max_wait_s: ... and at most this many seconds after it (``prefetch.max_wait_s``).
        running_s: seconds a resumed trajectory counts as running (its prefix in use).
        max_keys: keys the open waits and the running trajectories hold in all (one hint
            names at most ``MAX_HINT_KEYS``); past it the wait due to expire first expires
            (never the only one) and the oldest running trajectory is forgotten.
    """

    def __init__(self, max_waiting: int, expire_factor: float, max_wait_s: float, running_s: float,
                 max_keys: int = DEFAULT_MAX_KEYS):
        self.max_waiting = max_waiting
        self.max_keys = max_keys
        self._held = 0                                             # keys of _waits and _running
        self.expire_factor = expire_factor
        self.max_wait_s = max_wait_s
        self.running_s = running_s
        self._waits: dict[str, Wait] = {}
        self._expiry: list[tuple[float, int, str]] = []            # (expires_at, seq, trajectory)
        self._late: OrderedDict[str, LateWait] = OrderedDict()     # expired, oldest first
        self._running: dict[str, tuple[float, list[bytes]]] = {}   # resumed: (time, keys), oldest first
        self._seq = 0

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._waits

    def __iter__(self) -> Iterator[str]:
        """The ids of the waiting trajectories."""
        return iter(self._waits)

    def get(self, trajectory_id: str) -> Wait | None:
        return self._waits.get(trajectory_id)

    def waits(self) -> list[Wait]:
        """The open waits, oldest first."""
        return list(self._waits.values())

    def current(self, trajectory_id: str, seq: int) -> Wait | None:
        """The open wait of ``trajectory_id`` if it is the one numbered ``seq``, else None."""
        w = self._waits.get(trajectory_id)
        return w if w is not None and w.seq == seq else None

    def running_keys(self) -> Iterator[list[bytes]]:
        """The prefixes of the trajectories that resumed within ``running_s``."""
        for _, keys in self._running.values():
            yield keys

    def sizes(self) -> dict[str, int]:
        """Entries per table: ``waiting``, ``expiry`` (heap), ``running``, ``expired``, and
        ``keys`` (held by the waiting and running ones)."""
        return {"waiting": len(self._waits), "expiry": len(self._expiry), "running": len(self._running),
                "expired": len(self._late), "keys": self._held}

    # ------------------------------------------------------------------ changes

    def open(self, trajectory_id: str, tool: str, start: float, keys: list[bytes], predicted_resume: float,
             ready_by: float, page_back_at: float) -> tuple[Wait, Wait | None]:
        """Open a wait (seconds); returns it and the open wait of the same trajectory it
        replaces (None if none). Its expiry is due ``expire_factor`` times its predicted wait
        after ``start``, at most ``max_wait_s`` (:meth:`expire` may put it off). The
        trajectory stops running; a memory of its expired wait is dropped. Call
        :meth:`over_bound` after."""
        self.stop_running(trajectory_id)
        self._late.pop(trajectory_id, None)
        old = self.pop(trajectory_id)
        self._seq += 1
        w = Wait(trajectory_id, tool, start, keys, predicted_resume, ready_by, page_back_at, seq=self._seq)
        w.expires_at = start + min(self.max_wait_s, self.expire_factor * max(predicted_resume - start, 0.0))
        self._waits[trajectory_id] = w
        self._held += len(keys)
        heapq.heappush(self._expiry, (w.expires_at, w.seq, trajectory_id))
        return w, old

    def over_bound(self) -> bool:
        """Whether more than ``max_waiting`` trajectories wait, or more than one holding
        more than ``max_keys`` keys with the running ones."""
        return len(self._waits) > self.max_waiting or (len(self._waits) > 1 and self._held > self.max_keys)

    def pop(self, trajectory_id: str) -> Wait | None:
        """Close the open wait of ``trajectory_id`` (resumed or ended) and return it."""
        w = self._waits.pop(trajectory_id, None)
        if w is not None:
            self._held -= len(w.keys)
        return w

    def pop_late(self, trajectory_id: str) -> LateWait | None:
        """Forget the expired wait of ``trajectory_id`` and return it (a late resume)."""
        return self._late.pop(trajectory_id, None)

    def expire(self, now: float, force: bool = False, tail_of: Callable[[Wait], float] | None = None) -> list[Wait]:
        """Close the waits whose time is up at ``now`` (seconds) and return them; with
        ``force``, the one due to expire first too, whatever the time (over the bound).
        ``tail_of(w)``: the :data:`EXPIRE_TAIL_QUANTILE` quantile (seconds) of ``w``'s tool
        as observed now; a wait whose time came is kept while it is within it, at most
        ``max_wait_s`` after its start."""
        heap = self._expiry
        out: list[Wait] = []
        while heap and (force or heap[0][0] <= now):
            _, seq, tid = heapq.heappop(heap)
            w = self.current(tid, seq)
            if w is None:
                continue
            tail = tail_of(w) if tail_of is not None and not force else 0.0
            if math.isfinite(tail) and tail > 0:
                later = w.start + min(self.max_wait_s, tail)
                if later > now and later > w.expires_at:
                    w.expires_at = later
                    heapq.heappush(heap, (later, seq, tid))
                    continue
            self.pop(tid)
            out.append(w)
            self._late[tid] = LateWait(w.tool, w.start, w.predicted_resume)
            while len(self._late) > self.max_waiting:
                self._late.popitem(last=False)
            log.debug("trajectory %s expired after waiting %.1f s for %s", tid, now - w.start, w.tool)
            force = False
        return out

    def compact(self) -> None:
        """Rebuild the expiry heap when entries of closed waits (dropped lazily) outnumber
        the live ones, so its size stays O(waiting trajectories)."""
        if len(self._expiry) > 2 * (2 * len(self._waits) + 64):
            self._expiry = [e for e in self._expiry if self.current(e[2], e[1]) is not None]
            heapq.heapify(self._expiry)

    def run(self, trajectory_id: str, now: float, keys: list[bytes]) -> None:
        """``trajectory_id`` resumed at ``now`` (seconds): its prefix ``keys`` is in use."""
        self.stop_running(trajectory_id)
        self._running[trajectory_id] = (now, keys)
        self._held += len(keys)
        running = self._running
        while len(running) > self.max_waiting or (len(running) > 1 and self._held > self.max_keys):
            self.stop_running(next(iter(running)))

    def stop_running(self, trajectory_id: str) -> None:
        """``trajectory_id`` no longer runs (it waits again, or its session ended)."""
        r = self._running.pop(trajectory_id, None)
        if r is not None:
            self._held -= len(r[1])

    def expire_running(self, now: float) -> None:
        """Forget the trajectories that resumed more than ``running_s`` before ``now``."""
        running = self._running                 # oldest resume first
        while running:
            tid, (t, _) = next(iter(running.items()))
            if now - t <= self.running_s:
                break
            self.stop_running(tid)
