"""HBM tier: one GPU allocation carved into blocks, shared with workers by CUDA IPC leases.

Memory: the tier makes ONE device allocation of ``capacity_bytes`` (``cudaMalloc``
through CuPy, outside CuPy's pool so its IPC handle names exactly this slab) and
places blocks in it::

    slab   |blk a  |blk b     |free      |blk c  |free ...|
           ^0      ^4096      ^12288                       ^capacity
    extents (default): a block takes its size rounded up to 4096 bytes (GDS page),
                       placed best fit (:class:`tiers.allocator.ExtentAllocator`,
                       the host tier's allocator; neighbours merged on free);
    slots (slot_bytes=S): every block takes one S-byte slot (blocks > S do not fit;
                       :class:`tiers.allocator.SlotAllocator`).

``used_bytes`` counts those allocator units, so it can exceed the sum of payloads.

The page-back path on a GPU node: a worker on the same GPU leases blocks through the
daemon (the catalogue's one lease mechanism, :mod:`kvstore.store.catalogue`: a leased block
is pinned, never evicted or freed under the worker) and gets, per block,
:meth:`HBMTier.ipc_handle`: the slab's IPC handle, the byte offset of the block in the
slab, its size and the CUDA device. The worker opens the handle once
(:func:`kvstore.client.ipc.open_block`) and reads the block in place.

Without a GPU the slab is a :class:`multiprocessing.shared_memory.SharedMemory`
segment; its name plays the IPC handle (``device == -1``) and
:func:`kvstore.client.ipc.open_block` maps it read-only in another process (Linux
``/dev/shm``). Everything else (allocation, accounting) is the same code; the two
slabs are :mod:`tiers.slab`.

Capabilities: ``device`` (:meth:`HBMTier.device_array`, :meth:`HBMTier.ipc_handle`;
numpy arrays on the stand-in) and, on the stand-in, ``host`` (zero-copy views).

Thread safety: allocation, commit and free are guarded by one lock; ``write`` and
``read_into`` copy bytes outside it (the manager pins what it reads or writes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers.allocator import ExtentAllocator, SlotAllocator
from tiers.base import Tier, TierKind
from tiers.buffers import ByteRanges, byte_view, check_ranges, output_view
from tiers.capabilities import Capabilities, IpcHandle
from tiers.errors import BlockExists, BlockNotStored, InvalidAccess, NoRoom
from tiers.gpu import cuda_buffer, gpu_available, require_gpu
from tiers.slab import CudaSlab, ShmSlab

__all__ = ["ALIGNMENT", "HBMTier"]

ALIGNMENT = 4096
"""Extent granularity and alignment in bytes (GPU page: GDS moves whole 4 KiB pages)."""

BACKENDS = ("cuda", "shm")


@dataclass(eq=False)
class _Block:
    offset: int
    alloc: int               # allocator bytes (size rounded up to the unit)
    size: int                # payload bytes
    written: int = 0
    committed: bool = False


class HBMTier(Tier):
    """GPU memory tier (or its shared-memory CPU stand-in).

    Args:
        capacity_bytes: slab size in bytes (> 0). Rounded down to a multiple of the
            allocation unit (4096, or ``slot_bytes``); :attr:`capacity_bytes` is that.
        device: CUDA device ordinal of the slab.
        name: tier name in stats and logs.
        slot_bytes: fixed slot size in bytes; None (default) places variable extents.
            With slots, blocks larger than ``slot_bytes`` never fit
            (:attr:`max_block_bytes`); choose a multiple of 4096 for GDS.
        backend: ``"cuda"`` or ``"shm"`` (CPU stand-in); None picks ``"cuda"`` when
            :func:`tiers.gpu.gpu_available` and ``"shm"`` otherwise.

    Raises:
        ValueError: bad capacity, slot size or backend.
        GPUUnavailable: ``backend="cuda"`` without a GPU or without CuPy.
        MemoryError / cupy OutOfMemoryError: the slab cannot be allocated.
    """

    kind = TierKind.HBM
    volatile = True

    def __init__(self, capacity_bytes: int, *, device: int = 0, name: str = "hbm",
                 slot_bytes: int | None = None, backend: str | None = None):
        if slot_bytes is not None and slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        unit = slot_bytes or ALIGNMENT
        if int(capacity_bytes) < unit:
            raise ValueError(f"HBM capacity must hold at least one {unit}-byte unit, got {capacity_bytes}")
        if backend is None:
            backend = "cuda" if gpu_available() else "shm"
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "cuda":
            require_gpu("the HBM tier", cupy=True)
        self.name = name
        self.backend = backend
        self.slot_bytes = slot_bytes
        self._alloc = SlotAllocator(int(capacity_bytes), slot_bytes) if slot_bytes else \
            ExtentAllocator(int(capacity_bytes), ALIGNMENT)
        self._slab = CudaSlab(self._alloc.capacity, device, ALIGNMENT) if backend == "cuda" else \
            ShmSlab(self._alloc.capacity)
        self.device = self._slab.device
        self._blocks: dict[bytes, _Block] = {}
        self._lock = threading.Lock()
        self._caps = Capabilities(device=self, host=self if backend == "shm" else None)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # ------------------------------------------------------------------ capacity

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    @property
    def max_block_bytes(self) -> int:
        """Largest payload that can ever fit (the slot size, or the capacity)."""
        return self.slot_bytes or self._alloc.capacity

    def __contains__(self, key: bytes) -> bool:
        b = self._blocks.get(key)
        return b is not None and b.committed

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for b in self._blocks.values() if b.committed)

    def fits(self, nbytes: int) -> bool:
        if nbytes > self.max_block_bytes:
            return False
        with self._lock:
            return self._alloc.can_allocate(nbytes)

    # ------------------------------------------------------------------ two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        if nbytes <= 0:
            raise InvalidAccess(f"block size must be > 0 bytes, got {nbytes}")
        with self._lock:
            if key in self._blocks:
                raise BlockExists(f"block {key.hex()[:16]} already present in {self.name}")
            if nbytes > self.max_block_bytes:
                raise NoRoom(f"{self.name}: a {nbytes}-byte block exceeds the largest block "
                               f"({self.max_block_bytes} bytes)")
            try:
                offset, alloc = self._alloc.allocate(nbytes)
            except NoRoom as e:
                raise NoRoom(f"{self.name}: {nbytes} bytes do not fit: {e}") from None
            self._blocks[key] = _Block(offset, alloc, nbytes)

    def _reserved(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None or b.committed:
            raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
        return b

    def write(self, key: bytes, offset: int, data: Any) -> None:
        """Copy a chunk into a reserved block (see :meth:`Tier.write`).

        ``data`` is host bytes (bytes, memoryview, numpy array) or, on the CUDA
        backend, a C-contiguous device array (``__cuda_array_interface__``): a
        device-to-device copy.
        """
        b = self._reserved(key)
        n = cuda_buffer(data)[1] if hasattr(data, "__cuda_array_interface__") else byte_view(data).nbytes
        if offset != b.written:
            raise InvalidAccess(f"chunk at offset {offset} but {b.written} bytes written so far")
        if offset + n > b.size:
            raise InvalidAccess(f"chunk [{offset}, {offset + n}) overruns the reserved {b.size} bytes")
        self._slab.write(b.offset + offset, data)
        b.written += n

    def mark_written(self, key: bytes, nbytes: int) -> None:
        """Record that ``nbytes`` of a reserved block were filled in place through
        :meth:`device_array` or :meth:`write_view` (e.g. a GDS read)."""
        b = self._reserved(key)
        if not 0 <= nbytes <= b.size:
            raise InvalidAccess(f"{nbytes} bytes is outside the reserved {b.size} bytes")
        b.written = nbytes

    def commit(self, key: bytes) -> None:
        with self._lock:
            b = self._reserved(key)
            if b.written != b.size:
                raise InvalidAccess(f"block {key.hex()[:16]}: {b.written} of {b.size} bytes written")
            b.committed = True

    def abort(self, key: bytes) -> None:
        with self._lock:
            b = self._blocks.get(key)
            if b is not None and not b.committed:
                del self._blocks[key]
                self._alloc.release(b.offset, b.alloc)

    # ------------------------------------------------------------------ reads

    def _committed(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None or not b.committed:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        return b

    def read_into(self, key: bytes, out, ranges: ByteRanges | None = None) -> int:
        """Copy a block (or ``ranges``) into host buffer ``out`` (one DMA per range on the
        CUDA backend, e.g. into a slice of the pinned host arena)."""
        b = self._committed(key)
        total = check_ranges(ranges, b.size)
        dst = np.frombuffer(output_view(out, total), dtype=np.uint8)
        if not ranges:
            self._slab.read_into(b.offset, dst)
            return total
        pos = 0
        for off, length in ranges:
            self._slab.read_into(b.offset + off, dst[pos:pos + length])
            pos += length
        return total

    def view(self, key: bytes) -> memoryview:
        """Zero-copy read-only view (stand-in only: the ``host`` capability)."""
        b = self._committed(key)
        return self._slab.view(b.offset, b.size).toreadonly()

    def write_view(self, key: bytes) -> memoryview:
        """Writable view of a reservation (stand-in only: the ``host`` capability)."""
        b = self._reserved(key)
        return self._slab.view(b.offset, b.size)

    def device_array(self, key: bytes):
        """1-D uint8 array over a block's bytes in the slab, without copying.

        A CuPy array on the CUDA backend (``torch.as_tensor(arr, device="cuda")``
        views it too), a numpy array on the stand-in. Works for committed blocks
        (their payload) and reservations (the reserved size). Valid while the block is
        pinned or reserved. Raises BlockNotStored when the key is neither.
        """
        b = self._blocks.get(key)
        if b is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not in {self.name}")
        return self._slab.device_array(b.offset, b.size)

    def ipc_handle(self, key: bytes) -> IpcHandle:
        """Where a committed block lives, for a worker process (see :mod:`kvstore.client.ipc`)."""
        b = self._committed(key)
        return IpcHandle(self._slab.handle, self._slab.base_offset + b.offset, b.size, self.device)

    def size_of(self, key: bytes) -> int:
        return self._committed(key).size

    def free(self, key: bytes) -> None:
        """Delete a committed block and return its space (the manager never frees a pinned
        or leased block)."""
        with self._lock:
            b = self._committed(key)
            del self._blocks[key]
            self._alloc.release(b.offset, b.alloc)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Free the slab. Workers must have released their leases."""
        with self._lock:
            self._blocks.clear()
            self._slab.close()

    def describe(self) -> str:
        where = f"cuda:{self.device}" if self.backend == "cuda" else "shm stand-in"
        return f"{self.name}(hbm, {self.capacity_bytes} bytes, {where})"
