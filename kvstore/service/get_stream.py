"""Serving a Get: blocks read piece by piece from their tier into size-limited messages.

A block is read in pieces of at most ``step`` bytes (:meth:`BlockReader.read_into` with
byte ranges, which the medium honours: NVMe reads only those pages), while it stays
pinned, so the daemon's memory per Get is about one message whatever the block size.
Pieces are packed into messages that never exceed ``limit`` bytes, counting framing and
the records of misses: :func:`proto_batches` for ``Get`` (protobuf), and
:func:`kvstore.service.get_frames.raw_frames` for ``GetRaw`` (:mod:`kvstore.common.wire`),
which reads the same :func:`units` straight into its frames.

A block that fails while it is being sent (every copy corrupt, or every copy's medium
failing for this call: EMFILE, EIO) gets a ``FAILED`` record
at the offset reached; the client drops what it received of it. Blocks held only in the
cluster are paged into the host arena in one batch before the first piece is read, and
reported with tier ``REMOTE``.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterator, Sequence

import numpy as np

from tiers.base import TierKind

from kvstore._proto import kvstore_pb2 as pb
from kvstore.common.errors import CorruptBlock, InvalidRequest, TierIOError
from kvstore.store.manager import TierManager
from kvstore.store.reads import BlockReader
from kvstore.common.wire import FAILED, FOUND


@dataclass
class GetPlan:
    """What one Get asked for (validated)."""

    manager: TierManager
    keys: Sequence[bytes]                   # the client's keys
    internal: Callable[[bytes], bytes]      # client key -> store key
    ranges: list[tuple[int, int]] | None
    stop_at_miss: bool
    step: int                               # most payload bytes per piece
    limit: int                              # most bytes per message


@dataclass
class Piece:
    key: bytes
    flags: int
    tier: int
    total: int
    offset: int
    data: np.ndarray | bytes
    release: Callable[[], None] | None = None

    def done(self) -> None:
        """The piece's bytes were copied into a message: its buffer may be reused."""
        if self.release is not None:
            self.release()
            self.release = None


def sub_ranges(ranges: Sequence[tuple[int, int]], starts: Sequence[int], offset: int, n: int) -> list[tuple[int, int]]:
    """The block byte ranges holding bytes ``[offset, offset + n)`` of the concatenation of
    ``ranges`` (``starts`` are the running totals before each range)."""
    out = []
    i = bisect_right(starts, offset) - 1
    end = offset + n
    while offset < end:
        r_off, r_len = ranges[i]
        within = offset - starts[i]
        take = min(r_len - within, end - offset)
        if take > 0:
            out.append((r_off + within, take))
        offset += take
        i += 1
    return out


