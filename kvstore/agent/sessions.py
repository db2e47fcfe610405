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
  of every policy, refused by a full tier (:meth:`EvictionPolicy.let_go`);
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

Everything is plain Python with explicit times (seconds), for the daemon (wall clock)
and ``kvstore simulate`` (virtual clock). Thread-safe: one lock per table; it never takes
the tier manager's lock (the policies guard their own state).
"""

from __future__ import annotations

import enum
import heapq
import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvstore.common.errors import InvalidRequest
from kvstore.agent.hint_model import HintCalibration
from kvstore.policy import AcceptsNextUse, CalibratesHints, EvictionPolicy

_SHARED = object()     # owner marker of a key used by two or more sessions


class SessionState(str, enum.Enum):
    """What a session hint says about the session's future."""

    CONTINUES = "continues"
    FINISHED = "finished"
    ABANDONED = "abandoned"


@dataclass(frozen=True)
class SessionHint:
    """One hint about one session.

    Attributes:
        session_id: the session (trajectory, conversation); non-empty.
        state: :class:`SessionState`.
        keys: the session's stored prefix blocks in prefix order (32-byte keys); empty:
            the keys of its previous hint.
        expected_back_s: seconds from ``time`` until its next request (continues only;
            None: unknown, learned).
        ttl_s: keep its blocks near for at most this many seconds (continues only;
            None: no limit).
        time: when the hint applies (seconds, the table's clock; None: now).
    Raises:
        InvalidRequest: empty id, negative or non-finite times, bad keys.
    """

    session_id: str
    state: SessionState
    keys: tuple[bytes, ...] = ()
    expected_back_s: float | None = None
    ttl_s: float | None = None
    time: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise InvalidRequest("session hint: session_id must be a non-empty string")
        try:
            object.__setattr__(self, "state", SessionState(self.state))
        except ValueError:
            raise InvalidRequest(f"session hint: state must be one of "
                                 f"{[s.value for s in SessionState]}, got {self.state!r}") from None
        for name in ("expected_back_s", "ttl_s", "time"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise InvalidRequest(f"session hint: {name} must be a finite number >= 0, got {v!r}")
        keys = tuple(self.keys)
        if any(not isinstance(k, (bytes, bytearray)) or len(k) != 32 for k in keys):
            raise InvalidRequest("session hint: keys must be 32-byte block keys")
        object.__setattr__(self, "keys", tuple(bytes(k) for k in keys))


@dataclass
class _Session:
    sid: str
    state: SessionState
    keys: tuple[bytes, ...]
    hinted_at: float
    expected: float          # absolute seconds; inf when not continuing
    deadline: float          # absolute seconds (TTL); inf: none
    outcome: list | None = None    # HintCalibration record of this hint
    raw_gap: float | None = None   # the gap the hint gave (before the session's correction)
    exact: bool = False            # a commitment (kept until used), not a prediction


@dataclass
class SessionStats:
    """Counts of hints and of their effect (blocks)."""

    hints: int = 0
    continues: int = 0
    finished: int = 0
    abandoned: int = 0
    released_blocks: int = 0     # blocks let go (the name is the simulator report's key)
    lapsed: int = 0
    returns: int = 0


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
        default_gap_s: expected gap before any was observed (seconds).
        window: observed gaps kept for the learned median.
        max_sessions: sessions remembered; the least recently hinted are forgotten
            (their hints dropped, nothing let go).
        max_keys: keys whose owner is remembered (to tell private from shared).
    """

    def __init__(self, policies: Sequence[EvictionPolicy], *, calibration: HintCalibration | None = None,
                 calibrate: bool = True, default_gap_s: float = 60.0,
                 window: int = 256, max_sessions: int = 100_000, max_keys: int = 4_000_000):
        self.policies = list(policies)
        self._next_use = [p for p in self.policies if isinstance(p, AcceptsNextUse)]
        self.calibration = (calibration or HintCalibration()) if calibrate else None
        for p in self.policies:
            if isinstance(p, CalibratesHints):
                p.use_calibration(self.calibration)
        self.default_gap_s = default_gap_s
        self.max_sessions = max_sessions
        self.max_keys = max_keys
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._owner: OrderedDict[bytes, object] = OrderedDict()    # key -> sid or _SHARED
        self._gaps: deque[float] = deque(maxlen=window)
        self._deadlines: list[tuple[float, str]] = []
        self.stats = SessionStats()
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries

    def get(self, session_id: str) -> _Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def expected_gap(self) -> float:
        """The learned median gap between a "continues" and the session's return (seconds)."""
        return float(np.median(self._gaps)) if self._gaps else self.default_gap_s

    def private_keys(self, session_id: str) -> list[bytes]:
        """The session's keys no other session uses, in prefix order."""
        with self._lock:
            s = self._sessions.get(session_id)
            return [] if s is None else [k for k in s.keys if self._owner.get(k) == session_id]

    # ------------------------------------------------------------------ hints

    def apply(self, hint: SessionHint, now: float) -> float:
        """Apply one hint at ``now`` (seconds). Returns the session's expected-back time
        (absolute seconds; ``inf`` for finished / abandoned)."""
        with self._lock:
            t = now if hint.time is None else hint.time
            self.stats.hints += 1
            old = self._sessions.get(hint.session_id)
            if old is not None and hint.state != SessionState.ABANDONED:   # it came back
                self._returned(old, t)
            keys = hint.keys or (old.keys if old is not None else ())
            if hint.state != SessionState.CONTINUES:
                self._end(hint.session_id, hint.state, keys, t)
                return math.inf
            self.stats.continues += 1
            raw = hint.expected_back_s
            if raw is None:
                raw = self.expected_gap()
                if hint.ttl_s is not None:
                    raw = min(raw, hint.ttl_s)
            gap = raw
            cal = self.calibration
            if cal is not None and hint.expected_back_s is not None:
                gap = raw * cal.correction(hint.session_id)
                if hint.ttl_s is not None:
                    gap = min(gap, hint.ttl_s)
            deadline = t + hint.ttl_s if hint.ttl_s is not None else math.inf
            s = _Session(hint.session_id, SessionState.CONTINUES, keys, t, t + gap, deadline,
                         cal.hinted(t, gap) if cal is not None else None,
                         hint.expected_back_s)
            self._store(s, old, now)
            if deadline < math.inf:
                heapq.heappush(self._deadlines, (deadline, s.sid))
            return s.expected

    def expect(self, session_id: str, keys: Sequence[bytes], expected_at: float, now: float,
               hinted_at: float | None = None, calibrate: bool = False, exact: bool = False) -> None:
        """Refine a session's expected-back time (a tool call's prediction): the session
        continues with prefix ``keys`` (empty: as before) and is expected at
        ``expected_at`` (absolute seconds), as predicted at ``hinted_at`` (default: the
        session's last hint, or now). Does not count as the session's return; with
        ``calibrate`` the prediction's outcome is learned (call :meth:`returned`);
        ``exact``: the time is a commitment (paged-back blocks to keep until used)."""
        with self._lock:
            old = self._sessions.get(session_id)
            keys = tuple(keys) or (old.keys if old is not None else ())
            deadline = old.deadline if old is not None else math.inf
            t = old.hinted_at if (old is not None and hinted_at is None) else (now if hinted_at is None else hinted_at)
            outcome = old.outcome if old is not None else None
            if calibrate and self.calibration is not None:
                outcome = self.calibration.hinted(t, expected_at - t)
            s = _Session(session_id, SessionState.CONTINUES, keys, t, expected_at, deadline, outcome,
                         old.raw_gap if old is not None else None, exact)
            self._store(s, old, now)

    def returned(self, session_id: str, t: float) -> None:
        """The session's next request arrived at ``t`` (a tool call's resume): learn from
        the hint's outcome and drop it (the blocks are in use; the policy's own order
        takes over until the next hint)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                self._returned(s, t)
                private = [k for k in s.keys if self._owner.get(k) == session_id]
                for p in self._next_use:
                    p.clear_hints(private, t)

    def _returned(self, s: _Session, t: float) -> None:
        self._gaps.append(max(t - s.hinted_at, 0.0))
        self.stats.returns += 1
        if self.calibration is not None and s.outcome is not None:
            self.calibration.returned(s.outcome, s.sid, t, s.raw_gap)
            s.outcome = None

    def tick(self, now: float) -> None:
        """Drop the hints of sessions whose TTL ran out (seconds)."""
        with self._lock:
            dl = self._deadlines
            while dl and dl[0][0] <= now:
                deadline, sid = heapq.heappop(dl)
                s = self._sessions.get(sid)
                if s is None or s.deadline != deadline or s.state != SessionState.CONTINUES:
                    continue
                self.stats.lapsed += 1
                self._forget(sid, now)

    # ------------------------------------------------------------------ internals

    def _claim(self, sid: str, keys: Iterable[bytes], now: float) -> list[bytes]:
        """Record ``sid`` as a user of ``keys``; returns those private to it. A key
        another session uses becomes shared: its hints are cleared."""
        private, became_shared = [], []
        owner = self._owner
        for k in keys:
            o = owner.get(k)
            if o is None or o == sid:
                owner[k] = sid
                owner.move_to_end(k)
                private.append(k)
            elif o is not _SHARED:
                owner[k] = _SHARED
                became_shared.append(k)
        while len(owner) > self.max_keys:
            owner.popitem(last=False)
        if became_shared:
            for p in self.policies:
                p.revive(became_shared)
            for p in self._next_use:
                p.clear_hints(became_shared, now)
        return private

    def _store(self, s: _Session, old: _Session | None, now: float) -> None:
        private = self._claim(s.sid, s.keys, now)
        if old is not None and old.keys != s.keys:
            now_keys = set(s.keys)
            dropped = [k for k in old.keys if k not in now_keys and self._owner.get(k) == s.sid]
            if dropped:
                self._let_go(dropped)
        self._sessions[s.sid] = s
        self._sessions.move_to_end(s.sid)
        for p in self.policies:
            p.revive(private)
        for p in self._next_use:
            p.set_next_use(private, s.expected, now, since=s.hinted_at, exact=s.exact)
        while len(self._sessions) > self.max_sessions:
            sid = next(iter(self._sessions))
            self._forget(sid, now)

    def _end(self, sid: str, state: SessionState, keys: Sequence[bytes], now: float) -> None:
        if state == SessionState.FINISHED:
            self.stats.finished += 1
        else:
            self.stats.abandoned += 1
        private = self._claim(sid, keys, now)
        old = self._sessions.pop(sid, None)
        if old is not None:
            seen = set(private)
            private += [k for k in old.keys if self._owner.get(k) == sid and k not in seen]
        self._let_go(private)
        for k in private:
            self._owner.pop(k, None)

    def _let_go(self, keys: list[bytes]) -> None:
        self.stats.released_blocks += len(keys)
        for p in self.policies:
            p.let_go(keys)

    def _forget(self, sid: str, now: float) -> None:
        """Forget a session without letting its blocks go: its hints are dropped."""
        s = self._sessions.pop(sid, None)
        if s is None:
            return
        private = [k for k in s.keys if self._owner.get(k) == sid]
        for p in self._next_use:
            p.clear_hints(private, now)
