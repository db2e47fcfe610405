"""Host memory copies of KV blocks that stay at memory speed where glibc's ``memcpy`` does not.

On some x86 CPUs (measured on an AMD EPYC with ERMS and FSRM, glibc 2.36) a ``memcpy`` of
16 KiB up to about 1 MiB whose destination lies 1-31 bytes past its source modulo 4 KiB runs
at 2.5 GB/s instead of 10-12 GB/s (``rep movsb`` and 4 KiB aliasing). That is the case of a
block copied from the page-aligned shared arena into a numpy buffer, whose data start 16
bytes into a page. A numpy ufunc loop over 8-byte words (``np.positive`` on uint64 views: an
exact copy of the bits) has no such case: 9.4-9.6 GB/s at any offset there.

Whether this machine has the slow case is measured once, on first use (a few ms): 128
copies of 32 KiB to a destination 16 bytes past the source modulo 4 KiB against the same
copies 64 bytes past. Where the first is more than twice as slow, the copies of
:data:`MIN_BYTES` up to :data:`MAX_BYTES` whose length is a multiple of 8 and whose
distance is in that window take the word loop; every other copy is ``np.copyto``.
``KVSTORE_HOST_COPY=memcpy`` or ``=words`` forces either (``auto``: measure, the default).
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Sequence

import numpy as np

MIN_BYTES = 16 << 10
"""Copies shorter than this are ``np.copyto`` (the call overhead is the same either way)."""

MAX_BYTES = 1 << 20
"""... and copies of this many bytes or more (``memcpy`` leaves ``rep movsb`` above about this)."""

ALIAS_WINDOW = 32
"""A destination 1 to this many bytes (less one) past its source modulo 4 KiB is the slow case
(measured slow at 8, 16 and 24 bytes; at memory speed at 32, 40, 48 and more)."""

_words: bool | None = None


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte."""
    return a.__array_interface__["data"][0]


def probe(size: int = 32 << 10, pieces: int = 128, reps: int = 3) -> tuple[float, float]:
    """The fastest of ``reps`` rounds of ``pieces`` ``memcpy`` copies of ``size`` bytes each
    (distinct places of two buffers on 4 KiB pages) to a destination 16 bytes past the source
    modulo 4 KiB, and of the same copies 64 bytes past (seconds per round, interleaved): the
    measurement behind :func:`words_enabled`. 4 MiB each way, so the copies run from memory."""
    total = size * pieces + 4096
    maps = [mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(2)]
    try:
        for m in maps:
            try:
                m.madvise(mmap.MADV_NOHUGEPAGE)
            except (AttributeError, OSError):
                pass
        src, dst = (np.frombuffer(m, dtype=np.uint8) for m in maps)
        src[:] = 1
        dst[:] = 0
        near, far = [], []
        for _ in range(reps):
            for shift, out in ((16, near), (64, far)):
                t0 = time.perf_counter()
                for j in range(pieces):
                    np.copyto(dst[shift + j * size:shift + (j + 1) * size], src[j * size:(j + 1) * size])
                out.append(time.perf_counter() - t0)
        del src, dst
    finally:
        for m in maps:
            m.close()
    return min(near), min(far)


def words_enabled() -> bool:
    """Whether the slow case takes the word loop here (``KVSTORE_HOST_COPY``, else measured
    once by :func:`probe`)."""
    global _words
    if _words is None:
        mode = os.environ.get("KVSTORE_HOST_COPY", "auto").strip().lower()
        if mode in ("memcpy", "words"):
            _words = mode == "words"
        else:
            near, far = probe()
            _words = near > 2.0 * far
    return _words




def copy(dst: np.ndarray, src: np.ndarray, dst_addr: int | None = None, src_addr: int | None = None) -> None:
    """``dst[:] = src`` for 1-D C-contiguous uint8 arrays of the same length (bytes), at memory
    speed whatever the CPU's ``memcpy`` does with the two addresses (see the module).
    ``dst_addr`` / ``src_addr``: the arrays' addresses when the caller knows them (else
    looked up, about 1.5 us each, and only where the machine has the slow case). The GIL is released for large copies either way.
    Raises ValueError when the lengths differ."""
    n = src.size
    if dst.size != n:
        raise ValueError(f"copy of {n} bytes into {dst.size}")
    if ((_words if _words is not None else words_enabled()) and MIN_BYTES <= n < MAX_BYTES and not n & 7
            and 0 < ((address(dst) if dst_addr is None else dst_addr)
                     - (address(src) if src_addr is None else src_addr)) % 4096 < ALIAS_WINDOW):
        np.positive(src.view(np.uint64), out=dst.view(np.uint64))     # the slow case: the word loop
    else:
        np.copyto(dst, src)


