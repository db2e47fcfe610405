"""Serving ``GetRaw``: frames planned up front, each block piece read straight into the
message that carries it.

The pieces of a Get (:func:`kvstore.service.get_stream.units`) are packed into frames
(:mod:`kvstore.common.wire`) of at most ``plan.limit`` bytes before anything is read:
a piece's size is known from the catalogue, so a frame's layout is too. A frame's pieces
are read (and verified, as every read is) into an :class:`~kvstore.common.wire.OutFrame`,
the very bytes gRPC sends, so a payload byte is copied once from its tier before gRPC's
own copy (it was copied twice: into a pooled buffer, then into the frame). A frame of
blocks in memory (:data:`MEMORY`) is built by the thread serving the call when it is due;
the others are built on :data:`~kvstore.service.get_stream.READ_POOL`, up to
:data:`~kvstore.service.get_stream.READAHEAD` frames ahead of the one being sent (NVMe
serves several reads at once).

A piece that fails (every copy corrupt, or every copy's medium failing for this call)
becomes a ``FAILED`` record at its offset and the block's later pieces are dropped,
as :func:`kvstore.service.get_stream.pieces` does: the frame holding it is rebuilt
without the bytes that are not sent (rare, so a copy). A block stays pinned until the
frame with its last piece has been handed to gRPC.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterator

from tiers.base import TierKind

from kvstore.common.errors import CorruptBlock, TierIOError
from kvstore.common.wire import FAILED, FOUND, HEADER, RECORD, OutFrame, encode
from kvstore.service.get_stream import READ_POOL, READAHEAD, GetPlan, Unit, end_window, units
from kvstore.store.reads import BlockReader


@dataclass
class _Frame:
    parts: list[Unit]
    payload: int                       # payload bytes, if every piece is read
    tiers: list[int] = field(default_factory=list)   # per part after the build: tier code, -1 failed
    in_memory: bool = True             # every piece's fastest copy is in HBM or host memory
    frame: bytes | None = None
    future: Future | None = None       # the build on READ_POOL (None: built by the caller)


MEMORY = (TierKind.HBM, TierKind.HOST)
"""Tiers whose reads are memory copies: a frame of only those is built by the thread that
sends it, when it is due. A copy has no latency to hide and holds the GIL, so handing it
to a reader thread saves nothing and costs two thread wake-ups per frame (on a 2-core
host, daemon CPU per 256 MiB get of 1 MiB / 4 MiB blocks: 115 / 106 ms built when due,
150 / 141 ms read ahead). Frames with a piece on NVMe or elsewhere are read ahead."""


def _in_memory(plan: GetPlan, u: Unit) -> bool:
    """Whether ``u``'s block is served from memory (a hint: only where it is read)."""
    tiers = u.reader.entry.tiers if u.reader is not None else None
    return not tiers or plan.manager.tiers[tiers[0]].kind in MEMORY


def frame_plans(plan: GetPlan, opened: dict[int, BlockReader]) -> Iterator[_Frame]:
    """The Get's pieces grouped into frames of at most ``plan.limit`` bytes (a frame is
    closed when the next piece would not fit; a piece always fits an empty frame: the
    step is below the limit). With ``stop_at_miss`` nothing is planned after a miss.
    Every reader is put in ``opened`` (by id) as soon as it is open, for the caller to
    close."""
    parts: list[Unit] = []
    used = HEADER.size
    payload = 0
    in_memory = True
    for u in units(plan):
        if u.reader is not None:
            opened[id(u.reader)] = u.reader
        if parts and plan.limit - used - RECORD.size < u.n:
            yield _Frame(parts, payload, in_memory=in_memory)
            parts, used, payload, in_memory = [], HEADER.size, 0, True
        parts.append(u)
        used += RECORD.size + u.n
        payload += u.n
        in_memory = in_memory and _in_memory(plan, u)
        if u.reader is None and plan.stop_at_miss:
            break
    if parts:
        yield _Frame(parts, payload, in_memory=in_memory)


