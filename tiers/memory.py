"""Host memory for the host tier: one preallocated, aligned buffer.

Without a GPU the buffer is ordinary (pageable) memory from numpy. With a GPU it is
one large pinned allocation (see :func:`allocate_host_buffer`), never one per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_ALIGNMENT = 4096


@dataclass
class HostBuffer:
    """A host allocation: ``array`` is a 1-D uint8 numpy view of ``nbytes`` bytes whose
    start is aligned to ``alignment`` bytes; ``owner`` keeps the memory alive;
    ``pinned`` says whether it is page-locked for DMA."""

    array: np.ndarray
    nbytes: int
    alignment: int
    pinned: bool
    owner: Any


def allocate_host_buffer(nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False) -> HostBuffer:
    """Allocate ``nbytes`` of host memory aligned to ``alignment`` (a power of two).

    Raises ValueError for bad arguments, MemoryError when the allocation fails.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if pinned:
        raise NotImplementedError("pinned host memory needs a GPU build (see tiers.gpu)")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    array = raw[start:start + nbytes]
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=False, owner=raw)
