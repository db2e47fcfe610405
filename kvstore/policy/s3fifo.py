"""``s3fifo``: S3-FIFO (Yang, Zhang, Qiu, Yue & Rashmi, "FIFO queues are all you need
for cache eviction", SOSP'23), sized in bytes.

Three FIFO queues::

    S (small, ~10% of the bytes): new blocks; filters one-hit wonders
    M (main, the rest):           blocks that proved themselves
    G (ghost, keys only):         recently evicted from S, as many bytes of keys as M holds

Every resident block has a 2-bit frequency (0..3) that a hit increments.

- Insert: a key remembered in G goes straight to M, any other to S (frequency 0).
- Evict, when S holds at least ``small_ratio`` of the capacity (or M has nothing to
  give): take S's oldest block; if it was hit at least ``move_to_main_threshold``
  times it moves to M (frequency reset) and the scan goes on, else it is the victim
  and its key goes to G.
- Otherwise evict from M: its oldest block, if its frequency is above 0, is
  reinserted at M's head with the frequency decremented, else it is the victim.

Pinned blocks are rotated to the head of their queue without changing their
frequency. :meth:`S3FIFOPolicy.victim` performs these queue moves (they do not move
data) and returns the block that must leave; the manager then calls
:meth:`~S3FIFOPolicy.evicted`.

Parameters: ``small_ratio`` (fraction of capacity bytes for S, default 0.1, the
paper's choice) and ``move_to_main_threshold`` (hits needed in S to enter M, default
1, as in the authors' libCacheSim implementation).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvstore.common.errors import ConfigError
from kvstore.policy.base import EvictionPolicy, NoVictim, register

MAX_FREQ = 3


@register
class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with a small queue, a main queue with bounded reinsertion and a ghost queue."""

    name = "s3fifo"
    params_doc = {
        "small_ratio": "fraction of the capacity (bytes) for the small FIFO, in (0, 1) (0.1)",
        "move_to_main_threshold": "hits a block needs while in the small FIFO to move to main (1)",
    }

    def __init__(self, capacity_bytes: int, **params):
        small_ratio = params.pop("small_ratio", 0.1)
        threshold = params.pop("move_to_main_threshold", 1)
        super().__init__(capacity_bytes, **params)
        if isinstance(small_ratio, bool) or not isinstance(small_ratio, (int, float)) or not 0 < small_ratio < 1:
            raise ConfigError(f"policy 's3fifo': small_ratio must be in (0, 1), got {small_ratio!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= MAX_FREQ:
            raise ConfigError(f"policy 's3fifo': move_to_main_threshold must be an integer in 1..{MAX_FREQ}, "
                              f"got {threshold!r}")
        self.small_ratio = float(small_ratio)
        self.threshold = threshold
        self.small: OrderedDict[bytes, None] = OrderedDict()   # oldest first
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.freq: dict[bytes, int] = {}
        self.size: dict[bytes, int] = {}
        self.small_bytes = self.main_bytes = self.ghost_bytes = 0

    @property
    def small_target(self) -> float:
        return self.small_ratio * self.capacity_bytes

    def _insert(self, key: bytes, nbytes: int, now: float) -> None:
        if key in self.size:
            self._access(key, now)
            return
        self.size[key] = nbytes
        self.freq[key] = 0
        n = self.ghost.pop(key, None)
        if n is not None:
            self.ghost_bytes -= n
            self.main[key] = None
            self.main_bytes += nbytes
        else:
            self.small[key] = None
            self.small_bytes += nbytes

    def _access(self, key: bytes, now: float) -> None:
        f = self.freq.get(key)
        if f is not None and f < MAX_FREQ:
            self.freq[key] = f + 1

    def _to_main(self, key: bytes) -> None:
        del self.small[key]
        n = self.size[key]
        self.small_bytes -= n
        self.main[key] = None
        self.main_bytes += n
        self.freq[key] = 0

    def _from_small(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for _ in range(len(self.small)):
            key = next(iter(self.small))
            if not evictable(key):
                self.small.move_to_end(key)
            elif self.freq[key] >= self.threshold:
                self._to_main(key)
            else:
                return key
        return None

    def _from_main(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for _ in range((MAX_FREQ + 1) * len(self.main) + 1):
            if not self.main:
                return None
            key = next(iter(self.main))
            if not evictable(key):
                self.main.move_to_end(key)
            elif self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.move_to_end(key)
            else:
                return key
        return None

    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        if self.small and (self.small_bytes >= self.small_target or not self.main):
            key = self._from_small(evictable)
            if key is not None:
                return key
        key = self._from_main(evictable)
        if key is None:
            key = self._from_small(evictable)
        if key is None:
            raise NoVictim(f"s3fifo: none of {len(self.size)} resident blocks is evictable")
        return key

    def _trim_ghost(self) -> None:
        limit = self.capacity_bytes - self.small_target
        while self.ghost and self.ghost_bytes > limit:
            _, n = self.ghost.popitem(last=False)
            self.ghost_bytes -= n

    def _evicted(self, key: bytes) -> None:
        was_small = key in self.small
        n = self.size.get(key)
        self._remove(key)
        if was_small and n is not None:
            self.ghost[key] = n
            self.ghost_bytes += n
            self._trim_ghost()

    def _remove(self, key: bytes) -> None:
        n = self.size.pop(key, None)
        if n is None:
            g = self.ghost.pop(key, None)
            if g is not None:
                self.ghost_bytes -= g
            return
        self.freq.pop(key, None)
        if key in self.small:
            del self.small[key]
            self.small_bytes -= n
        else:
            self.main.pop(key, None)
            self.main_bytes -= n

    def victim_reason(self, key: bytes, now: float) -> str:
        if key in self.small:
            return "oldest block of the small FIFO, not hit since it entered"
        return "oldest block of the main FIFO with no hits left"
