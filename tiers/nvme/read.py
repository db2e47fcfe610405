"""Reading a block file of the NVMe tier: only the chunks the requested ranges need,
each verified against the header's checksums before a byte of it is served.

A read is planned as *spans*: runs of consecutive chunks that cover the requested byte
ranges (ranges whose chunks touch share a span, so one ``preadv`` reads them). A span
whose ranges tile it and land contiguously in the caller's buffer is read straight into
that buffer (O_DIRECT: when the buffer position is page aligned; the last partial page
of the payload goes through a one-page bounce); other spans are read into a pooled
bounce buffer, verified, and only the requested bytes are copied out. The header is
read in the same ``preadv`` as the first span when that span starts the payload, else
by one page-aligned read of its own.

Bytes read from the disk per read: the header (H bytes) plus the spans' chunks, rounded
up to pages; :func:`read_block` returns that count so the tier can report read
amplification.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import xxhash

from tiers.errors import BlockCorrupt
from tiers.nvme.format import PAGE, HeaderError, IndexEntry, ceil_page, decode_header, floor_page
from tiers.nvme.files import AlignedBuffer, BufferPool, ReadThreads, buffer_address, copy_bytes, preadv_full



@dataclass(frozen=True)
class ReadCounters:
    """Reads since an NVMe tier opened: ``reads`` calls, ``bytes_served`` to callers,
    ``bytes_read`` from the files (headers and whole chunks included)."""

    reads: int
    bytes_served: int
    bytes_read: int

class _Span:
    """Chunks ``[c0, c1)``: payload bytes ``[start, end)``; ``pieces`` are the requested
    ranges in it as ``(payload offset, length, position in out)``."""

    __slots__ = ("c0", "c1", "start", "end", "pieces", "direct")

    def __init__(self, c0: int, c1: int, piece: tuple[int, int, int]):
        self.c0, self.c1, self.pieces = c0, c1, [piece]
        self.start = self.end = 0
        self.direct = False


def plan_spans(size: int, chunk: int, ranges: Sequence[tuple[int, int]] | None) -> list[_Span]:
    """Spans covering ``ranges`` (all of the payload when None/empty), in file order.
    Ranges must already be checked to lie inside the payload."""
    items, pos = [], 0
    for off, n in (ranges or [(0, size)]):
        if n:
            items.append((off, n, pos))
        pos += n
    items.sort()
    spans: list[_Span] = []
    for off, n, pos in items:
        c0, c1 = off // chunk, -(-(off + n) // chunk)
        if spans and c0 <= spans[-1].c1:
            spans[-1].c1 = max(spans[-1].c1, c1)
            spans[-1].pieces.append((off, n, pos))
        else:
            spans.append(_Span(c0, c1, (off, n, pos)))
    for s in spans:
        s.start, s.end = s.c0 * chunk, min(s.c1 * chunk, size)
    return spans


def _tiles(span: _Span) -> bool:
    """True when the span's ranges cover it exactly, in order, contiguous in ``out``."""
    at, out_at = span.start, span.pieces[0][2]
    for off, n, pos in span.pieces:
        if off != at or pos != out_at:
            return False
        at, out_at = off + n, pos + n
    return at == span.end


