"""Agent trajectories seen from an engine's scheduler: which request resumes which wait.

An engine's scheduler sees every request's block keys, with or without a hint. From them
:class:`AgentTracker` tells the daemon (through a :class:`~engine_adapter.hint_sender.HintSender`,
never blocking) when a trajectory starts to wait and when it resumes:

- **with a hint** (:mod:`engine_adapter.agent_hints`), when the request finishes:
  ``tool_call`` -> ``ToolCallStart(session_id, tool, keys)``; ``continues`` ->
  ``SessionHint(continues, keys, expected_back_s, ttl_s)``; ``finished`` / ``abandoned`` ->
  ``SessionHint(finished | abandoned, keys)``; a ``kv_hints`` envelope -> ``SessionHint``
  carrying it. The next request naming the same session is its resume (``Resume`` on arrival:
  every request naming a session sends one, since the session may have waited at another engine
  instance sharing the daemon; the daemon answers "unknown" when it did not wait);
- **with only the engine's session id** (vLLM's ``Request.session_id``): as without a hint,
  the trajectory named by that id;
- **without one**, a finished request starts a wait of an anonymous trajectory
  (``ToolCallStart`` with an id of this engine instance, ``anon-<instance>-<n>``, and the
  trajectory's *class* as the tool: ``class:`` + the first 16 hex digits of the key of block
  ``class_blocks - 1``, i.e. the shared prefix, such as a system prompt, that its agents
  start with; ``""`` with ``class_blocks = 0``), so the daemon learns the gap
  distribution per class; a later request whose blocks cover that request's blocks (its
  prefix extends them) is the resume (``Resume``), and when it finishes the same
  trajectory waits again under the same id.

Keys are chained (key ``i`` names the whole prefix up to block ``i``), so "covers" is one
dictionary look-up per prefix length that some waiting trajectory has (at most one per block of
the arriving request): the longest waiting trajectory whose last block is among them. A trajectory resumes once; a second request covering the same
blocks (a fork) starts a trajectory of its own when it finishes.

**Bounded.** :class:`TrajectoryTable` keeps at most ``max_entries`` waiting trajectories
(least recently finished dropped first) for at most ``ttl_s`` seconds each; an entry
holds one 32-byte key, a count and an id. A dropped entry only means a later return is not
recognised (the daemon expires the wait itself, :mod:`kvstore.agent.waiting`).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.common.errors import InvalidRequest
from kvstore.common.hint_limits import check_name

from engine_adapter.agent_hints import (ABANDONED, CONTINUES, FINISHED, TOOL_CALL, AgentHint,
                                        HintError, envelope_of, envelope_session, parse_kvstore_params)

log = logging.getLogger("engine_adapter.hints")

CLASS_PREFIX = "class:"
"""The tool name of an anonymous trajectory's wait starts with this."""


