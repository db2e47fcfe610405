"""The byte ranges and buffers every tier takes, and the checks they all make on them
(each raising :class:`tiers.errors.InvalidAccess`): byte ranges inside a block, the
in-order chunks of a two-phase write, flat byte views of caller buffers.
"""

from __future__ import annotations

from typing import Any, Sequence

from tiers.errors import InvalidAccess

ByteRanges = Sequence[tuple[int, int]]
"""``(offset, length)`` pairs inside one block payload, in bytes."""


def check_ranges(ranges: ByteRanges | None, size: int) -> int:
    """Validate byte ranges against a payload of ``size`` bytes; return their total length
    (``size`` when ``ranges`` is empty or None).

    Raises InvalidAccess for a negative or out-of-bounds range.
    """
    if not ranges:
        return size
    total = 0
    for off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise InvalidAccess(f"byte range ({off}, {length}) is outside a {size}-byte block")
        total += length
    return total


def check_chunk(offset: int, nbytes: int, written: int, size: int) -> None:
    """Validate one in-order chunk of a two-phase write (all in bytes).

    Raises InvalidAccess when ``offset`` is not the number of bytes ``written`` so far or
    the chunk runs past the block's ``size``.
    """
    if offset != written:
        raise InvalidAccess(f"chunk at offset {offset} but {written} bytes written so far")
    if offset + nbytes > size:
        raise InvalidAccess(f"chunk [{offset}, {offset + nbytes}) overruns the block's {size} bytes")


def byte_view(data: Any, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, memoryview,
    numpy array, mmap). Raises InvalidAccess for a read-only buffer when ``writable``."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise InvalidAccess("the output buffer is read-only")
    return view


def output_view(out: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` bytes of writable buffer ``out`` as a flat byte view.

    Raises InvalidAccess when ``out`` is read-only or smaller than ``nbytes``.
    """
    view = byte_view(out, writable=True)
    if view.nbytes < nbytes:
        raise InvalidAccess(f"output buffer has {view.nbytes} bytes, {nbytes} are read")
    return view[:nbytes]


__all__ = ["ByteRanges", "byte_view", "check_chunk", "check_ranges", "output_view"]