def _verify(pieces: list[tuple[int, memoryview]], span: _Span, chunk: int, size: int,
            sums: Sequence[int]) -> int:
    """Check the span's chunks, whose bytes are ``pieces`` ``(payload offset, view)`` in
    order; return the index of the first bad chunk, or -1."""
    digest = xxhash.xxh3_64_intdigest
    partial = None                                       # a chunk split over two pieces
    for p_off, view in pieces:
        p_end = p_off + view.nbytes
        pos = p_off
        if partial is not None:                          # finish the chunk begun in the last piece
            i = pos // chunk
            ce = min((i + 1) * chunk, size)
            partial.update(view[:ce - pos])
            if partial.intdigest() != sums[i]:
                return i
            partial, pos = None, ce
            if pos >= p_end:                             # the piece ended with that chunk
                continue
        first = -(-pos // chunk)                         # whole chunks inside this piece
        last = p_end // chunk if p_end < size else -(-size // chunk)
        if pos < first * chunk:                          # cannot happen: pieces start on chunks
            return pos // chunk
        if last > first:
            base = first * chunk - p_off
            got = [digest(view[base + k * chunk:base + (k + 1) * chunk]) for k in range(last - first)]
            want = sums[first:last]
            if tuple(got) != tuple(want):
                return first + next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            pos = min(last * chunk, size)
        if pos < p_end:                                  # a chunk that continues in the next piece
            partial = xxhash.xxh3_64(view[pos - p_off:])
    if partial is not None:
        return pos // chunk
    return -1


class HeaderCache:
    """Chunk checksums of recently written or read blocks, so a read of a cached block
    skips reading and decoding its header. An LRU bounded in bytes (about 40 bytes per
    checksum); thread-safe. The checksums still verify every byte served: a file changed
    under a cached entry fails them."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, tuple[int, int, tuple[int, ...]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(sums: tuple[int, ...]) -> int:
        return 160 + 40 * len(sums)

    def get(self, key: bytes, size: int, chunk: int) -> tuple[int, ...] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != size or item[1] != chunk:
                return None
            self._items.move_to_end(key)
            return item[2]

    def put(self, key: bytes, size: int, chunk: int, sums: tuple[int, ...]) -> None:
        cost = self._cost(sums)
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= self._cost(old[2])
            self._items[key] = (size, chunk, sums)
            self._bytes += cost
            while self._bytes > self.max_bytes:
                _, (_, _, gone) = self._items.popitem(last=False)
                self._bytes -= self._cost(gone)

    def drop(self, key: bytes) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= self._cost(old[2])


def read_block(fd: int, key: bytes, entry: IndexEntry, out: memoryview,
               ranges: Sequence[tuple[int, int]] | None, *, direct: bool, pool: BufferPool,
               what: str, sums: tuple[int, ...] | None = None,
               threads: ReadThreads | None = None) -> tuple[int, tuple[int, ...] | None]:
    """Read ``ranges`` of a block (all of it when None) from its open file ``fd`` into
    ``out`` (concatenated, from its start), verifying every chunk read.

    Args:
        entry: the index entry (size, chunk size) the header must agree with.
        out: writable byte view of at least the ranges' total length.
        direct: ``fd`` is open with O_DIRECT.
        what: names the block in error messages.
        sums: the block's chunk checksums when known (:class:`HeaderCache`); otherwise
            the header is read and verified (magic, checksum, key, size).
        threads: issue the reads of separate spans together on these threads.
    Returns:
        ``(bytes read from the file, the header's checksums or None when sums was given)``;
        the bytes count headers and whole chunks, page-rounded under O_DIRECT.
    Raises:
        BlockCorrupt: bad header, a chunk failing its checksum, or a truncated file
            (``out`` may hold some of the bad bytes).
        OSError: the read failed.
    """
    size = entry.size
    base = buffer_address(out) if (direct and out.nbytes) else 0
    if sums is not None and not ranges and size and base % PAGE == 0:
        return _read_whole(fd, entry, out, pool, direct, what, sums), None
    spans = plan_spans(size, entry.chunk_bytes, ranges)
    need = 0 if sums is not None else entry.header_bytes
    for s in spans:
        length = s.end - s.start
        s.direct = _tiles(s) and (not direct or (base + s.pieces[0][2]) % PAGE == 0)
        if not s.direct:
            need += ceil_page(length)
        elif direct and length % PAGE:
            need += PAGE
    buf = pool.lease(need) if need else None
    try:
        return _read_spans(fd, key, entry, out, spans, buf, direct=direct, what=what, sums=sums,
                           threads=threads if len(spans) > 1 else None)
    finally:
        if buf is not None:
            pool.release(buf)


def _read_whole(fd: int, entry: IndexEntry, out: memoryview, pool: BufferPool, direct: bool, what: str,
                sums: tuple[int, ...]) -> int:
    """The common case, kept short: a whole block whose checksums are cached, read straight
    into ``out`` (page aligned under O_DIRECT; the last partial page through a bounce)."""
    size, chunk = entry.size, entry.chunk_bytes
    body = floor_page(size) if direct else size
    buf = pool.lease(PAGE) if body < size else None
    try:
        pieces = [(0, out[:body])]
        iov = [pieces[0][1]]
        if buf is not None:
            iov.append(buf.view[:PAGE])
            pieces.append((body, buf.view[:size - body]))
        got = preadv_full(fd, iov, entry.header_bytes, direct)
        if got < size:
            raise BlockCorrupt(f"{what} is truncated: {got} of {size} payload bytes on disk")
        span = _Span(0, len(sums), (0, size, 0))
        span.end = size
        bad = _verify(pieces, span, chunk, size, sums)
        if bad >= 0:
            raise BlockCorrupt(f"{what} fails its checksum in chunk {bad} "
                               f"(bytes {bad * chunk}-{min((bad + 1) * chunk, size)})")
        if buf is not None:
            copy_bytes(out[body:size], pieces[1][1])
        return got
    finally:
        if buf is not None:
            pool.release(buf)


def _read_spans(fd: int, key: bytes, entry: IndexEntry, out: memoryview, spans: list[_Span],
                buf: AlignedBuffer | None, *, direct: bool, what: str, sums: tuple[int, ...] | None,
                threads: ReadThreads | None) -> tuple[int, tuple[int, ...] | None]:
    size, chunk = entry.size, entry.chunk_bytes
    hlen = 0 if sums is not None else entry.header_bytes
    header = buf.view[:hlen] if hlen else None
    free = hlen                                          # next unused byte of buf
    total = 0
    plans = []
    for s in spans:
        length = s.end - s.start
        if s.direct:
            pos0 = s.pieces[0][2]
            body = floor_page(length) if direct else length
            pieces = [(s.start, out[pos0:pos0 + body])]
            iov = [pieces[0][1]]
            if body < length:                            # O_DIRECT: the payload's last partial page
                tail = buf.view[free:free + PAGE]
                free += PAGE
                iov.append(tail)
                pieces.append((s.start + body, tail[:length - body]))
        else:
            room = ceil_page(length) if direct else length
            bounce = buf.view[free:free + room]
            free += room
            iov = [bounce]
            pieces = [(s.start, bounce[:length])]
        plans.append((s, iov, pieces))
    ios = []
    for s, iov, pieces in plans:
        if s.start == 0 and hlen:                        # header and first span in one preadv
            ios.append(([header] + iov, 0, s))
        else:
            ios.append((iov, entry.header_bytes + s.start, s))
    if hlen and not (spans and spans[0].start == 0):
        ios.append(([header], 0, None))
    done = threads.map(lambda io: preadv_full(fd, io[0], io[1], direct), ios) if threads \
        else [preadv_full(fd, iov, offset, direct) for iov, offset, _ in ios]
    header_got = 0
    short = ""                                           # reported after the header's own verdict
    for (iov, offset, s), got in zip(ios, done):
        total += got
        if offset == 0:
            header_got = min(got, hlen)
        if s is None:
            continue
        wanted = sum(v.nbytes for v in iov)
        if got < wanted - (ceil_page(s.end - s.start) - (s.end - s.start) if direct else 0) and not short:
            short = f"{what} is truncated: the file ends {got} bytes after offset {offset}, {wanted} expected"
    if hlen:
        if header_got < hlen:
            raise BlockCorrupt(f"{what} is truncated: {header_got} of {hlen} header bytes")
        try:
            hdr = decode_header(header, key)
        except HeaderError as e:
            raise BlockCorrupt(f"{what}: {e}") from None
        if hdr.size != size or hdr.chunk_bytes != chunk:
            raise BlockCorrupt(f"{what}: the header says {hdr.size} bytes in {hdr.chunk_bytes}-byte chunks, "
                               f"the index {size} in {chunk}")
        checks = hdr.sums
    else:
        checks = sums
    if short:
        raise BlockCorrupt(short)
    for s, _, pieces in plans:
        bad = _verify(pieces, s, chunk, size, checks)
        if bad >= 0:
            raise BlockCorrupt(f"{what} fails its checksum in chunk {bad} "
                               f"(bytes {bad * chunk}-{min((bad + 1) * chunk, size)})")
        if s.direct:
            if len(pieces) == 2:                         # the tail page: copy its payload bytes out
                start, tail = pieces[1]
                pos = s.pieces[0][2] + start - s.start
                copy_bytes(out[pos:pos + tail.nbytes], tail)
            continue
        bounce = pieces[0][1]
        for off, n, pos in s.pieces:
            copy_bytes(out[pos:pos + n], bounce[off - s.start:off - s.start + n])
    return total, (None if sums is not None else checks)


__all__ = ["HeaderCache", "ReadCounters", "plan_spans", "read_block"]
