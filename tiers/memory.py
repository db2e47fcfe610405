"""Host memory for the host tier: one preallocated, aligned buffer.

Without a GPU the buffer is ordinary (pageable) memory. With a GPU it is one large
page-locked allocation (``cudaHostRegister``), never one per block. With
``shared=True`` it is a memfd (Linux ``memfd_create``) mapped ``MAP_SHARED``: same-node
clients receive the descriptor over the daemon's unix socket (SCM_RIGHTS) and map the
same pages, so a block is copied once, straight between the arena and the client's
buffer (see :mod:`kvstore.common.arena`).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_ALIGNMENT = 4096


@dataclass
class HostBuffer:
    """A host allocation.

    Attributes:
        array: 1-D uint8 numpy view of ``nbytes`` bytes whose start is aligned to ``alignment``.
        nbytes: usable bytes.
        alignment: alignment of ``array``'s start, bytes.
        pinned: page-locked for DMA to a GPU.
        owner: keeps the memory alive (mmap, PinnedRegion, numpy array).
        fd: the memfd of a shared buffer (owned: :meth:`close` closes it); -1 otherwise.
    """

    array: np.ndarray
    nbytes: int
    alignment: int
    pinned: bool
    owner: Any
    fd: int = -1
    region: Any = None

    def close(self) -> None:
        """Unpin and close the descriptor. The mapping goes with the last view of it."""
        if self.region is not None:
            self.region.close()
            self.region = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def allocate_host_buffer(nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False,
                         shared: bool = False, name: str = "kvstore-host-arena") -> HostBuffer:
    """Allocate ``nbytes`` of host memory aligned to ``alignment`` (a power of two).

    Args:
        nbytes: bytes (>= 0).
        alignment: start alignment in bytes; mappings are page aligned.
        pinned: page-lock the buffer (``cudaHostRegister`` through :mod:`tiers.gpu`).
        shared: back the buffer by a memfd mapped ``MAP_SHARED`` (Linux); ``fd`` is set.
        name: the memfd's name (shows in ``/proc/<pid>/fd``).
    Pages are populated up front (``MAP_POPULATE``): first touch of fresh pages runs at a
    fraction of memcpy speed, so the arena pays it once at start, not per put.

    Raises ValueError for bad arguments, MemoryError when the allocation fails,
    :class:`tiers.gpu.GPUUnavailable` for ``pinned=True`` without a CUDA GPU, OSError when
    ``shared`` is not supported here.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if shared:
        return _allocate_shared(nbytes, alignment, pinned, name)
    if pinned:
        return _allocate_pinned(nbytes, alignment)
    if alignment <= mmap.PAGESIZE and nbytes > 0:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(-1, nbytes, flags=flags)
        array = np.frombuffer(region, dtype=np.uint8)
        return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=False, owner=region)
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    array = raw[start:start + nbytes]
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=False, owner=raw)


def _allocate_shared(nbytes: int, alignment: int, pinned: bool, name: str) -> HostBuffer:
    if alignment > mmap.PAGESIZE:
        raise ValueError(f"a shared buffer is page aligned; alignment {alignment} is larger than a page")
    size = max(nbytes, 1)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            region = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise MemoryError(f"cannot map {size} bytes of shared memory: {e}") from e
        array = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        pinned_region = None
        if pinned:
            from tiers.gpu import PinnedRegion
            pinned_region = PinnedRegion(size, mapping=region)
        return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=pinned, owner=region,
                          fd=fd, region=pinned_region)
    except BaseException:
        os.close(fd)
        raise


def _allocate_pinned(nbytes: int, alignment: int) -> HostBuffer:
    from tiers.gpu import allocate_pinned

    region, start = allocate_pinned(max(nbytes, 1), alignment)
    array = np.frombuffer(region.mapping, dtype=np.uint8, count=nbytes, offset=start)
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=True, owner=region,
                      region=region)
