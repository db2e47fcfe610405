"""Parsing of human sizes such as ``"40GiB"`` (binary) or ``"500MB"`` (decimal)."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative int (bytes) or a string with an optional unit:
    ``B``, ``KB/MB/GB/TB`` (powers of 1000) or ``KiB/MiB/GiB/TiB`` (powers of 1024),
    case-insensitive. Raises ValueError naming ``name`` for anything else
    (negative numbers, unknown units, booleans, fractions of a byte).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a size like '8GiB', got {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"{name}: cannot parse size {value!r} (expected e.g. '512MiB', '40GiB', 1048576)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"{name}: unknown unit {m.group(2)!r} in {value!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    nbytes = Fraction(number) * _UNITS[unit]      # exact: "4.1GB" is 4,100,000,000 bytes
    if nbytes.denominator != 1:
        raise ValueError(f"{name}: {value!r} is not a whole number of bytes")
    return int(nbytes)


def format_size(nbytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