class TrajectoryTable:
    """Waiting trajectories by id and by the key of their last block (LRU, bounded).

    Args:
        max_entries: trajectories remembered at most (least recently added dropped first).
        ttl_s: an entry older than this many seconds is dropped (the clock's units).
    """

    def __init__(self, max_entries: int = 4096, ttl_s: float = 3600.0):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[bytes, int, float]] = OrderedDict()   # id -> (last key, blocks, t)
        self._by_key: dict[bytes, str] = {}
        self._lengths: Counter[int] = Counter()          # entries per prefix length (blocks)
        self._sorted: list[int] = []                     # the lengths present, ascending
        self.dropped = 0          # entries let go by the bound or the TTL

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._entries

    def add(self, trajectory_id: str, keys: Sequence[bytes], now: float) -> None:
        """``trajectory_id`` waits since ``now`` with prefix ``keys`` (non-empty; replaces
        its earlier entry, and another trajectory's that ended on the same block)."""
        self.pop(trajectory_id)
        last = bytes(keys[-1])
        other = self._by_key.get(last)
        if other is not None:
            self.pop(other)
        self._entries[trajectory_id] = (last, len(keys), now)
        self._by_key[last] = trajectory_id
        n = len(keys)
        if not self._lengths[n]:
            bisect.insort(self._sorted, n)
        self._lengths[n] += 1
        self._trim(now)

    def pop(self, trajectory_id: str) -> bool:
        """Forget ``trajectory_id``; True when it was waiting."""
        e = self._entries.pop(trajectory_id, None)
        if e is None:
            return False
        if self._by_key.get(e[0]) == trajectory_id:
            del self._by_key[e[0]]
        n = e[1]
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
            del self._sorted[bisect.bisect_left(self._sorted, n)]
        return True

    def match(self, keys: Sequence[bytes], now: float) -> str | None:
        """The longest waiting trajectory whose blocks ``keys`` covers, removed from the
        table; None when none does. One look-up per prefix length present in the table
        (at most ``len(keys)``), longest first."""
        self._trim(now)
        by_key, lengths = self._by_key, self._sorted
        for j in range(bisect.bisect_right(lengths, len(keys)) - 1, -1, -1):
            n = lengths[j]
            tid = by_key.get(keys[n - 1])
            if tid is not None and self._entries[tid][1] == n:
                self.pop(tid)
                return tid
        return None

    def _trim(self, now: float) -> None:
        entries = self._entries
        while entries:
            tid, (_, _, t) = next(iter(entries.items()))
            if len(entries) <= self.max_entries and now - t <= self.ttl_s:
                break
            self.pop(tid)
            self.dropped += 1


@dataclass
class RequestHints:
    """What :meth:`AgentTracker.arrived` learnt of one request, for its finish.

    Attributes:
        hint: its ``kv_transfer_params["kvstore"]`` (None: none, or malformed).
        envelope: its ``kv_hints`` envelope as JSON (None: none, malformed, or a hint given).
        trajectory: the trajectory it belongs to (``""``: a new one, named when it finishes).
    """

    hint: AgentHint | None = None
    envelope: dict | None = None
    trajectory: str = ""


