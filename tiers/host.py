"""The host tier: blocks in one preallocated host-memory arena.

The arena is a single buffer from :func:`tiers.memory.allocate_host_buffer` (pinned on a
GPU node, pageable otherwise; by default a shared memfd that same-node clients map, see
:mod:`kvstore.common.arena`), allocated once at start; nothing is allocated per block on the hot
path. Blocks are placed by an extent allocator (:class:`tiers.allocator.ExtentAllocator`):
best fit over the free extents, neighbours coalesced on free::

    arena  |blk a |  free  |blk b|blk c|      free       |
           0      ^ start  ^ end                          capacity

Sizes are rounded up to ``alignment`` bytes (64 by default: a cache line), and every
block starts on an ``alignment`` boundary of the arena, whose own start is page aligned.

A shared arena may keep a block table beside it (``block_table``:
:class:`tiers.block_table.BlockTable`) that same-node clients read without asking the
daemon: a block is published there when committed and retired when freed, and the space of
a retired block is reused only once no client that may have found it is still reading
(:meth:`tiers.block_table.BlockTable.reusable`); until then it waits in a short list,
counted in ``used_bytes``.
"""

from __future__ import annotations

import threading
from typing import Iterable

import numpy as np

from tiers.allocator import ExtentAllocator
from tiers.block_table import BlockTable, supported
from tiers.base import Tier, TierKind
from tiers.buffers import ByteRanges, byte_view, check_chunk, check_ranges, output_view
from tiers.capabilities import Capabilities, SegmentInfo
from tiers.errors import BlockExists, BlockNotStored, InvalidAccess, NoRoom
from tiers.host_copy import copy, words_enabled
from tiers.memory import DEFAULT_ALIGNMENT, allocate_host_buffer

_LISTED = -1


class _HostBlock:
    """One block's place in the arena: ``start`` and ``alloc`` (rounded) bytes, ``size``
    payload bytes, ``written`` bytes copied in so far (reservations only)."""

    __slots__ = ("start", "alloc", "size", "written", "tag")

    def __init__(self, start: int, alloc: int, size: int):
        self.start = start
        self.alloc = alloc
        self.size = size
        self.written = 0
        self.tag: int | None = _LISTED      # the block table's epoch tag once unlisted (None: never listed)


