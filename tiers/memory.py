"""Host memory for the host tier: one preallocated, aligned buffer.

Without a GPU the buffer is ordinary (pageable) memory. With a GPU it is one large
page-locked allocation (``cudaHostRegister``), never one per block. With
``shared=True`` it is a memfd (Linux ``memfd_create``) mapped ``MAP_SHARED``: same-node
clients receive the descriptor over the daemon's unix socket (SCM_RIGHTS) and map the
same pages, so a block is copied once, straight between the arena and the client's
buffer (see :mod:`kvstore.common.arena`).

**Huge pages** (``huge_pages``, the ``[tiers.host] huge_pages`` key) for a shared buffer:

- ``"hugetlb"``: a ``MFD_HUGETLB`` memfd, 2 MiB pages from the kernel's pool
  (``vm.nr_hugepages``, set by the administrator); the size is rounded up to whole pages.
  When the pool cannot hold the arena the mapping fails at once (the pages are reserved
  when it is mapped) and the buffer falls back to ``"thp"``.
- ``"thp"``: ``madvise(MADV_HUGEPAGE)`` on the memfd mapping before its pages are made, so
  the kernel backs it with transparent huge pages where
  ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it (``advise``, ``always``,
  ``within_size``, ``force``); with ``never`` or ``deny`` it falls back to 4 KiB pages.
- ``"auto"`` (the default): ``"hugetlb"`` when the pool has enough free pages, else
  ``"thp"``; ``"off"``: 4 KiB pages.

:attr:`HostBuffer.huge_pages` says what the buffer got (``"hugetlb"``, ``"thp"`` or ``""``).
The fallback costs what 4 KiB pages cost (docs/shared_memory.md): one page-table entry per
4 KiB in the daemon and in every client that maps the arena (2 MiB of page tables per GiB
each), the time to populate them, and TLB misses on copies.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("tiers.memory")

DEFAULT_ALIGNMENT = 4096
HUGE_PAGES_CHOICES = ("auto", "hugetlb", "thp", "off")
HUGE_PAGE_BYTES = 2 << 20
THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)      # Linux 5.14: what MAP_POPULATE does


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
        mapped_bytes: the mapping's length (``nbytes`` rounded up to whole huge pages for
            ``hugetlb``; what a client maps).
        huge_pages: the pages it got: ``"hugetlb"``, ``"thp"`` (advised, where the kernel
            allows) or ``""`` (4 KiB).
    """

    array: np.ndarray
    nbytes: int
    alignment: int
    pinned: bool
    owner: Any
    fd: int = -1
    region: Any = None
    mapped_bytes: int = 0
    huge_pages: str = ""

    def close(self) -> None:
        """Unpin and close the descriptor. The mapping goes with the last view of it."""
        if self.region is not None:
            self.region.close()
            self.region = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def allocate_host_buffer(nbytes: int, *, alignment: int = DEFAULT_ALIGNMENT, pinned: bool = False,
                         shared: bool = False, name: str = "kvstore-host-arena",
                         huge_pages: str = "off") -> HostBuffer:
    """Allocate ``nbytes`` of host memory aligned to ``alignment`` (a power of two).

    Args:
        nbytes: bytes (>= 0).
        alignment: start alignment in bytes; mappings are page aligned.
        pinned: page-lock the buffer (``cudaHostRegister`` through :mod:`tiers.gpu`).
        shared: back the buffer by a memfd mapped ``MAP_SHARED`` (Linux); ``fd`` is set.
        name: the memfd's name (shows in ``/proc/<pid>/fd``).
        huge_pages: for a shared buffer, one of :data:`HUGE_PAGES_CHOICES` (see the module
            docstring); a fallback is logged, never an error.
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
    if huge_pages not in HUGE_PAGES_CHOICES:
        raise ValueError(f"huge_pages must be one of {', '.join(HUGE_PAGES_CHOICES)}, got {huge_pages!r}")
    if shared:
        return _allocate_shared(nbytes, alignment, pinned, name, huge_pages)
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


def thp_shmem_allowed() -> bool:
    """Whether the kernel gives shared memory transparent huge pages when a mapping asks
    (``shmem_enabled`` is ``advise``, ``always``, ``within_size`` or ``force``)."""
    try:
        with open(THP_SHMEM) as f:
            text = f.read()
    except OSError:
        return False
    chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()
    return chosen in ("advise", "always", "within_size", "force")


def hugetlb_free_bytes(info: dict[str, int] | None = None) -> int:
    """Bytes of free 2 MiB pages in the kernel's hugetlb pool (``/proc/meminfo``, or
    ``info`` as :func:`_meminfo` reads it)."""
    info = _meminfo() if info is None else info
    size = info.get("Hugepagesize", 0)
    return info.get("HugePages_Free", 0) * size if size == HUGE_PAGE_BYTES else 0


CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
"""This process's cgroup (v2) memory limit and use, where it has one."""


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` by field: sizes in bytes, counts (``HugePages_Free``) as they are;
    ``{}`` where it cannot be read."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        return {}
    return out


def memory_limits() -> tuple[int, int] | None:
    """``(total, available)``: bytes of memory this process may have in all, and now
    without swapping or the out-of-memory killer. ``MemTotal`` and ``MemAvailable`` plus
    the free pages of the hugetlb pool (``/proc/meminfo``), both capped by the cgroup's
    ``memory.max`` (available: less its ``memory.current``) where one is set. None where
    the system does not say (not Linux).

    ``MemAvailable`` leaves out shared memory still mapped: the arena of a stopped daemon
    that a client has not unmapped yet counts as used."""
    info = _meminfo()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    huge = hugetlb_free_bytes(info)
    total, available = info["MemTotal"] + huge, info["MemAvailable"] + huge
    try:
        with open(CGROUP_FILES[0]) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(CGROUP_FILES[1]) as f:
                used = int(f.read().strip())
            total, available = min(total, int(limit)), min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return total, available


def _allocate_shared(nbytes: int, alignment: int, pinned: bool, name: str, huge_pages: str) -> HostBuffer:
    if alignment > mmap.PAGESIZE:
        raise ValueError(f"a shared buffer is page aligned; alignment {alignment} is larger than a page")
    size = max(nbytes, 1)
    huge = -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    modes = {"hugetlb": ["hugetlb", "thp", ""], "thp": ["thp", ""], "off": [""],
             "auto": (["hugetlb"] if hugetlb_free_bytes() >= huge else []) + ["thp", ""]}[huge_pages]
    if "thp" in modes and not thp_shmem_allowed():
        modes.remove("thp")
    for mode in modes:
        try:
            return _map_shared(nbytes, huge if mode == "hugetlb" else size, alignment, pinned, name, mode)
        except OSError as e:
            if not mode:
                raise MemoryError(f"cannot map {size} bytes of shared memory: {e}") from e
            log.warning("huge pages (%s) for the %d-byte arena failed (%s); falling back", mode, size, e)
    raise AssertionError("unreachable: 4 KiB pages are always tried last")


def _map_shared(nbytes: int, size: int, alignment: int, pinned: bool, name: str, mode: str) -> HostBuffer:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_HUGETLB if mode == "hugetlb" else 0))
    try:
        os.ftruncate(fd, size)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if mode == "thp":           # advised before its pages are made, then populated
            region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
            region.madvise(mmap.MADV_HUGEPAGE)
            region.madvise(MADV_POPULATE_READ)
        else:
            region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
        array = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        pinned_region = None
        if pinned:
            from tiers.gpu import PinnedRegion
            pinned_region = PinnedRegion(size, mapping=region)
        return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=pinned, owner=region,
                          fd=fd, region=pinned_region, mapped_bytes=size, huge_pages=mode)
    except BaseException:
        os.close(fd)
        raise


def _allocate_pinned(nbytes: int, alignment: int) -> HostBuffer:
    from tiers.gpu import allocate_pinned

    region, start = allocate_pinned(max(nbytes, 1), alignment)
    array = np.frombuffer(region.mapping, dtype=np.uint8, count=nbytes, offset=start)
    return HostBuffer(array=array, nbytes=nbytes, alignment=alignment, pinned=True, owner=region,
                      region=region)
