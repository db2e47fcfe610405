"""The byte ranges of a Get (``(offset, length)`` pairs, bytes), checked the same way by
the client before it sends them and by the daemon when they arrive.

A range starts at an offset >= 0 and has a length >= 0; ranges never overlap (the bytes
returned per block never exceed the block), there are at most :data:`MAX_RANGES`, and
none ends past :data:`MAX_BLOCK_BYTES` (no block can be that long). A range past the end
of one stored block is not an error: that block is a miss (checked per block).
"""

from __future__ import annotations

import operator
from typing import Iterable

from kvstore.common.errors import InvalidRequest

MAX_BLOCK_BYTES = 1 << 40
"""Largest block a client may announce (bytes); tiers refuse what they cannot hold."""

MAX_RANGES = 4096
"""Most byte ranges one Get may ask for (a TP rank asks for 2 per layer)."""


def as_byte_count(v) -> int:
    """``v`` as an int (numpy integers too). Raises TypeError for a bool, a float, a string
    or anything else that is not an integer."""
    if isinstance(v, bool):
        raise TypeError("a bool is not a byte count")
    return operator.index(v)


def check_byte_ranges(ranges: Iterable[tuple[int, int]] | None, field: str = "ranges") -> list[tuple[int, int]] | None:
    """``ranges`` as a list of ``(offset, length)`` int pairs, or None when there are none.

    Raises InvalidRequest for an entry that is not a pair of integers, a negative offset
    or length, more than :data:`MAX_RANGES`, a range ending past :data:`MAX_BLOCK_BYTES`,
    or two ranges that overlap.
    """
    if ranges is None:
        return None
    out = []
    for i, r in enumerate(ranges):
        try:
            off, length = r
            off, length = as_byte_count(off), as_byte_count(length)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{field}[{i}] is {r!r}: a byte range is an (offset, length) pair of "
                                 f"integers") from None
        if off < 0 or length < 0:
            raise InvalidRequest(f"{field}[{i}] is ({off}, {length}): offsets and lengths are >= 0")
        out.append((off, length))
        if len(out) > MAX_RANGES:
            raise InvalidRequest(f"more than {MAX_RANGES} byte ranges; at most {MAX_RANGES} per request")
    if not out:
        return None
    end = 0
    for off, length in sorted(out):
        if off + length > MAX_BLOCK_BYTES:
            raise InvalidRequest(f"byte range ({off}, {length}) ends past the largest block ({MAX_BLOCK_BYTES} bytes)")
        if off < end:
            raise InvalidRequest(f"byte range ({off}, {length}) overlaps another range")
        end = off + length
    return out


__all__ = ["MAX_BLOCK_BYTES", "MAX_RANGES", "as_byte_count", "check_byte_ranges"]