def copy_spans(dst: np.ndarray, dst_offsets: Sequence[int], src: np.ndarray, src_offsets: Sequence[int],
               sizes: Sequence[int]) -> None:
    """Copy ``sizes[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]`` for
    every ``i`` (1-D uint8 arrays; offsets and sizes in bytes), as :func:`copy` does, with
    the two arrays' addresses looked up once (only where the machine has the slow case).
    Spans that continue the previous one in both arrays are copied with it, in one call (the
    blocks of one put usually lie back to back in the arena: 128 x 32 KiB took 0.37 ms as
    128 copies, 0.29 ms as one). Raises ValueError for a span outside either."""
    words = _words if _words is not None else words_enabled()
    d0, s0 = (address(dst), address(src)) if words else (0, 0)
    for d, s, n in _runs(dst_offsets, src_offsets, sizes):
        if d < 0 or s < 0 or n < 0 or d + n > dst.size or s + n > src.size:
            raise ValueError(f"span of {n} bytes at {s} -> {d} outside {src.size} -> {dst.size} bytes")
        if words:
            copy(dst[d:d + n], src[s:s + n], d0 + d, s0 + s)
        else:
            np.copyto(dst[d:d + n], src[s:s + n])


def copy_slots(dst: np.ndarray, src: np.ndarray, src_offsets: Sequence[int] | np.ndarray, stride: int) -> None:
    """Copy ``len(src_offsets)`` blocks of ``stride`` bytes each from ``src[src_offsets[j]:]``
    into slot ``j`` of ``dst`` (``dst[j * stride:(j + 1) * stride]``), as :func:`copy` does
    (1-D uint8 arrays; offsets and stride in bytes). Blocks that lie back to back in ``src``
    are copied in one call; the runs are found in numpy (a block table's find hands its
    offsets as an int64 array: 128 blocks in about 5 us, against about 40 us for the spans
    of :func:`copy_spans` built from lists). Raises ValueError for a block outside either."""
    try:
        offs = np.asarray(src_offsets, dtype=np.int64).reshape(-1)
    except (OverflowError, ValueError, TypeError) as e:      # not offsets of any buffer
        raise ValueError(f"block offsets not 64-bit offsets: {e}") from None
    n = offs.size
    if not n:
        return
    lo, hi = int(offs.min()), int(offs.max())
    if stride < 0 or lo < 0 or hi + stride > src.size or n * stride > dst.size:
        raise ValueError(f"{n} blocks of {stride} bytes at {lo}..{hi} outside {src.size} -> {dst.size} bytes")
    bounds = [0, *(np.flatnonzero(offs[1:] != offs[:-1] + stride) + 1).tolist(), n]
    for a, b in zip(bounds, bounds[1:]):
        s = int(offs[a])
        copy(dst[a * stride:b * stride], src[s:s + (b - a) * stride])