class AgentTracker:
    """Hints and trajectories of one engine instance's requests, to the daemon.

    Args:
        sender: the :class:`~engine_adapter.hint_sender.HintSender` the calls go through.
        hints: read each request's hint (off: every request is treated as carrying none).
        trajectories: start anonymous trajectories for requests without a hint.
        max_trajectories, ttl_s: bounds of the :class:`TrajectoryTable` (entries, seconds).
        class_blocks: leading blocks that name an anonymous trajectory's class (0: one class).
        clock: unix seconds (the times the daemon is told).

    Not thread-safe: the engine's scheduler thread calls it.
    """

    def __init__(self, sender, *, hints: bool = True, trajectories: bool = True, max_trajectories: int = 4096, ttl_s: float = 3600.0,
                 class_blocks: int = 1, clock=time.time):
        self.sender = sender
        self.hints = hints
        self.trajectories = trajectories
        self.table = TrajectoryTable(max_trajectories, ttl_s)
        self.class_blocks = class_blocks
        self.clock = clock
        self.instance = os.urandom(4).hex()
        self._next = 0
        self.counts: Counter[str] = Counter()
        self._malformed_logged = False

    def _malformed(self, request_id: str, e: HintError) -> None:
        self.counts["malformed"] += 1
        level = logging.DEBUG if self._malformed_logged else logging.WARNING
        self._malformed_logged = True
        log.log(level, "request %s: its kvstore hint is ignored (%s); further malformed hints are counted, "
                "logged at DEBUG", request_id, e)

    def arrived(self, request_id: str, keys: Sequence[bytes], kv_transfer_params: Any = None,
                kv_hints: Any = None, at: float | None = None, session_id: Any = None) -> RequestHints:
        """A request arrived with its block keys and what it carries; tells the daemon
        which wait it resumes, if any (``at``: unix seconds, default now).

        ``session_id`` is the engine's own session of the request (vLLM's
        ``Request.session_id``, the OpenAI API's ``session_id``), if any: without a hint it
        names the request's trajectory (instead of an anonymous id)."""
        at = self.clock() if at is None else at
        info = RequestHints()
        if not self.hints:
            kv_transfer_params = kv_hints = session_id = None
        try:
            info.hint = parse_kvstore_params(kv_transfer_params)
            if info.hint is None:
                info.envelope = envelope_of(kv_hints)
        except HintError as e:
            self._malformed(request_id, e)
        session = info.hint.session_id if info.hint is not None else envelope_session(info.envelope)
        if not session and session_id:
            try:
                session = check_name(session_id, "session_id")
            except InvalidRequest:
                pass
        self.counts["hinted"] += info.hint is not None or info.envelope is not None
        resumed: list[str] = []
        known = bool(session) and self.table.pop(session)
        if session:            # always: it may have waited at another engine instance of the daemon
            resumed.append(session)
            self.counts["resumed_session"] += known
        if keys and not known:
            tid = self.table.match(keys, at)
            if tid is not None and tid != session:
                resumed.append(tid)
                self.counts["resumed_prefix"] += 1
        for tid in resumed:
            self.sender.resume(tid, at)
        info.trajectory = session or (resumed[0] if resumed else "")   # names it from now on
        return info

    def finished(self, info: RequestHints, keys: Sequence[bytes], at: float | None = None) -> None:
        """The request finished; ``keys`` are its stored prefix (its blocks with KV). Tells
        the daemon what the session does now (see the module docstring)."""
        at = self.clock() if at is None else at
        keys = list(keys)
        h = info.hint
        if h is not None:
            self._finished_hinted(h, keys, at)
        elif info.envelope is not None:
            self.sender.session_hint("", CONTINUES, keys, at, kv_hints=info.envelope)
            sid = envelope_session(info.envelope)
            if sid and keys:
                self.table.add(sid, keys, at)
        elif self.trajectories and keys:
            tid = info.trajectory or self._new_id()
            self.sender.tool_call_start(tid, self.class_of(keys), keys, at)
            self.table.add(tid, keys, at)
            self.counts["waits"] += 1

    def _finished_hinted(self, h: AgentHint, keys: list[bytes], at: float) -> None:
        sid = h.session_id
        if h.state == TOOL_CALL:
            self.sender.tool_call_start(sid, h.tool, keys, at)
        elif h.state == CONTINUES:
            self.sender.session_hint(sid, CONTINUES, keys, at, expected_back_s=h.expected_back_s, ttl_s=h.ttl_s)
        else:
            self.sender.session_hint(sid, h.state if h.state in (FINISHED, ABANDONED) else FINISHED, keys, at)
            self.table.pop(sid)
            return
        if keys:
            self.table.add(sid, keys, at)

    def class_of(self, keys: Sequence[bytes]) -> str:
        """The class of an anonymous trajectory with prefix ``keys`` (its tool name)."""
        if self.class_blocks <= 0 or not keys:
            return ""
        return CLASS_PREFIX + bytes(keys[min(self.class_blocks, len(keys)) - 1]).hex()[:16]

    def _new_id(self) -> str:
        self._next += 1
        return f"anon-{self.instance}-{self._next}"

    def stats(self) -> dict[str, int]:
        """Counts: ``hinted``, ``malformed`` requests, ``resumed_session`` /
        ``resumed_prefix`` resumes, anonymous ``waits`` started, ``waiting`` trajectories
        and entries ``dropped`` by the table's bounds; with the sender's counts."""
        out = dict(self.counts)
        out.update(waiting=len(self.table), dropped=self.table.dropped)
        out.update({f"calls_{k}": v for k, v in self.sender.stats().items()})
        return out

    def close(self) -> None:
        """Send what is queued (briefly) and stop the sender's thread."""
        self.sender.close()
