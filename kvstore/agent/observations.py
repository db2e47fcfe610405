"""Requests seen by the daemon's lookups, fed to the reuse model without ever waiting on prefetch.

Every Lookup hands its prefix to the prefetch scheduler
(:meth:`kvstore.agent.prefetch.PrefetchScheduler.observe_request`), which feeds the
``next_use`` policy's :class:`~kvstore.policy.reuse_model.ReuseModel`. The model is the
scheduler's state, guarded by its lock, and a scheduler pass holds that lock while it pages
blocks back from NVMe. :class:`RequestObserver` keeps a lookup off that lock: a request that
finds it held is queued (bounded) with the time it arrived, and learnt, in order, by the
pass before it ends or by the next lookup that gets the lock. Every tensor-parallel rank
looks the same prefix up: one seen again within ``dedupe_s`` seconds is counted once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Callable, Sequence

MAX_PENDING_OBSERVATIONS = 4096
"""Lookups queued while a scheduler pass holds the lock, at most (the oldest are dropped)."""

MAX_RECENT = 4096
"""Prefixes remembered for the dedupe window, at most."""


class RequestObserver:
    """Feeds requests to a reuse model under the scheduler's lock, never waiting for it.

    Args:
        model: the reuse model (``observe_request(keys, now)``).
        lock: the scheduler's lock (held by its passes).
        clock: seconds (the scheduler's clock).
        dedupe_s: a prefix seen again within this many seconds counts once.
    """

    def __init__(self, model, lock: threading.RLock, clock: Callable[[], float], dedupe_s: float):
        self.model = model
        self._lock = lock
        self.clock = clock
        self.dedupe_s = dedupe_s
        self._recent: OrderedDict[tuple[bytes, int], float] = OrderedDict()   # (last key, length) -> seen
        self._pending: deque[tuple[list[bytes], float]] = deque(maxlen=MAX_PENDING_OBSERVATIONS)

    def observe(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Learn the request for prefix ``keys`` (in order). Without ``now`` (a lookup: now
        on the clock) it is queued when the lock is held; with ``now`` (the simulator's
        virtual time) it is learnt at once, waiting for the lock."""
        if not keys:
            return
        if now is None:
            now = self.clock()
            if not self._lock.acquire(blocking=False):
                self._pending.append((list(keys), now))
                return
        else:
            self._lock.acquire()
        try:
            self.drain()
            self._learn(keys, now)
        finally:
            self._lock.release()

    def drain(self) -> None:
        """Learn the queued requests, in order (the lock held)."""
        pending = self._pending
        while pending:
            try:
                keys, t = pending.popleft()
            except IndexError:       # taken by another thread meanwhile
                break
            self._learn(keys, t)

    def _learn(self, keys: Sequence[bytes], now: float) -> None:
        sig = (keys[-1], len(keys))
        last = self._recent.get(sig)
        if last is not None and now - last < self.dedupe_s:
            return
        self._recent[sig] = now
        self._recent.move_to_end(sig)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
        self.model.observe_request(keys, now)
