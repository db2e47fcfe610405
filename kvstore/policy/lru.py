"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .base import EvictionPolicy, NoVictim, register


@register
class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last insert or hit is oldest. O(1) per operation.

    Pinned blocks at the cold end are skipped, not reordered.
    """

    name = "lru"

    def __init__(self, capacity_bytes: int, **params):
        super().__init__(capacity_bytes, **params)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, nbytes: int, now: float) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None = None,
               now: float = 0.0) -> bytes:
        for key in self._order:
            if evictable(key):
                return key
        raise NoVictim(f"lru: none of {len(self._order)} resident blocks is evictable")

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