class HostTier(Tier):
    """Blocks in one preallocated host-memory arena of ``capacity_bytes`` bytes.

    Args:
        capacity_bytes: arena size in bytes; rounded down to a multiple of ``alignment``
            (that is :attr:`capacity_bytes`).
        name: tier name in logs and stats.
        alignment: block start and size unit in bytes (a power of two, default 64).
        pinned: page-locked memory for DMA to a GPU (needs a GPU build; see
            :func:`tiers.memory.allocate_host_buffer`).
        shared: back the arena by a memfd that same-node clients may map (the
            ``shared`` capability: :meth:`segment`, :meth:`extent`).
        huge_pages: for a shared arena, ``"auto"``, ``"hugetlb"``, ``"thp"`` or ``"off"``
            (:mod:`tiers.memory`); :attr:`huge_pages` says what it got.
        block_table: for a shared arena on x86-64, keep a :class:`~tiers.block_table.BlockTable`
            of its blocks (:attr:`block_table`; None otherwise).

    ``used_bytes`` counts allocated (rounded) bytes of committed blocks and open
    reservations. :meth:`fits` is exact: it accounts for fragmentation.

    Capabilities: ``host`` (zero-copy :meth:`view` / :meth:`write_view`) and, when
    ``shared``, ``shared``.

    Thread safety: the block maps and the allocator are guarded by a lock of this tier;
    the copies into and out of the arena (``write``, ``read_into``) run outside it, so
    several threads may copy different blocks at once.

    Raises ValueError for bad arguments, MemoryError when the arena cannot be allocated.
    """

    kind = TierKind.HOST
    volatile = True

    def __init__(self, capacity_bytes: int, *, name: str = "host", alignment: int = 64,
                 pinned: bool = False, shared: bool = False, huge_pages: str = "off", block_table: bool = False):
        self.name = name
        self._alloc = ExtentAllocator(int(capacity_bytes), alignment)
        self._buffer = allocate_host_buffer(self._alloc.capacity, alignment=max(alignment, DEFAULT_ALIGNMENT),
                                            pinned=pinned, shared=shared, huge_pages=huge_pages)
        self.pinned = self._buffer.pinned
        self.shared = shared
        self.huge_pages = self._buffer.huge_pages
        """The arena's pages: ``"hugetlb"``, ``"thp"`` (advised) or ``""`` (4 KiB)."""
        self._arena = memoryview(self._buffer.array)          # writable, flat uint8
        self._arena_ro = self._arena.toreadonly()
        words_enabled()             # the copy loop is chosen now (a few ms), not on the first get
        self._reserved: dict[bytes, _HostBlock] = {}
        self._blocks: dict[bytes, _HostBlock] = {}
        self._lock = threading.Lock()
        self._caps = Capabilities(host=self, shared=self if shared else None)
        self.block_table = (BlockTable(self._buffer.mapped_bytes or self._buffer.nbytes)   # the size clients map
                            if block_table and shared and supported() else None)
        self._retired: list[tuple[int, int, int]] = []   # (epoch tag, start, alloc)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # -------------------------------------------------------------- accounting

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    @property
    def alignment(self) -> int:
        return self._alloc.alignment

    @property
    def free_extents(self) -> int:
        """Number of free extents (1 when the arena is empty, 0 when it is full)."""
        return self._alloc.num_free_extents

    @property
    def largest_free_extent(self) -> int:
        """Bytes of the largest free extent: the largest block that fits now (rounded)."""
        return self._alloc.largest_free

    @property
    def fragmentation(self) -> float:
        """``1 - largest free extent / free bytes``: 0.0 when all free space is contiguous."""
        free = self._alloc.free_bytes
        return 1.0 - self._alloc.largest_free / free if free else 0.0

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            if self._retired:
                self._reuse_retired()
            return self._alloc.can_allocate(nbytes)

    def _committed(self, key: bytes) -> _HostBlock:
        block = self._blocks.get(key)                 # one dict lookup: atomic
        if block is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        return block

    def _reservation(self, key: bytes) -> _HostBlock:
        block = self._reserved.get(key)
        if block is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
        return block

    def size_of(self, key: bytes) -> int:
        return self._committed(key).size

    def offset_of(self, key: bytes) -> int:
        """Byte offset of a committed block in the arena (for DMA from the arena).

        Raises BlockNotStored."""
        return self._committed(key).start

    def keys(self) -> Iterable[bytes]:
        """Keys of the committed blocks (a snapshot)."""
        with self._lock:
            return list(self._blocks)

    # -------------------------------------------------------------- two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        with self._lock:
            if key in self._blocks or key in self._reserved:
                raise BlockExists(f"block {key.hex()[:16]} already present in {self.name}")
            if self._retired:
                self._reuse_retired()
            try:
                start, alloc = self._alloc.allocate(nbytes)
            except NoRoom as e:
                raise NoRoom(f"{self.name}: {nbytes} bytes do not fit: {e}") from None
            self._reserved[key] = _HostBlock(start, alloc, nbytes)

    def write(self, key: bytes, offset: int, data) -> None:
        src = byte_view(data)
        n = src.nbytes
        with self._lock:
            block = self._reservation(key)
            check_chunk(offset, n, block.written, block.size)
            block.written = offset + n
            start = block.start + offset
        copy(self._buffer.array[start:start + n], np.frombuffer(src, dtype=np.uint8))  # outside the lock

    def write_view(self, key: bytes) -> memoryview:
        """Writable view over a reservation's ``size`` bytes (fill, then :meth:`mark_written`)."""
        with self._lock:
            block = self._reservation(key)
            return self._arena[block.start:block.start + block.size]

    def mark_written(self, key: bytes, nbytes: int) -> None:
        with self._lock:
            block = self._reservation(key)
            if not 0 <= nbytes <= block.size:
                raise InvalidAccess(f"{nbytes} bytes is outside the reserved {block.size} bytes")
            block.written = nbytes

    def commit(self, key: bytes) -> None:
        with self._lock:
            block = self._reservation(key)
            if block.written != block.size:
                raise InvalidAccess(f"block {key.hex()[:16]}: {block.written} of {block.size} bytes written")
            del self._reserved[key]
            self._blocks[key] = block
            if self.block_table is not None:
                self.block_table.publish(key, block.start, block.size)

    def abort(self, key: bytes) -> None:
        with self._lock:
            block = self._reserved.pop(key, None)
            if block is not None:
                self._alloc.release(block.start, block.alloc)

    # -------------------------------------------------------------- read / free

    def read_into(self, key: bytes, out, ranges: ByteRanges | None = None) -> int:
        block = self._committed(key)
        start, size = block.start, block.size
        total = check_ranges(ranges, size)
        dst = np.frombuffer(output_view(out, total), dtype=np.uint8)
        arena = self._buffer.array
        if not ranges:
            copy(dst, arena[start:start + size])
            return size
        pos = 0
        for off, n in ranges:
            copy(dst[pos:pos + n], arena[start + off:start + off + n])
            pos += n
        return total

    def view(self, key: bytes) -> memoryview:
        """Read-only zero-copy view of the block in the arena (valid while the block is pinned)."""
        block = self._committed(key)
        return self._arena_ro[block.start:block.start + block.size]

    def free(self, key: bytes) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
            tag = self._unlist(key, block)
            if tag is None or self.block_table.reusable(tag):
                self._alloc.release(block.start, block.alloc)
            else:                               # a client may be copying it: reused once it is done
                self._retired.append((tag, block.start, block.alloc))

    def unpublish(self, key: bytes) -> None:
        """Take block ``key`` out of the block table now, while it stays stored (it was
        deleted while pinned: no client may find it, its space is freed with its last pin).
        No-op without a table or for a block not stored."""
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._unlist(key, block)

    def _unlist(self, key: bytes, block: _HostBlock) -> int | None:
        """Retire ``block`` from the table once (lock held); its epoch tag (None: never listed)."""
        if block.tag == _LISTED:
            block.tag = self.block_table.retire(key) if self.block_table is not None else None
        return block.tag

    def retired_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit once the freed space that waits for the table's
        readers (at most :data:`~tiers.block_table.STUCK_READER_S` seconds) is reused: free
        space coming, not to evict other blocks for."""
        with self._lock:
            if not self._retired:
                return False
            spans = sorted(self._alloc.free_extents() + [(start, alloc) for _, start, alloc in self._retired])
        need, best, run_start, run_end = self._alloc.round_up(nbytes), 0, -1, -1
        for start, size in spans:                 # coalesce neighbours, as the allocator will
            if start == run_end:
                run_end += size
            else:
                run_start, run_end = start, start + size
            best = max(best, run_end - run_start)
        return best >= need

    def _reuse_retired(self) -> None:
        """Free the retired blocks' space that no reader holds back any more (lock held; a
        reader stopped for :data:`~tiers.block_table.STUCK_READER_S` holds none:
        :meth:`~tiers.block_table.BlockTable.oldest_reader`)."""
        oldest = self.block_table.oldest_reader()
        keep = []
        for item in self._retired:
            if oldest is None or oldest > item[0]:
                self._alloc.release(item[1], item[2])
            else:
                keep.append(item)
        self._retired = keep

    # -------------------------------------------------------------- shared segment

    def segment(self) -> SegmentInfo:
        """The arena's memfd (``shared`` tiers only). Raises InvalidAccess otherwise."""
        if self._buffer.fd < 0:
            raise InvalidAccess(f"{self.name}: the arena is not shared memory")
        return SegmentInfo(self._buffer.fd, self._buffer.mapped_bytes or self._buffer.nbytes, f"memfd:{self.name}")

    def extent(self, key: bytes) -> tuple[int, int]:
        """``(offset, size)`` of a committed block or a reservation in the arena (bytes).
        Takes the lock only on a miss: a dict read is atomic and a block's place never
        changes once made (a lease asks for many extents in a row); a reservation being
        committed meanwhile is found under the lock."""
        block = self._blocks.get(key) or self._reserved.get(key)
        if block is None:
            with self._lock:
                block = self._blocks.get(key) or self._reserved.get(key)
            if block is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not in {self.name}")
        return block.start, block.size

    def close(self) -> None:
        with self._lock:
            if self.block_table is not None:
                self.block_table.close()
            self._blocks.clear()
            self._reserved.clear()
            self._retired.clear()
            self._alloc = ExtentAllocator(0, self._alloc.alignment)
            try:
                self._arena_ro.release()
                self._arena.release()
            except BufferError:   # a caller still holds an export; the memory goes with it
                pass
            self._buffer.close()

    def describe(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        if self.shared:
            kind += ", shared memfd" + (f", {self.huge_pages} huge pages" if self.huge_pages else ", 4 KiB pages")
        return f"{self.name}(host, {self.capacity_bytes} bytes, alignment {self.alignment}, {kind})"
