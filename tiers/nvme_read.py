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

from typing import Sequence

import xxhash

from .errors import BlockCorrupt
from .nvme_format import PAGE, HeaderError, IndexEntry, ceil_page, decode_header, floor_page
from .nvme_io import AlignedBuffer, BufferPool, buffer_address, copy_bytes, preadv_full


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


def read_block(fd: int, key: bytes, entry: IndexEntry, out: memoryview,
               ranges: Sequence[tuple[int, int]] | None, *, direct: bool, pool: BufferPool,
               what: str) -> int:
    """Read ``ranges`` of a block (all of it when None) from its open file ``fd`` into
    ``out`` (concatenated, from its start), verifying the header and every chunk read.

    Args:
        entry: the index entry (size, chunk size) the header must agree with.
        out: writable byte view of at least the ranges' total length.
        direct: ``fd`` is open with O_DIRECT.
        what: names the block in error messages.
    Returns:
        bytes read from the file (header and chunks, page-rounded under O_DIRECT).
    Raises:
        BlockCorrupt: bad header, a chunk failing its checksum, or a truncated file
            (``out`` may hold some of the bad bytes).
        OSError: the read failed.
    """
    size, chunk, hlen = entry.size, entry.chunk_bytes, entry.header_bytes
    spans = plan_spans(size, chunk, ranges)
    base = buffer_address(out) if (direct and out.nbytes) else 0
    need = hlen
    for s in spans:
        length = s.end - s.start
        s.direct = _tiles(s) and (not direct or (base + s.pieces[0][2]) % PAGE == 0)
        if not s.direct:
            need += ceil_page(length)
        elif direct and length % PAGE:
            need += PAGE
    buf: AlignedBuffer = pool.lease(need)
    try:
        return _read_spans(fd, key, entry, out, spans, buf, direct=direct, what=what)
    finally:
        pool.release(buf)


def _read_spans(fd: int, key: bytes, entry: IndexEntry, out: memoryview, spans: list[_Span],
                buf: AlignedBuffer, *, direct: bool, what: str) -> int:
    size, chunk, hlen = entry.size, entry.chunk_bytes, entry.header_bytes
    header = buf.view[:hlen]
    free = hlen                                          # next unused byte of buf
    total = 0
    plans = []
    for s in spans:
        length = s.end - s.start
        iov: list[memoryview] = []
        if s.direct:
            pos0 = s.pieces[0][2]
            body = floor_page(length) if direct else length
            pieces = [(s.start, out[pos0:pos0 + body])]
            iov.append(pieces[0][1])
            if body < length:                            # O_DIRECT: the payload's last partial page
                tail = buf.view[free:free + PAGE]
                free += PAGE
                iov.append(tail)
                pieces.append((s.start + body, tail[:length - body]))
        else:
            room = ceil_page(length) if direct else length
            bounce = buf.view[free:free + room]
            free += room
            iov.append(bounce)
            pieces = [(s.start, bounce[:length])]
        plans.append((s, iov, pieces))
    got_header, header_got = False, 0
    short = ""                                           # reported after the header's own verdict
    for s, iov, pieces in plans:
        offset = hlen + s.start
        if s.start == 0 and not got_header:              # header and first span in one preadv
            iov, offset, got_header = [header] + iov, 0, True
        wanted = sum(v.nbytes for v in iov)
        got = preadv_full(fd, iov, offset, direct)
        total += got
        if offset == 0:
            header_got = min(got, hlen)
        if got < wanted - (ceil_page(s.end - s.start) - (s.end - s.start) if direct else 0) and not short:
            short = f"{what} is truncated: the file ends {got} bytes after offset {offset}, {wanted} expected"
    if not got_header:
        header_got = preadv_full(fd, [header], 0, direct)
        total += header_got
    if header_got < hlen:
        raise BlockCorrupt(f"{what} is truncated: {header_got} of {hlen} header bytes")
    try:
        hdr = decode_header(header, key)
    except HeaderError as e:
        raise BlockCorrupt(f"{what}: {e}") from None
    if short:
        raise BlockCorrupt(short)
    if hdr.size != size or hdr.chunk_bytes != chunk:
        raise BlockCorrupt(f"{what}: the header says {hdr.size} bytes in {hdr.chunk_bytes}-byte chunks, "
                           f"the index {size} in {chunk}")
    for s, _, pieces in plans:
        bad = _verify(pieces, s, chunk, size, hdr.sums)
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
    return total


__all__ = ["plan_spans", "read_block"]