def gather_ranges(dst: np.ndarray, dst_offsets: Sequence[int], src: np.ndarray, src_offsets: Sequence[int],
                  ranges: Sequence[tuple[int, int]]) -> None:
    """For every block ``j``: its byte ``ranges`` (``(offset, length)`` within the block at
    ``src[src_offsets[j]:]``), concatenated, into ``dst[dst_offsets[j]:]`` (1-D uint8 arrays;
    offsets and lengths in bytes). What a page back does per layer: one layer's KV heads of
    each block out of the arena into that block's slot of the engine's cache.

    Blocks whose offsets advance by the same two strides (source, destination) are copied
    as one run: one strided numpy copy per range for the whole run, instead of one copy per
    range per block (4 ranges of 8 KiB x 59 blocks: 4 calls instead of 236). Where this
    machine has the slow ``memcpy`` case (:func:`words_enabled`) every range goes by
    :func:`copy`. A run whose destination slots would overlap is copied block by block, in
    order, as a loop would. Raises ValueError for a byte outside either array or lists of
    unequal lengths (nothing is copied then)."""
    try:
        s = np.asarray(src_offsets, dtype=np.int64).reshape(-1)
        d = np.asarray(dst_offsets, dtype=np.int64).reshape(-1)
        r = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"block offsets or ranges not 64-bit integers: {e}") from None
    n = s.size
    if d.size != n:
        raise ValueError(f"{n} source offsets for {d.size} destination offsets")
    if not n or not r.size:
        return
    offs, lens = r[:, 0], r[:, 1]
    if int(lens.min()) < 0 or int(offs.min()) < 0:
        raise ValueError(f"byte ranges {r.tolist()} with a negative offset or length")
    want, end = int(lens.sum()), int((offs + lens).max())
    if int(s.min()) < 0 or int(s.max()) + end > src.size or int(d.min()) < 0 or int(d.max()) + want > dst.size:
        raise ValueError(f"blocks at {int(s.min())}..{int(s.max())} (ranges to byte {end}) -> "
                         f"{int(d.min())}..{int(d.max())} ({want} bytes each) outside {src.size} -> {dst.size} bytes")
    pos = np.concatenate(([0], np.cumsum(lens)[:-1])).tolist()
    spans = [(p, o, m) for p, o, m in zip(pos, offs.tolist(), lens.tolist()) if m]
    sl, dl = s.tolist(), d.tolist()
    words = _words if _words is not None else words_enabled()
    a = 0
    while a < n:
        b, bs, bd = a + 1, 0, 0
        if not words and b < n:
            bs, bd = sl[b] - sl[a], dl[b] - dl[a]
            if abs(bd) >= want:                 # slots apart: a run may form
                b += 1
                while b < n and sl[b] - sl[b - 1] == bs and dl[b] - dl[b - 1] == bd:
                    b += 1
        s0, d0, k = sl[a], dl[a], b - a
        for p, o, m in spans:
            if k == 1:
                copy(dst[d0 + p:d0 + p + m], src[s0 + o:s0 + o + m])
            else:                               # bounds checked above for every block of the run
                np.copyto(np.lib.stride_tricks.as_strided(dst[d0 + p:], shape=(k, m), strides=(bd, 1)),
                          np.lib.stride_tricks.as_strided(src[s0 + o:], shape=(k, m), strides=(bs, 1),
                                                          writeable=False))
        a = b


def _runs(dst_offsets: Sequence[int], src_offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """The spans ``(dst, src, size)`` with each span that continues the previous one in both
    arrays merged into it (only spans of a positive size are merged). Many spans are compared
    in numpy (13 us for 128, against 26 us for the loop)."""
    if len(sizes) >= 16:
        try:
            d, s, n = np.array((dst_offsets, src_offsets, sizes), dtype=np.int64)
        except (OverflowError, ValueError):     # not offsets of any buffer, or lists of unequal lengths
            d = None
        if d is not None and min(d.min(), s.min(), n.min()) >= 0 and max(d.max(), s.max(), n.max()) < 1 << 40:
            # (values that large or negative go by the loop: no int64 sum can wrap, the caller's check refuses them)
            pos = n > 0
            cont = (d[1:] == d[:-1] + n[:-1]) & (s[1:] == s[:-1] + n[:-1]) & pos[1:] & pos[:-1]
            if cont.all():
                return [(int(d[0]), int(s[0]), int(n.sum()))]
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            return list(zip(d[starts].tolist(), s[starts].tolist(), np.add.reduceat(n, starts).tolist()))
    runs: list[tuple[int, int, int]] = []
    d_end = s_end = -1
    for d, s, n in zip(dst_offsets, src_offsets, sizes):
        if d == d_end and s == s_end and n > 0 and runs and runs[-1][2] > 0:
            rd, rs, rn = runs[-1]
            runs[-1] = (rd, rs, rn + n)
        else:
            runs.append((d, s, n))
        d_end, s_end = d + n, s + n
    return runs
