"""Serving a Get: blocks read piece by piece from their tier into size-limited messages.

A block is read in pieces of at most ``step`` bytes (:meth:`BlockReader.read_into` with
byte ranges, which the medium honours: NVMe reads only those pages), while it stays
pinned, so the daemon's memory per Get is about one message whatever the block size.
Pieces are packed into messages that never exceed ``limit`` bytes, counting framing and
the records of misses: :func:`proto_batches` for ``Get`` (protobuf), :func:`raw_frames`
for ``GetRaw`` (:mod:`kvstore.wire`).

A block that fails while it is being sent (every copy corrupt) gets a ``FAILED`` record
at the offset reached; the client drops what it received of it. Blocks held only in the
cluster are paged into the host arena in one batch before the first piece is read, and
reported with tier ``REMOTE``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterator, Sequence

import numpy as np

from tiers.base import TierKind, check_ranges
from tiers.errors import InvalidAccess

from ._proto import kvstore_pb2 as pb
from .errors import CorruptBlock, InvalidRequest
from .manager import TierManager
from .wire import FAILED, FOUND, FrameBuilder


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


def pieces(plan: GetPlan) -> Iterator[Piece]:
    """Every requested block as pieces, in key order (a miss is one empty piece)."""
    m = plan.manager
    paged = m.reads.page_in([plan.internal(k) for k in plan.keys], prefix=plan.stop_at_miss)
    for key in plan.keys:
        internal = plan.internal(key)
        reader = m.reads.reader(internal, remote=False)
        if reader is None:
            yield Piece(key, 0, 0, 0, 0, b"")
            if plan.stop_at_miss:
                return
            continue
        offset, total, tier = 0, 0, 0
        try:
            try:
                total = check_ranges(plan.ranges, reader.size)
            except InvalidAccess as e:
                raise InvalidRequest(str(e)) from None
            ranges = plan.ranges or [(0, reader.size)]
            starts = [0, *accumulate(n for _, n in ranges)][:-1]
            while offset < total or total == 0:
                n = min(plan.step, total - offset)
                buf = np.empty(n, dtype=np.uint8)
                tier = int(reader.read_into(buf, sub_ranges(ranges, starts, offset, n) if n else [(0, 0)]))
                if internal in paged:
                    tier = int(TierKind.REMOTE)
                yield Piece(key, FOUND, tier, total, offset, buf)
                offset += n
                if total == 0:
                    break
        except CorruptBlock:
            yield Piece(key, FAILED, tier, total, offset, b"")
            if plan.stop_at_miss:
                return
        finally:
            reader.close()


def proto_batches(plan: GetPlan) -> Iterator[pb.GetBatch]:
    """Pieces as ``GetBatch`` messages of at most ``plan.limit`` serialized bytes."""
    batch: list[pb.GetChunk] = []
    size = 0
    for p in pieces(plan):
        if p.flags & FOUND:
            chunk = pb.GetChunk(key=p.key, found=True, tier=p.tier, total_size=p.total, offset=p.offset,
                                data=p.data.tobytes() if isinstance(p.data, np.ndarray) else p.data)
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


def raw_frames(plan: GetPlan) -> Iterator[bytes]:
    """Pieces as raw frames (:mod:`kvstore.wire`) of at most ``plan.limit`` bytes."""
    builder = FrameBuilder(plan.limit)
    for p in pieces(plan):
        if builder and builder.room() < len(p.data):
            yield builder.flush()
        builder.add(p.key, p.flags, p.tier, p.total, p.offset, p.data)
    last = builder.flush()
    if last is not None:
        yield last
