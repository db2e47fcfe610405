"""``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03), sized in bytes.

ARC keeps two LRU lists of resident blocks and two *ghost* lists of recently evicted
keys (no data)::

    T1: seen once recently          B1: ghosts evicted from T1
    T2: seen at least twice         B2: ghosts evicted from T2

and a target ``p`` for the size of T1. A miss that hits a ghost in B1 means T1 was
too small: ``p`` grows by ``max(1, |B2|/|B1|)`` block sizes; a ghost hit in B2 shrinks
it by ``max(1, |B1|/|B2|)``. A victim is the LRU block of T1 when T1 exceeds ``p``
(or equals it and the incoming key is a B2 ghost), else the LRU block of T2.
Directory sizes stay bounded: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.

The paper counts pages; here every size is in bytes (``c`` = ``capacity_bytes``,
|X| = bytes of blocks or ghosts in X, and the ``p`` step is scaled by the incoming
block's size), so blocks of different sizes work. Pinned blocks are skipped
(the next block in LRU order is taken, then the other list). No parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvstore.policy.base import EvictionPolicy, NoVictim, register


@register
class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache. O(1) per operation (plus skipped pinned blocks)."""

    name = "arc"

    def __init__(self, capacity_bytes: int, **params):
        super().__init__(capacity_bytes, **params)
        self.t1: OrderedDict[bytes, int] = OrderedDict()   # key -> bytes, LRU first
        self.t2: OrderedDict[bytes, int] = OrderedDict()
        self.b1: OrderedDict[bytes, int] = OrderedDict()
        self.b2: OrderedDict[bytes, int] = OrderedDict()
        self.t1_bytes = self.t2_bytes = self.b1_bytes = self.b2_bytes = 0
        self.p = 0.0                                        # target bytes of T1
        self._adapted_for: bytes | None = None

    # ------------------------------------------------------------------ adaptation

    def _adapt(self, key: bytes | None, nbytes: int | None = None) -> None:
        """Move ``p`` on a ghost hit of the incoming ``key`` (once per incoming key)."""
        if key is None or key == self._adapted_for:
            return
        c = self.capacity_bytes
        if key in self.b1:
            size = nbytes or self.b1[key]
            step = size * max(1.0, self.b2_bytes / max(self.b1_bytes, 1))
            self.p = min(float(c), self.p + step)
            self._adapted_for = key
        elif key in self.b2:
            size = nbytes or self.b2[key]
            step = size * max(1.0, self.b1_bytes / max(self.b2_bytes, 1))
            self.p = max(0.0, self.p - step)
            self._adapted_for = key

    def _trim_ghosts(self) -> None:
        c = self.capacity_bytes
        while self.b1 and self.t1_bytes + self.b1_bytes > c:
            _, n = self.b1.popitem(last=False)
            self.b1_bytes -= n
        while self.b2 and self.t1_bytes + self.t2_bytes + self.b1_bytes + self.b2_bytes > 2 * c:
            _, n = self.b2.popitem(last=False)
            self.b2_bytes -= n

    # ------------------------------------------------------------------ protocol

    def _insert(self, key: bytes, nbytes: int, now: float) -> None:
        if key in self.t1 or key in self.t2:
            self._access(key, now)
            return
        self._adapt(key, nbytes)
        self._adapted_for = None
        if key in self.b1:
            self.b1_bytes -= self.b1.pop(key)
            self.t2[key] = nbytes
            self.t2_bytes += nbytes
        elif key in self.b2:
            self.b2_bytes -= self.b2.pop(key)
            self.t2[key] = nbytes
            self.t2_bytes += nbytes
        else:
            self.t1[key] = nbytes
            self.t1_bytes += nbytes
        self._trim_ghosts()

    def _access(self, key: bytes, now: float) -> None:
        if key in self.t1:
            n = self.t1.pop(key)
            self.t1_bytes -= n
            self.t2[key] = n
            self.t2_bytes += n
        elif key in self.t2:
            self.t2.move_to_end(key)

    def _evicted(self, key: bytes) -> None:
        if key in self.t1:
            n = self.t1.pop(key)
            self.t1_bytes -= n
            self.b1[key] = n
            self.b1_bytes += n
        elif key in self.t2:
            n = self.t2.pop(key)
            self.t2_bytes -= n
            self.b2[key] = n
            self.b2_bytes += n
        self._trim_ghosts()

    def _remove(self, key: bytes) -> None:
        for lst, attr in ((self.t1, "t1_bytes"), (self.t2, "t2_bytes"),
                          (self.b1, "b1_bytes"), (self.b2, "b2_bytes")):
            n = lst.pop(key, None)
            if n is not None:
                setattr(self, attr, getattr(self, attr) - n)

    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        self._adapt(incoming)
        from_t1 = bool(self.t1) and (self.t1_bytes > self.p or
                                     (incoming is not None and incoming in self.b2 and self.t1_bytes >= self.p))
        order = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
        for lst in order:
            for key in lst:
                if evictable(key):
                    return key
        raise NoVictim(f"arc: none of {len(self)} resident blocks is evictable")

    def victim_reason(self, key: bytes, now: float) -> str:
        if key in self.t1:
            return f"least recently used of the blocks seen once (T1 above its target {self.p:.0f} bytes)"
        return "least recently used of the blocks seen twice or more (T2)"
