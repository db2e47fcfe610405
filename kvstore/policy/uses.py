"""How often each block was used: the evidence that a block let go is still wanted.

A session hint says a session finished; it cannot say whether *somebody else* (plain
traffic, another client, a session that sends no hints) uses the same block, a
system prompt most of all. The policies see every use (a hit is ``access``, a put asks
``admit``), without knowing who made it. :class:`UseLedger` counts them per block, so
that the session table can tell the uses a session explains (one per request it made,
:mod:`kvstore.agent.sessions`) from the ones it does not, and a policy can take back a
let-go as soon as a block is used more often than the session that let it go explains
(:meth:`kvstore.policy.base.EvictionPolicy.let_go`).

One use reaches every tier that holds the block (the manager touches each), and a put
asks every tier it tries in turn, all at one time: a note with the same time from a
different policy than the previous note of that key is the same use, counted once.
The ledger is shared by the policies of one manager (the session table hands one to
all of them); each has its own until then.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_COUNTED = 1 << 20
"""Blocks whose use count is remembered (the least recently used are forgotten)."""


class UseLedger:
    """Uses per block key (bounded; thread-safe).

    Args:
        max_keys: keys remembered; a forgotten key counts from 0 again.
    """

    def __init__(self, max_keys: int = MAX_COUNTED):
        self.max_keys = max_keys
        self._uses: OrderedDict[bytes, list] = OrderedDict()    # key -> [count, last time, last noter id]
        self._lock = threading.Lock()

    def note(self, key: bytes, now: float, noter: object) -> int:
        """One use of ``key`` at ``now`` (seconds) seen by ``noter`` (a policy); returns
        the count. A note at the same time from another noter is the same use."""
        with self._lock:
            return self._note(key, now, id(noter))

    def note_all(self, keys, now: float, noter: object) -> None:
        """:meth:`note` of each of ``keys`` (one lock)."""
        me, one = id(noter), self._note
        with self._lock:
            for key in keys:
                one(key, now, me)

    def _note(self, key: bytes, now: float, noter_id: int) -> int:
        """:meth:`note` with the lock held."""
        rec = self._uses.get(key)
        if rec is None:
            rec = self._uses[key] = [0, None, 0]
            if len(self._uses) > self.max_keys:
                self._uses.popitem(last=False)
        else:
            self._uses.move_to_end(key)
            if rec[1] == now and rec[2] != noter_id:
                return rec[0]
        rec[0] += 1
        rec[1] = now
        rec[2] = noter_id
        return rec[0]

    def count(self, key: bytes) -> int:
        """Uses of ``key`` noted so far (0 when unknown)."""
        rec = self._uses.get(key)
        return rec[0] if rec is not None else 0

    def last_time(self, key: bytes) -> float | None:
        """When ``key`` was last used (seconds; None when unknown)."""
        rec = self._uses.get(key)
        return rec[1] if rec is not None else None

    def __len__(self) -> int:
        return len(self._uses)
