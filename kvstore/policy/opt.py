"""``opt``: Belady's MIN with bypass, the offline optimum used as the simulator's ceiling.

Belady 1966 ("A study of replacement algorithms for a virtual-storage computer", IBM
Systems Journal 5(2)): evicting the block whose next use is farthest in the future
minimises misses. With bypass (a block whose next use is farther than every resident
block's is not admitted) it also covers caches that may decline to store a block, as
``next_use`` and the manager's admission step allow. The future comes from :meth:`BeladyPolicy.set_next_use`, which
``kvstore simulate`` calls with each request's keys and the time of each key's next
request before the request is processed.

Prefix semantics: keys are chained prefix hashes, so a block's next use is never
sooner than its parent's; ties (same next request) evict the highest position first,
which keeps the cached set prefix-closed, so block hits are prefix hits.

This is an oracle: it is registered so the simulator can build it by name, but it
is not a daemon policy (the config's ``eviction`` choices exclude it).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

from kvstore.policy.base import EvictionPolicy, NoVictim, register


@register
class BeladyPolicy(EvictionPolicy):
    """Farthest next use first, bypassing blocks that would be evicted first anyway.

    Args:
        capacity_bytes: the tier's capacity; admission compares resident bytes to it.
    """

    name = "opt"

    def __init__(self, capacity_bytes: int, **params):
        super().__init__(capacity_bytes, **params)
        self._next: dict[bytes, tuple[float, int]] = {}    # key -> (next use time, position)
        self._heap: list[tuple[float, int, bytes]] = []      # (-time, -position, key)

    def set_next_use(self, keys: Sequence[bytes], times: float | Sequence[float], now: float,
                     since: float | None = None, exact: bool = True) -> None:
        """Next use of each key (seconds; ``math.inf``: never). ``keys`` in prefix order."""
        seq = [times] * len(keys) if isinstance(times, (int, float)) else times
        for pos, (key, t) in enumerate(zip(keys, seq)):
            nu = (float(t), pos)
            self._next[key] = nu
            if key in self._sizes:
                heapq.heappush(self._heap, (-nu[0], -pos, key))

    def _nu(self, key: bytes) -> tuple[float, int]:
        return self._next.get(key, (math.inf, 0))

    def _insert(self, key: bytes, nbytes: int, now: float) -> None:
        t, pos = self._nu(key)
        heapq.heappush(self._heap, (-t, -pos, key))

    def _access(self, key: bytes, now: float) -> None:
        pass  # next uses arrive through set_next_use

    def _remove(self, key: bytes) -> None:
        pass  # stale heap entries are skipped lazily

    def _top(self, evictable: Callable[[bytes], bool]) -> tuple[float, int, bytes] | None:
        heap = self._heap
        skipped = []
        found = None
        while heap:
            negt, negpos, key = heap[0]
            if key not in self._sizes or self._nu(key) != (-negt, -negpos):
                heapq.heappop(heap)
                continue
            if not evictable(key):
                skipped.append(heapq.heappop(heap))
                continue
            found = heap[0]
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _admit(self, key: bytes, nbytes: int, now: float) -> bool:
        if self._used + nbytes <= self.capacity_bytes:
            return True
        top = self._top(lambda k: True)
        if top is None:
            return True
        t, pos = self._nu(key)
        return (t, pos) < (-top[0], -top[1])

    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        top = self._top(evictable)
        if top is None:
            raise NoVictim(f"opt: none of {len(self._sizes)} resident blocks is evictable")
        return top[2]

    def victim_reason(self, key: bytes, now: float) -> str:
        t = self._nu(key)[0]
        return "never used again" if t == float("inf") else f"next used farthest in the future (at {t:.1f} s)"
