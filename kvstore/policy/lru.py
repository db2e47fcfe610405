"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvstore.policy.base import EvictionPolicy, NoVictim, register


@register
class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last insert or hit is oldest. O(1) per operation.

    Pinned blocks at the cold end are skipped, not reordered.
    """

    name = "lru"

    def __init__(self, capacity_bytes: int, **params):
        super().__init__(capacity_bytes, **params)
        self._order: OrderedDict[bytes, float] = OrderedDict()   # key -> last use (seconds)

    def _insert(self, key: bytes, nbytes: int, now: float) -> None:
        self._order[key] = now
        self._order.move_to_end(key)

    def _access(self, key: bytes, now: float) -> None:
        if key in self._order:
            self._order[key] = now
            self._order.move_to_end(key)

    def _remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        for key in self._order:
            if evictable(key):
                return key
        raise NoVictim(f"lru: none of {len(self._order)} resident blocks is evictable")

    def victim_reason(self, key: bytes, now: float) -> str:
        last = self._order.get(key)
        if last is None:
            return "least recently used"
        return f"least recently used (last used {now - last:.1f} s before)"
