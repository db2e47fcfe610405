"""Allocators of byte extents in one preallocated region (a host arena, an HBM slab).

Both hand out ``(start, size)`` extents in ``[0, capacity)`` and take them back, with
one interface (``round_up``, ``largest_free``, ``can_allocate``, ``allocate``,
``release``, ``capacity``, ``used``):

- :class:`ExtentAllocator`: variable extents, best fit over the free extents,
  neighbours coalesced on free, as in LMCache v1's ``memory_management.py`` host
  allocator (our own code)::

      region  |blk a |  free  |blk b|blk c|      free       |
              0      ^ start  ^ end                          capacity

- :class:`SlotAllocator`: fixed-size slots (every block takes one).

Not thread-safe: the tier that owns one calls it under its lock.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from tiers.errors import NoRoom

# A free extent is kept in the size index as one int, ``size << _SHIFT | start``: ints sort
# by size first, then by start (best fit, lowest address among equals), and compare faster
# than tuples. Arenas up to 2**48 bytes (256 TiB).
_SHIFT = 48
_START_MASK = (1 << _SHIFT) - 1


class ExtentAllocator:
    """Best-fit allocator of byte extents in ``[0, capacity)``, coalescing on free.

    Free extents are indexed three ways: by start and by end (dicts, for O(1) merging with
    both neighbours) and by size (a sorted list, searched with bisect for the smallest
    extent that fits). An allocation or a free costs O(log n) comparisons plus one list
    insert/delete (a memmove), n being the number of free extents.

    Args:
        capacity: bytes to manage; rounded down to a multiple of ``alignment``.
        alignment: allocation unit in bytes (a power of two). Every extent start and
            size is a multiple of it.
    """

    def __init__(self, capacity: int, alignment: int):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        if self.capacity > _START_MASK:
            raise ValueError(f"capacity {capacity} exceeds the allocator's limit of {_START_MASK} bytes")
        self.used = 0
        self._by_start: dict[int, int] = {}   # start -> size
        self._by_end: dict[int, int] = {}     # end -> start
        self._by_size: list[int] = []         # sorted size << _SHIFT | start
        if self.capacity:
            self._insert(0, self.capacity)

    # -------------------------------------------------------------- queries

    def round_up(self, nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` takes: at least one unit, a multiple of ``alignment``."""
        a = self.alignment
        return (max(nbytes, 1) + a - 1) & ~(a - 1)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent in bytes (0 when full)."""
        return self._by_size[-1] >> _SHIFT if self._by_size else 0

    @property
    def num_free_extents(self) -> int:
        return len(self._by_size)

    def can_allocate(self, nbytes: int) -> bool:
        """True iff :meth:`allocate` of ``nbytes`` would succeed now."""
        return nbytes >= 0 and bool(self._by_size) and (self._by_size[-1] >> _SHIFT) >= self.round_up(nbytes)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(start, size)`` in bytes, by ascending start (for tests and stats)."""
        return sorted(self._by_start.items())

    # -------------------------------------------------------------- changes

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Allocate room for ``nbytes`` bytes; return ``(start, size)``, size being rounded up.

        Raises NoRoom when no free extent is large enough (also when the total free
        space would be, but is fragmented), ValueError for a negative size.
        """
        if nbytes < 0:
            raise ValueError(f"block size must be >= 0 bytes, got {nbytes}")
        size = self.round_up(nbytes)
        by_size = self._by_size
        i = bisect_left(by_size, size << _SHIFT)
        if i == len(by_size):
            raise NoRoom(f"no free extent of {size} bytes ({self.free_bytes} bytes free in "
                           f"{len(by_size)} extents, largest {self.largest_free})")
        item = by_size.pop(i)
        extent, start = item >> _SHIFT, item & _START_MASK
        del self._by_start[start]
        del self._by_end[start + extent]
        if extent > size:
            self._insert(start + size, extent - size)
        self.used += size
        return start, size

    def release(self, start: int, size: int) -> None:
        """Return an extent from :meth:`allocate`, merging it with free neighbours."""
        self.used -= size
        end = start + size
        prev = self._by_end.get(start)
        if prev is not None:
            prev_size = self._by_start[prev]
            self._remove(prev, prev_size)
            start, size = prev, size + prev_size
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            size += next_size
        self._insert(start, size)

    def _insert(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        insort(self._by_size, size << _SHIFT | start)

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        by_size = self._by_size
        del by_size[bisect_left(by_size, size << _SHIFT | start)]


class SlotAllocator:
    """Fixed ``slot_bytes`` slots in ``[0, capacity)`` (capacity rounded down to whole
    slots), lowest address first, with the interface of :class:`ExtentAllocator`;
    :meth:`allocate` raises NoRoom for a block larger than a slot or when every slot
    is taken."""

    def __init__(self, capacity: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.capacity = capacity - capacity % slot_bytes
        self.used = 0
        self._free = list(range(self.capacity - slot_bytes, -1, -slot_bytes))  # pop() -> lowest

    def round_up(self, nbytes: int) -> int:
        return self.slot_bytes

    @property
    def largest_free(self) -> int:
        return self.slot_bytes if self._free else 0

    def can_allocate(self, nbytes: int) -> bool:
        return 0 <= nbytes <= self.slot_bytes and bool(self._free)

    def allocate(self, nbytes: int) -> tuple[int, int]:
        if nbytes > self.slot_bytes:
            raise NoRoom(f"a {nbytes}-byte block does not fit a {self.slot_bytes}-byte slot")
        if not self._free:
            raise NoRoom(f"all {self.capacity // self.slot_bytes} slots are taken")
        self.used += self.slot_bytes
        return self._free.pop(), self.slot_bytes

    def release(self, start: int, size: int) -> None:
        self.used -= size
        self._free.append(start)


__all__ = ["ExtentAllocator", "SlotAllocator"]
