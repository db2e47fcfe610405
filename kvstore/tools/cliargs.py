"""argparse value types shared by the subcommands (clear errors instead of tracebacks), and
the check of an output path made before a command starts its work (:func:`output_error`)."""

from __future__ import annotations

import argparse
import os
from typing import Callable

MAX_WAIT_S = 86400.0
"""Longest timeout, deadline, wait or interval (seconds) an option takes: one day."""

MAX_BLOCK_BYTES = 1 << 30
"""Largest block (bytes) ``replay`` and ``simulate`` make: 1 GiB."""


def at_most(kind: Callable[[str], float], high: float) -> Callable[[str], float]:
    """``kind`` (one of the types here) and at most ``high``: a huge number is refused with
    one line (exit status 2), not an OverflowError or an instant deadline later."""
    def check(text: str) -> float:
        value = kind(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text}" if isinstance(high, float)
                                             else f"must be at most {high}, got {text}")
        return value
    check.__name__ = kind.__name__
    return check


def positive_int(text: str) -> int:
    """An int > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def probability_below_one(text: str) -> float:
    """A float in [0, 1) (nan refused)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def address(text: str) -> str:
    """A daemon address: ``host:port`` or ``unix:PATH``. Refuses an empty one (or
    ``unix:`` with no path), as ``[server] listen`` does, rather than let it mean the
    default."""
    if not text.strip() or text.startswith("unix:") and not text[len("unix:"):].strip("/ "):
        raise argparse.ArgumentTypeError(f"{text!r} names no address or socket path")
    return text


def non_empty_path(text: str) -> str:
    """A file or folder path: refuses an empty one (which would mean the current folder,
    or no file at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names no file")
    return text


def output_error(target: str | os.PathLike[str]) -> str | None:
    """Why ``target`` cannot be written, or None when it can: the reason as the OS says it
    (``No such file or directory`` for a missing folder, which is never created), with a
    hint for a folder. Opens it for appending and removes it again when it did not exist,
    so a command can check every output before its work and leave no empty file behind."""
    existed = os.path.lexists(target)
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        why = e.strerror or str(e)
        if os.path.isdir(target):
            why += " (it is a folder: give a file name)"
        return why
    if not existed:
        os.unlink(target)
    return None


__all__ = ["MAX_BLOCK_BYTES", "MAX_WAIT_S", "address", "at_most", "non_negative_float", "non_negative_int", "non_empty_path", "output_error", "positive_float",
           "positive_int", "probability_below_one"]