def _tier(u: Unit, got: int) -> int:
    return int(TierKind.REMOTE) if u.paged else got


def new_frame(f: _Frame) -> OutFrame:
    """The memory of ``f``'s frame. Made by the thread serving the call, not by the
    reader that fills it: the frames of a call then come and go in one allocator arena
    that reuses their pages (made in each reader thread's arena, they were handed back
    to the system and faulted in again, costing more than the copy itself)."""
    return OutFrame(HEADER.size + len(f.parts) * RECORD.size + f.payload)


def build(f: _Frame, out: OutFrame) -> _Frame:
    """Read ``f``'s pieces into ``out`` (:func:`new_frame`), then ``f.frame`` is its
    bytes; ``f.tiers`` says per piece the tier code it came from, 0 for a miss, -1 for a
    piece that failed (its bytes in the frame are then undefined)."""
    pos = HEADER.size + len(f.parts) * RECORD.size
    records = []
    for u in f.parts:
        if u.reader is None:
            f.tiers.append(0)
            records.append((u.key, 0, 0, 0, 0, 0))
            continue
        try:
            tier = _tier(u, int(u.reader.read_into(out.array[pos:pos + u.n], u.ranges)))
        except (CorruptBlock, TierIOError):     # no good copy, or none readable now
            tier = -1
        f.tiers.append(tier)
        records.append((u.key, FOUND, max(tier, 0), u.total, u.offset, u.n))
        pos += u.n
    out.write_records(records)
    f.frame = out.finish()
    return f


def _rebuilt(f: _Frame, failed: set[int], stop_at_miss: bool) -> tuple[bytes | None, bool]:
    """``f``'s frame without the pieces of blocks that failed (a FAILED record for the
    first failed piece of each, the reader's id added to ``failed``); and whether the Get
    ends here (``stop_at_miss`` and a block failed)."""
    records = []
    pos = HEADER.size + len(f.parts) * RECORD.size
    view = memoryview(f.frame)
    for u, tier in zip(f.parts, f.tiers):
        data, pos = view[pos:pos + u.n], pos + u.n
        if u.reader is None:
            records.append((u.key, 0, 0, 0, 0, b""))
        elif id(u.reader) in failed:
            continue
        elif tier < 0:
            failed.add(id(u.reader))
            records.append((u.key, FAILED, 0, u.total, u.offset, b""))
            if stop_at_miss:
                return encode(records), True
        else:
            records.append((u.key, FOUND, tier, u.total, u.offset, data))
    return (encode(records) if records else None), False


def raw_frames(plan: GetPlan) -> Iterator[bytes]:
    """The Get's blocks as raw frames of at most ``plan.limit`` bytes, in key order (a
    miss is a record with no flags); frames not :data:`MEMORY` only are read up to
    :data:`READAHEAD` frames ahead."""
    readers: dict[int, BlockReader] = {}       # the open readers (alive: their ids are unique)
    failed: set[int] = set()                   # ids of open readers whose block failed
    todo = frame_plans(plan, readers)
    window: deque[_Frame] = deque()

    def fill() -> None:
        while len(window) <= READAHEAD:
            f = next(todo, None)
            if f is None:
                return
            if not f.in_memory:
                f.future = READ_POOL.submit(build, f, new_frame(f))
            window.append(f)
    try:
        fill()
        while window:
            f = window.popleft()
            if f.future is None:
                build(f, new_frame(f))
            else:
                f.future.result()
            frame, end = f.frame, False
            if min(f.tiers) < 0 or (failed and any(id(u.reader) in failed for u in f.parts if u.reader)):
                frame, end = _rebuilt(f, failed, plan.stop_at_miss)
            f.frame = None
            if frame is not None:
                yield frame
            if end:
                return
            for u in f.parts:
                if u.reader is not None and u.last:
                    failed.discard(id(u.reader))
                    readers.pop(id(u.reader)).close()
            fill()
    finally:
        todo.close()
        end_window(window, readers)
