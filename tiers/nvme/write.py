"""Writing a block file of the NVMe tier (format: :mod:`tiers.nvme.format`).

A reservation's chunks arrive in order through :meth:`BlockWriter.write`; each is hashed
per checksum chunk as it passes and written at ``H + offset``; :meth:`BlockWriter.finish`
writes the zero padding and then the header (with the checksums) at offset 0. The tier
then renames the temp file to its final name, so a file carrying a block's name always
has a complete header and payload.

Fast path: a block written in one call (the host arena demoting a block, a whole gRPC
put) is hashed first and written with its header in ONE ``pwritev``: straight from the
caller's memory when it is page aligned (or with buffered I/O), else through one
pooled bounce buffer (blocks up to :data:`WHOLE_BOUNCE_BYTES`).

Streaming path under O_DIRECT: page-aligned caller memory is written directly; other
bytes are staged in a pooled page-aligned buffer of at most :data:`STAGE_BYTES` and
written whenever it fills.
"""

from __future__ import annotations

import time

import xxhash

from tiers.nvme.format import (
    PAGE,
    ceil_page,
    chunk_sums,
    encode_header,
    file_bytes,
    floor_page,
    header_bytes,
    num_chunks,
)
from tiers.nvme.files import AlignedBuffer, BufferPool, copy_bytes, page_aligned, pwritev_all

STAGE_BYTES = 4 << 20
"""Largest staging buffer one streamed O_DIRECT write goes through (bytes)."""

WHOLE_BOUNCE_BYTES = 16 << 20
"""Largest unaligned single-call block copied to one bounce buffer and written with its
header in one call (bytes); larger ones are streamed."""

_ZEROS = memoryview(bytes(PAGE))


class PendingBlock:
    """An open reservation of ``size`` payload bytes with checksum chunks of ``chunk``
    bytes: ``disk`` bytes of capacity, ``written`` bytes received, the temp file ``fd``
    (-1 until opened), the chunk checksums so far, and under O_DIRECT the staging buffer
    holding ``tail`` bytes not yet written at ``file_off``. ``reused`` is the size of
    the spare file taken (-1: a new file); ``spare``: the spare file ``(path, bytes)``
    set aside for it at reservation, not yet opened (None: none); ``temp``: the file
    written until the commit renames it to ``path`` (the spare file itself, or
    ``<path>.tmp``; "" until opened); ``done``: payload and header are on disk;
    ``path``: the block's final file name."""

    __slots__ = ("key", "path", "size", "chunk", "header_len", "disk", "written", "fd", "reused", "sums",
                 "hasher", "fill", "stage", "tail", "file_off", "done", "written_at", "spare", "temp", "io",
                 "dropped", "sealed", "parked", "stale", "awaits")

    def __init__(self, key: bytes, size: int, chunk: int, path: str = ""):
        self.key = key
        self.path = path                # the block's final file name
        self.size = size
        self.chunk = chunk
        self.header_len = header_bytes(size, chunk)
        self.disk = file_bytes(size, chunk)
        self.written = 0
        self.fd = -1
        self.reused = -1
        self.sums: list[int] = []
        self.hasher = xxhash.xxh3_64()
        self.fill = 0                   # bytes of the current chunk fed to hasher
        self.stage: AlignedBuffer | None = None
        self.tail = 0
        self.file_off = self.header_len
        self.done = False
        self.written_at = 0.0
        self.spare: tuple[str, int] | None = None
        self.temp = ""
        self.io = 0                     # threads writing or committing it now
        self.dropped = False            # aborted: its files go when ``io`` is back to 0
        self.sealed = False             # its commit is publishing it: an abort comes too late
        self.parked = None              # the evicted block's file it claimed (tiers.nvme.parked.Parked)
        self.stale: list[bytes] = []    # their keys, once moved: index entries its commit drops
        self.awaits: bytes | None = None   # the key of a claimed file taken from it (moving: wait)


