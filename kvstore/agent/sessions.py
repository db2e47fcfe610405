"""Session hints: what an agent framework knows about a session's future, fed to eviction.

A worker, or the agent framework behind it, may say per session (an agent trajectory
or a conversation) after a request:

- **continues**: the session will send another request, expected back in about
  ``expected_back_s`` seconds and/or within ``ttl_s`` seconds (a retention TTL, as
  vLLM's ``cache_control.ttl``);
- **finished**: it is done; its blocks will not be used again;
- **abandoned**: it was dropped (a user left, an agent branch was cut); same effect.

:class:`SessionTable` turns these into eviction hints for every tier's policy:

- a continuing session's *private* blocks (used by no other session) get its
  expected-back time as their next use (``set_next_use``, one hint group per session,
  evicted tail first, so a partly evicted prefix keeps its head); policies without
  next-use support (LRU, ARC, S3-FIFO) ignore this;
- a finished or abandoned session's private blocks are *let go*: the first victims
  of every policy, refused by a full tier (:meth:`EvictionPolicy.let_go`), but only
  those that nothing else used since the session named them
  (:class:`kvstore.agent.block_owners.BlockOwners`: every use of a block is counted, a
  session explains one per request it made); a block used more often is shared with
  traffic the table does not see (a system prompt read by plain requests, another
  client) and keeps its place, and a block let go that somebody else uses later is
  revived by the policies;
- blocks a second session also uses (system prompts, shared documents) get no session
  hint: the learned reuse model (``next_use``) or the policy's own order decides;
- a new prefix that drops some of the session's earlier private blocks (context
  compaction, an edited history) lets those blocks go;
- a TTL that runs out without the session returning drops its hint (the blocks go back
  to the policy's own order; they are not let go).

Without ``expected_back_s`` the expected gap is learned: the median of the gaps observed
between a session's "continues" and its next hint (sliding window), capped by the TTL.
Tool calls (:mod:`kvstore.agent.prefetch`) refine the time through :meth:`SessionTable.expect`.
Hints are optional: without any, nothing here runs.

Hints never hurt more than ignoring them: each source's hints are checked against the
returns the table observes (:class:`kvstore.agent.hint_trust.HintTrust`: a continuing
session that does not come back, a finished one that does, an ``expected_back_s`` far
off). A source whose states keep turning out wrong is ignored (its hints are recorded
and judged, but move nothing), and a hinted gap moves the expected gap away from the
learned median only as far as the source's past errors warrant.

Everything is plain Python with explicit times (seconds), for the daemon (wall clock)
and ``kvstore simulate`` (virtual clock). Thread-safe: one lock per table; it never takes
the tier manager's lock (the policies guard their own state).
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict, deque
from typing import Sequence

import numpy as np

from kvstore.agent.block_owners import BlockOwners
from kvstore.agent.hint_model import HintCalibration
from kvstore.agent.hint_trust import HintTrust
from kvstore.agent.session_hint import MAX_SOURCE_CHARS, SessionHint, SessionState, source_of
from kvstore.agent.session_records import Ended, Pending, Session, SessionStats
from kvstore.policy import AcceptsNextUse, CalibratesHints, EvictionPolicy

__all__ = ["MAX_SOURCE_CHARS", "SessionHint", "SessionState", "SessionStats", "SessionTable", "source_of"]


class SessionTable:
    """Session hints -> next-use hints and blocks let go for ``policies``.

    Hinted times are scaled by the session's learned correction and their outcomes feed
    a :class:`~kvstore.agent.hint_model.HintCalibration` that ``next_use`` policies use for
    distances (set on them here).

    Args:
        policies: every tier's eviction policy (fastest first).
        calibration: the hint calibration (default: a new one); None-like behaviour
            (fixed overdue rule, no correction) with ``calibrate=False``.
        calibrate: learn from hint outcomes and correct per session.
        trust: per-source trust (default: a new :class:`HintTrust`); with
            ``trusting=False`` every hint is believed as given.
        default_gap_s: expected gap before any was observed (seconds).
        window: observed gaps kept for the learned median.
        max_sessions: sessions remembered; the least recently hinted are forgotten
            (their hints dropped, nothing let go).
        max_keys: keys whose owner is remembered (to tell private from shared), and keys
            the sessions' records hold in all (past it the least recently hinted are
            forgotten, as past ``max_sessions``).
        own_request_s: see :class:`~kvstore.agent.block_owners.BlockOwners` (seconds).
    """

    def __init__(self, policies: Sequence[EvictionPolicy], *, calibration: HintCalibration | None = None,
                 calibrate: bool = True, trust: HintTrust | None = None, trusting: bool = True,
                 default_gap_s: float = 60.0, window: int = 256, max_sessions: int = 100_000,
                 max_keys: int = 4_000_000, own_request_s: float = 5.0):
        self.policies = list(policies)
        self._next_use = [p for p in self.policies if isinstance(p, AcceptsNextUse)]
        self.calibration = (calibration or HintCalibration()) if calibrate else None
        for p in self.policies:
            if isinstance(p, CalibratesHints):
                p.use_calibration(self.calibration)
        self.trust = (trust or HintTrust()) if trusting else None
        self.owners = BlockOwners(self.policies, max_keys, own_request_s)
        self.uses = self.owners.uses
        self.default_gap_s = default_gap_s
        self.max_sessions = max_sessions
        self.max_keys = max_keys
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._gaps: deque[float] = deque(maxlen=window)
        self._deadlines: list[tuple[float, str]] = []
        self._checks: list[tuple[float, str, float]] = []     # (when, sid, hint time): judge a hint
        self._held = 0                  # keys held by the sessions' and the ended sessions' records
        self.stats = SessionStats()
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def expected_gap(self) -> float:
        """The learned median gap between a "continues" and the session's return (seconds)."""
        return float(np.median(self._gaps)) if self._gaps else self.default_gap_s

    def private_keys(self, session_id: str) -> list[bytes]:
        """The session's keys no other session uses, in prefix order."""
        with self._lock:
            s = self._sessions.get(session_id)
            return [] if s is None else self.owners.private(session_id, s.keys)

    # ------------------------------------------------------------------ hints

    def apply(self, hint: SessionHint, now: float) -> float:
        """Apply one hint at ``now`` (seconds). Returns the session's expected-back time
        (absolute seconds; ``inf`` for finished / abandoned)."""
        with self._lock:
            t = now if hint.time is None else hint.time
            sid, source = hint.session_id, source_of(hint)
            self.stats.hints += 1
            self._came_back(sid, t)
            old = self._sessions.get(sid)
            if old is not None and not old.back and hint.state != SessionState.ABANDONED:   # it came back
                self._returned(old, t)
            keys = hint.keys or (old.keys if old is not None else ())
            self.owners.name(sid, hint.dropped + keys)       # the deepest block: keys[-1]
            believed = self.trust is None or self.trust.believed(source)
            self.stats.ignored += not believed
            if hint.state != SessionState.CONTINUES:
                self._end(sid, hint.state, keys, t, source, believed)
                return math.inf
            self.stats.continues += 1
            median = self.expected_gap()
            raw = hint.expected_back_s
            gap = median if raw is None or not believed else raw
            cal = self.calibration
            if raw is not None and believed:
                w = 1.0
                if self.trust is not None:     # the hinted time counts as far as it has skill
                    w = self.trust.time_weight(source)
                    gap = self.trust.expected_gap(source, raw, median)
                if cal is not None and w > 0:
                    gap *= cal.correction(sid) ** w
            if hint.ttl_s is not None:
                gap = min(gap, hint.ttl_s)
            deadline = t + hint.ttl_s if hint.ttl_s is not None else math.inf
            s = Session(sid, SessionState.CONTINUES, keys, t, t + gap, deadline,
                         cal.hinted(t, gap) if cal is not None and believed else None, raw,
                         believed=believed, pending=Pending(source, t, raw, median))
            self._store(s, old, now, hint.dropped)
            if deadline < math.inf:
                self._push(self._deadlines, (deadline, sid))
            if self.trust is not None:
                self._push(self._checks, (t + self.trust.check_after(gap), sid, t))
            return s.expected

    def expect(self, session_id: str, keys: Sequence[bytes], expected_at: float, now: float,
               hinted_at: float | None = None, calibrate: bool = False, exact: bool = False) -> None:
        """Refine a session's expected-back time (a tool call's prediction): the session
        continues with prefix ``keys`` (empty: as before) and is expected at
        ``expected_at`` (absolute seconds), as predicted at ``hinted_at`` (default: the
        session's last hint, or now). Does not count as the session's return; with
        ``calibrate`` (a tool call: a request of the session) the prediction's outcome
        is learned (call :meth:`returned`); ``exact``: the time is a commitment
        (paged-back blocks to keep until used)."""
        with self._lock:
            old = self._sessions.get(session_id)
            keys = tuple(keys) or (old.keys if old is not None else ())
            deadline = old.deadline if old is not None else math.inf
            t = old.hinted_at if (old is not None and hinted_at is None) else (now if hinted_at is None else hinted_at)
            outcome = old.outcome if old is not None else None
            if calibrate:
                self._came_back(session_id, now)
                self.owners.name(session_id, keys)
            if calibrate and self.calibration is not None:
                outcome = self.calibration.hinted(t, expected_at - t)
            believed = calibrate or old is None or old.believed      # a renewal keeps the hint's standing
            s = Session(session_id, SessionState.CONTINUES, keys, t, expected_at, deadline, outcome,
                         old.raw_gap if old is not None else None, exact, believed,
                         old.pending if old is not None else None)
            self._store(s, old, now)

    def returned(self, session_id: str, t: float) -> None:
        """The session's next request arrived at ``t`` (a tool call's resume): learn from
        the hint's outcome and drop it (the blocks are in use; the policy's own order
        takes over until the next hint, which is then not counted as a second return)."""
        with self._lock:
            self._came_back(session_id, t)
            s = self._sessions.get(session_id)
            if s is not None and not s.back:
                self._returned(s, t)
                s.back = True
                self.owners.clear_hints(self.owners.private(session_id, s.keys), t)

    def _returned(self, s: Session, t: float) -> None:
        self._gaps.append(max(t - s.hinted_at, 0.0))
        self.stats.returns += 1
        if self.calibration is not None and s.outcome is not None:
            self.calibration.returned(s.outcome, s.sid, t, s.raw_gap)
            s.outcome = None
        p, s.pending = s.pending, None
        if p is not None and self.trust is not None:
            self.trust.state_outcome(p.source, True)
            if p.raw_gap is not None:
                self.trust.time_outcome(p.source, t - p.hinted_at, p.raw_gap, p.median)

    def _came_back(self, sid: str, t: float) -> None:
        """A session said to be finished or abandoned is back: that hint was wrong."""
        e = self._pop_ended(sid)
        if e is not None and self.trust is not None and t - e.time <= self.trust.horizon_s:
            self._wrong(e.source, t)

    def tick(self, now: float) -> None:
        """Drop the hints of sessions whose TTL ran out, and judge the hints whose time
        to be proven wrong has passed (seconds)."""
        with self._lock:
            dl = self._deadlines
            while dl and dl[0][0] <= now:
                deadline, sid = heapq.heappop(dl)
                s = self._sessions.get(sid)
                if s is None or s.deadline != deadline or s.state != SessionState.CONTINUES:
                    continue
                self.stats.lapsed += 1
                self._forget(sid, now)
            checks = self._checks
            while checks and checks[0][0] <= now:
                when, sid, t0 = heapq.heappop(checks)
                e = self._ended.get(sid)
                if e is not None and e.time == t0:
                    back = self.owners.used_again(e.keys, e.allowed)     # its blocks were wanted
                    if back or when >= t0 + self.trust.horizon_s:        # else: looked at again later
                        self._pop_ended(sid)
                        if back:
                            self._wrong(e.source, now)
                        else:
                            self.trust.state_outcome(e.source, True)
                    continue
                s = self._sessions.get(sid)
                if s is not None and s.pending is not None and s.pending.hinted_at == t0:
                    source, s.pending = s.pending.source, None
                    if self.owners.came_back(sid, t0):                 # it read its prefix again
                        self.trust.state_outcome(source, True)
                    else:                                               # it did not come back
                        self._wrong(source, now)

    # ------------------------------------------------------------------ internals

    def _wrong(self, source: str, now: float) -> None:
        """A hint of ``source`` turned out wrong. When that makes the source not trusted,
        what its recent hints did is undone: the blocks its ended sessions let go are
        revived, the hints of its continuing sessions cleared."""
        trust = self.trust
        was = trust.believed(source)
        trust.state_outcome(source, False)
        if not was or trust.believed(source):
            return
        for e in self._ended.values():
            if e.source == source and e.keys:
                for p in self.policies:
                    p.revive(e.keys)
        for s in self._sessions.values():
            if s.believed and s.pending is not None and s.pending.source == source:
                s.believed = False
                self.owners.clear_hints(self.owners.private(s.sid, s.keys), now)

    def _store(self, s: Session, old: Session | None, now: float, cut: Sequence[bytes] = ()) -> None:
        """Store ``s`` in place of ``old``; the private blocks ``old`` had and ``s`` has
        not, and those of ``cut`` (its context dropped them), are let go."""
        owners = self.owners
        private = owners.claim(s.sid, s.keys, now)
        cut = owners.claim(s.sid, cut, now) if cut else []
        if (old is not None and old.keys != s.keys) or cut:
            now_keys = set(s.keys)
            dropped = [k for k in owners.private(s.sid, old.keys) if k not in now_keys] if old is not None else []
            seen = now_keys.union(dropped)
            dropped += [k for k in cut if k not in seen]
            if dropped and s.believed:
                go, _, kept = owners.let_go(s.sid, dropped, now)
                self.stats.released_blocks += len(go)
                self.stats.kept_used += kept
        self._pop_session(s.sid)
        self._sessions[s.sid] = s
        self._held += len(s.keys)
        for p in self.policies:
            p.revive(private)
        if s.believed:
            for p in self._next_use:
                p.set_next_use(private, s.expected, now, since=s.hinted_at, exact=s.exact)
        else:
            owners.clear_hints(private, now)
        self._bound(now)

    def _end(self, sid: str, state: SessionState, keys: Sequence[bytes], now: float, source: str,
             believed: bool) -> None:
        if state == SessionState.FINISHED:
            self.stats.finished += 1
        else:
            self.stats.abandoned += 1
        owners = self.owners
        private = owners.claim(sid, keys, now)
        old = self._pop_session(sid)
        if old is not None:
            seen = set(private)
            private += [k for k in owners.private(sid, old.keys) if k not in seen]
        go, allowed, kept = owners.let_go(sid, private, now, apply=believed)
        if believed:
            self.stats.released_blocks += len(go)
            self.stats.kept_used += kept
        else:
            owners.clear_hints(private, now)
        owners.end(sid, private)
        trust = self.trust
        if trust is not None:
            self._pop_ended(sid)
            self._ended[sid] = Ended(source, now, go, allowed)
            self._held += len(go)
            self._bound(now)
            for after in trust.end_checks():
                self._push(self._checks, (now + after, sid, now))

    def _forget(self, sid: str, now: float) -> None:
        """Forget a session without letting its blocks go: its hints are dropped."""
        s = self._pop_session(sid)
        self.owners.forget(sid)
        if s is not None:
            self.owners.clear_hints(self.owners.private(sid, s.keys), now)

    # ------------------------------------------------------------------ bounds

    def _pop_session(self, sid: str) -> Session | None:
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._held -= len(s.keys)
        return s

    def _pop_ended(self, sid: str) -> Ended | None:
        e = self._ended.pop(sid, None)
        if e is not None:
            self._held -= len(e.keys)
        return e

    def _bound(self, now: float) -> None:
        """At most ``max_sessions`` sessions and as many ended ones, holding at most
        ``max_keys`` keys in all: the oldest ended sessions are forgotten first (they are
        only watched for a return), then the least recently hinted sessions (never the
        last one)."""
        ended, sessions = self._ended, self._sessions
        while ended and (len(ended) > self.max_sessions or self._held > self.max_keys):
            self._pop_ended(next(iter(ended)))
        while len(sessions) > 1 and (len(sessions) > self.max_sessions or self._held > self.max_keys):
            self._forget(next(iter(sessions)), now)

    def _push(self, heap: list, entry: tuple) -> None:
        """Push a deadline or a check; rebuild the heap without the entries of replaced
        hints (skipped lazily when due) once they outnumber the live ones, so its size
        stays O(sessions) however often one session is hinted."""
        heapq.heappush(heap, entry)
        if len(heap) > 4 * (len(self._sessions) + len(self._ended)) + 1024:
            live = self._live_deadline if heap is self._deadlines else self._live_check
            heap[:] = [e for e in heap if live(e)]
            heapq.heapify(heap)

    def _live_deadline(self, entry: tuple[float, str]) -> bool:
        s = self._sessions.get(entry[1])
        return s is not None and s.deadline == entry[0] and s.state == SessionState.CONTINUES

    def _live_check(self, entry: tuple[float, str, float]) -> bool:
        _, sid, t0 = entry
        e, s = self._ended.get(sid), self._sessions.get(sid)
        return ((e is not None and e.time == t0)
                or (s is not None and s.pending is not None and s.pending.hinted_at == t0))