class BufferPool:
    """Page-aligned numpy buffers reused across Gets, so a read lands in memory that is
    mapped already (a fresh large allocation faults on every page) and O_DIRECT reads
    need no bounce. Bounded: at most ``max_bytes`` of free buffers are kept."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @staticmethod
    def _class(n: int) -> int:
        return max(4096, 1 << (max(n, 1) - 1).bit_length())

    def take(self, n: int) -> np.ndarray:
        size = self._class(n)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        raw = np.empty(size + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        return raw[start:start + size]

    def give(self, buf: np.ndarray) -> None:
        size = buf.size
        with self._lock:
            if self._kept + size <= self.max_bytes:
                self._free.setdefault(size, []).append(buf)
                self._kept += size


_POOL = BufferPool()
READ_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-readahead")
READAHEAD = 4
"""Pieces (:func:`pieces`) or frames (:func:`kvstore.service.get_frames.raw_frames`)
read ahead of the one being sent, on :data:`READ_POOL` (several reads in flight: NVMe
serves them in parallel, and reads release the GIL)."""


@dataclass
class Unit:
    """One piece to read: ``n`` bytes at ``offset`` of a block's selected bytes (``ranges``
    of the block); ``reader`` None: a miss."""

    key: bytes
    reader: BlockReader | None
    total: int
    offset: int
    n: int
    ranges: list[tuple[int, int]]
    last: bool
    buf: np.ndarray | None = None          # the bytes read (a view of ``pooled``)
    pooled: np.ndarray | None = None
    future: Future | None = None
    paged: bool = False                    # paged in from the cluster for this Get


def units(plan: GetPlan) -> Iterator[Unit]:
    """The pieces to read, in order: one per miss, ``ceil(total / step)`` per block."""
    m = plan.manager
    paged = m.reads.page_in([plan.internal(k) for k in plan.keys], prefix=plan.stop_at_miss)
    for key in plan.keys:
        internal = plan.internal(key)
        reader = m.reads.reader(internal, remote=False)
        if reader is None:
            yield Unit(key, None, 0, 0, 0, [], True)
            continue
        try:
            total = reader.span(plan.ranges)
        except InvalidRequest:             # a block too short for the ranges: a miss, not an error
            reader.close()
            yield Unit(key, None, 0, 0, 0, [], True)
            continue
        ranges = plan.ranges or [(0, reader.size)]
        starts = [0, *accumulate(n for _, n in ranges)][:-1]
        offset = 0
        while True:
            n = min(plan.step, total - offset)
            sub = sub_ranges(ranges, starts, offset, n) if n else [(0, 0)]
            yield Unit(key, reader, total, offset, n, sub, offset + n >= total, paged=internal in paged)
            offset += n
            if offset >= total:
                break


def _read(u: Unit) -> int:
    return int(u.reader.read_into(u.buf, u.ranges))


def pieces(plan: GetPlan) -> Iterator[Piece]:
    """Every requested block as pieces, in key order (a miss is one empty piece), with up
    to :data:`READAHEAD` reads in flight. Each block stays pinned until its last piece is
    sent; a block that fails mid-way gives a FAILED piece and no more of its pieces."""
    todo = units(plan)
    window: deque[Unit] = deque()
    readers: dict[int, BlockReader] = {}       # the open readers (alive: their ids are unique)
    failed: set[int] = set()                   # ids of open readers whose block failed

    def fill() -> None:
        while len(window) <= READAHEAD:
            u = next(todo, None)
            if u is None:
                return
            if u.reader is not None:
                readers[id(u.reader)] = u.reader
                u.pooled = _POOL.take(u.n)
                u.buf = u.pooled[:u.n]
                u.future = READ_POOL.submit(_read, u)
            window.append(u)
            if u.reader is None and plan.stop_at_miss:
                return
    try:
        fill()
        while window:
            u = window.popleft()
            if u.reader is None:
                yield Piece(u.key, 0, 0, 0, 0, b"")
                if plan.stop_at_miss:
                    return
            else:
                try:
                    tier = u.future.result()
                except (CorruptBlock, TierIOError):     # no good copy, or none readable now
                    tier = -1
                if id(u.reader) in failed or tier < 0:
                    if tier < 0 and id(u.reader) not in failed:
                        failed.add(id(u.reader))
                        yield Piece(u.key, FAILED, 0, u.total, u.offset, b"")
                        if plan.stop_at_miss:
                            return
                    _POOL.give(u.pooled)
                else:
                    if u.paged:
                        tier = int(TierKind.REMOTE)
                    yield Piece(u.key, FOUND, tier, u.total, u.offset, u.buf,
                                release=lambda b=u.pooled: _POOL.give(b))
                if u.last:
                    failed.discard(id(u.reader))
                    readers.pop(id(u.reader)).close()
            fill()
    finally:
        end_window(window, readers)


def end_window(window, readers: dict) -> None:
    """A Get's end (done, failed or cancelled): cancel the reads still ahead in ``window``
    (items with a ``future``, None when not read ahead), wait for the ones running, and
    close every block reader still open (which unpins its block)."""
    for u in window:
        if u.future is not None:
            u.future.cancel()
            try:
                u.future.result()
            except Exception:  # noqa: BLE001 - the Get ended; nothing is sent
                pass
    for r in readers.values():
        r.close()


def proto_batches(plan: GetPlan) -> Iterator[pb.GetBatch]:
    """Pieces as ``GetBatch`` messages of at most ``plan.limit`` serialized bytes."""
    batch: list[pb.GetChunk] = []
    size = 0
    for p in pieces(plan):
        if p.flags & FOUND:
            chunk = pb.GetChunk(key=p.key, found=True, tier=p.tier, total_size=p.total, offset=p.offset,
                                data=p.data.tobytes() if isinstance(p.data, np.ndarray) else p.data)
            p.done()
        else:
            chunk = pb.GetChunk(key=p.key, found=False, total_size=p.total, offset=p.offset)
        n = chunk.ByteSize() + 6                       # field tag and length of the repeated entry
        if batch and size + n > plan.limit:
            yield pb.GetBatch(chunks=batch)
            batch, size = [], 0
        batch.append(chunk)
        size += n
    if batch:
        yield pb.GetBatch(chunks=batch)
