"""Host memory for the host tier: one preallocated, aligned buffer.

Without a GPU the buffer is ordinary (pageable) memory from numpy. With a GPU it is
one large pinned allocation (see :func:`allocate_host_buffer`), never one per block.
"""

from __future__ import annotations

import mmap

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

    With ``pinned=True`` the buffer is ONE page-locked allocation of (about) ``nbytes``
    made through :func:`tiers.gpu.allocate_pinned` (``cudaHostRegister``), exposed as
    the same 1-D uint8 numpy view; ``owner`` is the :class:`tiers.gpu.PinnedRegion`
    (``owner.close()`` unpins it early; otherwise it is unpinned when collected).

    Raises ValueError for bad arguments, MemoryError when the allocation fails,
    :class:`tiers.gpu.GPUUnavailable` for ``pinned=True`` without a CUDA GPU.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if pinned:
        return _allocate_pinned(nbytes, alignment)
    if alignment <= mmap.PAGESIZE and nbytes > 0:
        # Anonymous mapping, page aligned, populated up front: first touch of fresh pages
        # runs at a fraction of memcpy speed, so the arena pays it once at start, not per put.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(-1, nbytes, flags=flags)
        array = np.frombuffer(region, dtype=np.uint8)
        return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=False, owner=region)
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    array = raw[start:start + nbytes]
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=False, owner=raw)


def _allocate_pinned(nbytes: int, alignment: int) -> HostBuffer:
    from .gpu import allocate_pinned

    region, start = allocate_pinned(max(nbytes, 1), alignment)
    array = np.frombuffer(region.mapping, dtype=np.uint8, count=nbytes, offset=start)
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=True, owner=region)