class BlockWriter:
    """Writes block files for one tier: ``direct`` says whether files are open with
    O_DIRECT; buffers come from ``pool``."""

    def __init__(self, direct: bool, pool: BufferPool):
        self.direct = direct
        self.pool = pool

    # ------------------------------------------------------------------ hashing

    def _hash(self, p: PendingBlock, view: memoryview) -> None:
        """Feed ``view`` (the next bytes of the payload) to the chunk checksums."""
        n, pos, c = view.nbytes, 0, p.chunk
        if p.fill:
            chunk_len = min(c, p.size - len(p.sums) * c)
            take = min(chunk_len - p.fill, n)
            p.hasher.update(view[:take])
            p.fill += take
            pos = take
            if p.fill == chunk_len:
                p.sums.append(p.hasher.intdigest())
                p.hasher.reset()
                p.fill = 0
        if pos >= n:
            return
        whole = (n - pos) // c * c
        if whole:
            p.sums.extend(chunk_sums(view[pos:pos + whole], c))
            pos += whole
        if pos < n:
            rest = view[pos:]
            if rest.nbytes == min(c, p.size - len(p.sums) * c):      # the block's short last chunk
                p.sums.append(xxhash.xxh3_64_intdigest(rest))
            else:
                p.hasher.update(rest)
                p.fill = rest.nbytes

    # ------------------------------------------------------------------ writing

    def write(self, p: PendingBlock, offset: int, view: memoryview) -> None:
        """Write the chunk ``view`` at payload ``offset`` (the caller checked the order and
        already counted it in ``p.written``). Raises OSError."""
        if offset == 0 and view.nbytes == p.size and p.size:
            if not self.direct or page_aligned(view) or p.size <= WHOLE_BOUNCE_BYTES:
                self._write_whole(p, view)
                return
        self._hash(p, view)
        if not self.direct:
            pwritev_all(p.fd, [view], p.header_len + offset)
            if p.written == p.size and p.size % PAGE:
                pwritev_all(p.fd, [_ZEROS[:ceil_page(p.size) - p.size]], p.header_len + p.size)
            return
        self._stage(p, view)

    def _write_whole(self, p: PendingBlock, view: memoryview) -> None:
        """The whole payload in one call: checksums, then header + payload in one write."""
        p.sums = chunk_sums(view, p.chunk)
        p.written_at = time.time()
        h, size = p.header_len, p.size
        pad = ceil_page(size) - size
        if not self.direct or page_aligned(view):
            body = floor_page(size) if self.direct else size
            buf = self.pool.lease(h + PAGE)
            try:
                encode_header(buf.view, p.key, size, p.chunk, p.written_at, p.sums)
                iov = [buf.view[:h], view[:body]]
                if self.direct and body < size:        # last partial page, zero padded
                    tail = buf.view[h:h + PAGE]
                    copy_bytes(tail[:size - body], view[body:])
                    tail[size - body:] = _ZEROS[:PAGE - (size - body)]
                    iov.append(tail)
                elif pad:
                    iov.append(_ZEROS[:pad])
                pwritev_all(p.fd, iov, 0)
            finally:
                self.pool.release(buf)
        else:                                          # unaligned under O_DIRECT: one bounce copy
            buf = self.pool.lease(h + size + pad)
            try:
                encode_header(buf.view, p.key, size, p.chunk, p.written_at, p.sums)
                copy_bytes(buf.view[h:h + size], view)
                buf.view[h + size:h + size + pad] = _ZEROS[:pad]
                pwritev_all(p.fd, [buf.view[:h + size + pad]], 0)
            finally:
                self.pool.release(buf)
        p.file_off = h + size + pad
        p.done = True

    def _stage(self, p: PendingBlock, src: memoryview) -> None:
        """O_DIRECT streaming: write page-aligned caller memory directly, stage the rest,
        and once the block is complete write the zero-padded last page."""
        pos, n = 0, src.nbytes
        if p.tail == 0 and n >= PAGE and page_aligned(src):
            body = floor_page(n)
            pwritev_all(p.fd, [src[:body]], p.file_off)
            p.file_off += body
            pos = body
        if pos < n and p.stage is None:
            p.stage = self.pool.lease(min(ceil_page(p.size), STAGE_BYTES))
        while pos < n:
            buf, cap = p.stage.view, p.stage.size
            take = min(n - pos, cap - p.tail)
            copy_bytes(buf[p.tail:p.tail + take], src[pos:pos + take])
            p.tail += take
            pos += take
            if p.tail == cap:
                pwritev_all(p.fd, [buf[:cap]], p.file_off)
                p.file_off += cap
                p.tail = 0
        if p.written == p.size and p.tail:
            end = ceil_page(p.tail)
            p.stage.view[p.tail:end] = _ZEROS[:end - p.tail]
            pwritev_all(p.fd, [p.stage.view[:end]], p.file_off)
            p.file_off += end
            p.tail = 0

    def finish(self, p: PendingBlock) -> None:
        """Write the header (with the checksums) once the whole payload is on disk.
        Raises OSError."""
        if p.done:
            return
        if p.fill:                                     # unreachable: the last chunk closes at size
            raise AssertionError("chunk checksums incomplete")
        assert len(p.sums) == num_chunks(p.size, p.chunk)
        p.written_at = time.time()
        buf = self.pool.lease(p.header_len)
        try:
            encode_header(buf.view, p.key, p.size, p.chunk, p.written_at, p.sums)
            pwritev_all(p.fd, [buf.view[:p.header_len]], 0)
        finally:
            self.pool.release(buf)
        self.release(p)
        p.done = True

    def release(self, p: PendingBlock) -> None:
        """Return the reservation's staging buffer to the pool."""
        if p.stage is not None:
            self.pool.release(p.stage)
            p.stage = None


__all__ = ["BlockWriter", "PendingBlock", "STAGE_BYTES", "WHOLE_BOUNCE_BYTES"]
