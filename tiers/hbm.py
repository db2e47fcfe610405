"""HBM tier: one GPU allocation carved into blocks, shared with workers by CUDA IPC leases.

Memory: the tier makes ONE device allocation of ``capacity_bytes`` (``cudaMalloc``
through CuPy, outside CuPy's pool so its IPC handle names exactly this slab) and
places blocks in it::

    slab   |blk a  |blk b     |free      |blk c  |free ...|
           ^0      ^4096      ^12288                       ^capacity
    extents (default): a block takes its size rounded up to 4096 bytes (GDS page),
                       placed by the host tier's best-fit allocator
                       (:class:`tiers.host.ExtentAllocator`, neighbours merged on free);
    slots (slot_bytes=S): every block takes one S-byte slot (blocks > S do not fit).

``used_bytes`` counts those allocator units, so it can exceed the sum of payloads.

Leases (the page-back path on a GPU node): a worker on the same GPU asks
for keys and gets, per block, the slab's IPC handle, the byte offset of the block in
the slab, its size and the CUDA device. It opens the handle once
(:func:`open_leased_block`) and reads the block in place. Until the lease is released
or its TTL passes, the block's bytes stay where they are: :meth:`HBMTier.is_leased`
is True (the manager must not pick it as a victim) and a :meth:`HBMTier.free` of it
only hides it, returning the space when the last lease on it ends.

Without a GPU the slab is a :class:`multiprocessing.shared_memory.SharedMemory`
segment; its name plays the IPC handle (``device == -1``) and
:func:`open_leased_block` maps it read-only in another process (Linux ``/dev/shm``).
Everything else (allocation, accounting, leases) is the same code.

Thread safety: allocation, commit, free and the lease table are guarded by one lock;
``write``/``read`` copy bytes outside it (the manager pins what it reads or writes).
"""

from __future__ import annotations

import heapq
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from kvstore.errors import InvalidRequest, TierFull

from .base import ByteRanges, Tier, TierKind, check_ranges
from .gpu import cuda_buffer, gpu_available, require_gpu
from .host import ExtentAllocator

__all__ = ["ALIGNMENT", "DEFAULT_LEASE_TTL_S", "MAX_LEASE_TTL_S", "BlockHandle", "HBMTier", "Lease",
           "close_attachments", "open_leased_block"]

ALIGNMENT = 4096
"""Extent granularity and alignment in bytes (GPU page: GDS moves whole 4 KiB pages)."""

DEFAULT_LEASE_TTL_S = 30.0
MAX_LEASE_TTL_S = 600.0

BACKENDS = ("cuda", "shm")
_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class BlockHandle:
    """Where one leased block lives (fields as in ``proto/kvstore.proto`` ``BlockHandle``).

    Attributes:
        key: the block key.
        found: False when the key is not committed in this tier (other fields empty).
        ipc_handle: the slab's ``cudaIpcMemHandle_t`` (64 bytes), or the shared-memory
            segment name (UTF-8) for the CPU stand-in.
        offset: bytes from the address the IPC handle opens at to the block.
        size: payload bytes.
        device: CUDA device ordinal; -1 for the CPU stand-in.
    """

    key: bytes
    found: bool
    ipc_handle: bytes = b""
    offset: int = 0
    size: int = 0
    device: int = -1


class Lease(NamedTuple):
    """A granted lease; unpacks as ``lease_id, blocks, expires_at``.

    ``expires_at`` is Unix time in seconds (what the gRPC reply carries).
    """

    lease_id: str
    blocks: tuple[BlockHandle, ...]
    expires_at: float


# ---------------------------------------------------------------------- allocator

class _Slots:
    """Fixed ``slot_bytes`` slots in ``[0, capacity)``, the same interface as
    :class:`tiers.host.ExtentAllocator` (which places variable extents)."""

    def __init__(self, capacity: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.capacity = capacity - capacity % slot_bytes
        self.used = 0
        self._free = list(range(self.capacity - slot_bytes, -1, -slot_bytes))  # pop() -> lowest

    def round_up(self, nbytes: int) -> int:
        return self.slot_bytes

    @property
    def largest_free(self) -> int:
        return self.slot_bytes if self._free else 0

    def can_allocate(self, nbytes: int) -> bool:
        return 0 <= nbytes <= self.slot_bytes and bool(self._free)

    def allocate(self, nbytes: int) -> tuple[int, int]:
        if nbytes > self.slot_bytes:
            raise TierFull(f"a {nbytes}-byte block does not fit a {self.slot_bytes}-byte slot")
        if not self._free:
            raise TierFull(f"all {self.capacity // self.slot_bytes} slots are taken")
        self.used += self.slot_bytes
        return self._free.pop(), self.slot_bytes

    def release(self, start: int, size: int) -> None:
        self.used -= size
        self._free.append(start)


# ---------------------------------------------------------------------- slabs

class _ShmSlab:
    """CPU stand-in for device memory: one shared-memory segment, named by ``handle``.

    The segment is created (and unlinked) through :class:`SharedMemory`, but mapped by
    our own :class:`mmap.mmap` that every view keeps alive: closing the tier while a
    caller still holds a view unlinks the name and leaves the mapping to the last view
    (``SharedMemory.close`` would unmap it under the view). Linux (``/dev/shm``) only.
    """

    device = -1
    base_offset = 0                      # mmap is page aligned

    def __init__(self, nbytes: int, device: int):
        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            fd = os.open(os.path.join(_SHM_DIR, shm.name), os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()                      # its own mapping; the segment lives until unlink
        self._shm = shm
        self.handle = shm.name.encode()
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def write(self, offset: int, data: Any) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        self.array[offset:offset + src.size] = src

    def read_into(self, offset: int, out: np.ndarray) -> None:
        out[:] = self.array[offset:offset + out.size]

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.array[offset:offset + nbytes])

    def device_array(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass                         # a view is alive; the mapping goes with the last one


class _CudaSlab:
    """One ``cudaMalloc`` of ``nbytes`` on ``device`` (through CuPy, not its pool)."""

    def __init__(self, nbytes: int, device: int):
        import cupy
        from cupy.cuda import runtime

        self._cupy, self._rt = cupy, runtime
        self.device = device
        with cupy.cuda.Device(device):
            # cudaMalloc promises 256-byte alignment; GDS wants 4096: over-allocate and shift
            self._mem = cupy.cuda.Memory(nbytes + ALIGNMENT)
            self.handle = bytes(runtime.ipcGetMemHandle(self._mem.ptr))
        self.base_offset = (-int(self._mem.ptr)) % ALIGNMENT   # slab start, from the IPC base
        self.ptr = int(self._mem.ptr) + self.base_offset

    def write(self, offset: int, data: Any) -> None:
        rt = self._rt
        with self._cupy.cuda.Device(self.device):
            if hasattr(data, "__cuda_array_interface__"):
                src, n = cuda_buffer(data)
                rt.memcpy(self.ptr + offset, src, n, rt.memcpyDeviceToDevice)
            else:
                host = np.frombuffer(data, dtype=np.uint8)
                rt.memcpy(self.ptr + offset, host.ctypes.data, host.size, rt.memcpyHostToDevice)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        rt = self._rt
        with self._cupy.cuda.Device(self.device):
            rt.memcpy(out.ctypes.data, self.ptr + offset, out.size, rt.memcpyDeviceToHost)

    def view(self, offset: int, nbytes: int) -> memoryview:
        out = np.empty(nbytes, dtype=np.uint8)
        self.read_into(offset, out)
        return memoryview(out)

    def device_array(self, offset: int, nbytes: int):
        cupy = self._cupy
        # the views own the cupy Memory, so the slab is freed after the last of them
        mem = cupy.cuda.UnownedMemory(self.ptr + offset, nbytes, self._mem, self.device)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        self._mem = None  # cudaFree once no device_array() view holds it


# ---------------------------------------------------------------------- tier

@dataclass(eq=False)
class _Block:
    offset: int
    alloc: int               # allocator bytes (size rounded up to the unit)
    size: int                # payload bytes
    written: int = 0
    committed: bool = False
    leases: int = 0          # live leases that include this block
    doomed: bool = False     # freed while leased: hidden; space returned at the last release


@dataclass(eq=False)
class _LeaseRecord:
    deadline: float          # on the tier's clock
    blocks: list[_Block]


class HBMTier(Tier):
    """GPU memory tier (or its shared-memory CPU stand-in) with CUDA IPC leases.

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
        clock: monotonic time source in seconds for lease expiry.
        default_ttl_s: lease TTL when the caller gives none (seconds).

    Raises:
        ValueError: bad capacity, slot size or backend.
        GPUUnavailable: ``backend="cuda"`` without a GPU or without CuPy.
        MemoryError / cupy OutOfMemoryError: the slab cannot be allocated.
    """

    kind = TierKind.HBM

    def __init__(self, capacity_bytes: int, *, device: int = 0, name: str = "hbm",
                 slot_bytes: int | None = None, backend: str | None = None,
                 clock: Callable[[], float] = time.monotonic, default_ttl_s: float = DEFAULT_LEASE_TTL_S):
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
        self._clock = clock
        self._default_ttl = float(default_ttl_s)
        self._alloc = _Slots(int(capacity_bytes), slot_bytes) if slot_bytes else \
            ExtentAllocator(int(capacity_bytes), ALIGNMENT)
        self._slab = (_CudaSlab if backend == "cuda" else _ShmSlab)(self._alloc.capacity, device)
        self.device = self._slab.device
        self._blocks: dict[bytes, _Block] = {}
        self._leases: dict[str, _LeaseRecord] = {}
        self._deadlines: list[tuple[float, str]] = []   # heap of (deadline, lease id)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ capacity

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._expire()
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
            self._expire()
            return self._alloc.can_allocate(nbytes)

    # ------------------------------------------------------------------ two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"block size must be > 0 bytes, got {nbytes}")
        with self._lock:
            self._expire()
            if key in self._blocks:
                raise ValueError(f"block {key.hex()[:16]} already present in {self.name}")
            if nbytes > self.max_block_bytes:
                raise TierFull(f"{self.name}: a {nbytes}-byte block exceeds the largest block "
                               f"({self.max_block_bytes} bytes)")
            try:
                offset, alloc = self._alloc.allocate(nbytes)
            except TierFull as e:
                raise TierFull(f"{self.name}: {nbytes} bytes do not fit: {e}") from None
            self._blocks[key] = _Block(offset, alloc, nbytes)

    def _reserved(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None or b.committed:
            raise ValueError(f"block {key.hex()[:16]} is not reserved in {self.name}")
        return b

    def write(self, key: bytes, offset: int, data: Any) -> None:
        """Copy a chunk into a reserved block (see :meth:`Tier.write`).

        ``data`` is host bytes (bytes, memoryview, numpy array) or, on the CUDA
        backend, a C-contiguous device array (``__cuda_array_interface__``): a
        device-to-device copy.
        """
        b = self._reserved(key)
        n = cuda_buffer(data)[1] if hasattr(data, "__cuda_array_interface__") else memoryview(data).nbytes
        if offset != b.written:
            raise ValueError(f"chunk at offset {offset} but {b.written} bytes written so far")
        if offset + n > b.size:
            raise ValueError(f"chunk [{offset}, {offset + n}) overruns the reserved {b.size} bytes")
        self._slab.write(b.offset + offset, data)
        b.written += n

    def mark_written(self, key: bytes, nbytes: int) -> None:
        """Record that ``nbytes`` of a reserved block were filled in place through
        :meth:`device_array` (e.g. a GDS read). Raises ValueError beyond the reservation."""
        b = self._reserved(key)
        if not 0 <= nbytes <= b.size:
            raise ValueError(f"{nbytes} bytes is outside the reserved {b.size} bytes")
        b.written = nbytes

    def commit(self, key: bytes) -> None:
        with self._lock:
            b = self._reserved(key)
            if b.written != b.size:
                raise ValueError(f"block {key.hex()[:16]}: {b.written} of {b.size} bytes written")
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
            raise KeyError(key)
        return b

    def read(self, key: bytes, ranges: ByteRanges | None = None) -> bytes:
        b = self._committed(key)
        check_ranges(ranges, b.size)
        if not ranges:
            out = np.empty(b.size, dtype=np.uint8)
            self._slab.read_into(b.offset, out)
            return out.tobytes()
        parts = []
        for off, length in ranges:
            out = np.empty(length, dtype=np.uint8)
            self._slab.read_into(b.offset + off, out)
            parts.append(out.tobytes())
        return b"".join(parts)

    def read_into(self, key: bytes, out: np.ndarray | memoryview | bytearray) -> int:
        """Copy a committed block into the start of host buffer ``out`` (e.g. a slice of
        the pinned host arena: one DMA on the CUDA backend). Returns the bytes copied.

        Raises KeyError when absent, ValueError when ``out`` is smaller than the block.
        """
        b = self._committed(key)
        dst = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out.view(np.uint8)
        if dst.size < b.size:
            raise ValueError(f"out has {dst.size} bytes, the block {b.size}")
        self._slab.read_into(b.offset, dst[:b.size])
        return b.size

    def view(self, key: bytes) -> memoryview:
        """Zero-copy view on the stand-in; a fresh host copy on the CUDA backend."""
        b = self._committed(key)
        return self._slab.view(b.offset, b.size)

    def device_array(self, key: bytes):
        """1-D uint8 array over a block's bytes in the slab, without copying.

        A CuPy array on the CUDA backend (``torch.as_tensor(arr, device="cuda")``
        views it too), a numpy array on the stand-in. Works for committed blocks
        (their payload) and reservations (the reserved size). Valid while the block is
        pinned or leased. Raises KeyError when the key is neither.
        """
        b = self._blocks.get(key)
        if b is None:
            raise KeyError(key)
        return self._slab.device_array(b.offset, b.size)

    def size_of(self, key: bytes) -> int:
        return self._committed(key).size

    def free(self, key: bytes) -> None:
        """Delete a committed block. A leased one disappears at once but keeps its bytes
        (and its space in :attr:`used_bytes`) until its last lease ends."""
        with self._lock:
            b = self._committed(key)
            del self._blocks[key]
            if b.leases:
                b.doomed = True
            else:
                self._alloc.release(b.offset, b.alloc)

    # ------------------------------------------------------------------ leases

    def _expire(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            record = self._leases.pop(lease_id, None)
            if record is not None:
                self._drop_lease(record)

    def _drop_lease(self, record: _LeaseRecord) -> None:
        for b in record.blocks:
            b.leases -= 1
            if b.leases == 0 and b.doomed:
                b.doomed = False
                self._alloc.release(b.offset, b.alloc)

    def lease(self, keys: Sequence[bytes], ttl: float | None = None) -> Lease:
        """Pin blocks in place for ``ttl`` seconds and return where they are.

        Args:
            keys: block keys; one :class:`BlockHandle` per key, in order, with
                ``found=False`` for keys not committed here.
            ttl: seconds until the lease ends by itself; None: ``default_ttl_s``.
        Returns:
            ``Lease(lease_id, blocks, expires_at)``; ``lease_id`` is unguessable
            (32 hex digits), ``expires_at`` Unix time in seconds.
        Raises:
            InvalidRequest: ``ttl`` not in ``(0, MAX_LEASE_TTL_S]``.
        """
        ttl = self._default_ttl if ttl is None else float(ttl)
        if not 0.0 < ttl <= MAX_LEASE_TTL_S:  # also rejects NaN
            raise InvalidRequest(f"lease ttl must be in (0, {MAX_LEASE_TTL_S}] seconds, got {ttl}")
        handles: list[BlockHandle] = []
        held: list[_Block] = []
        with self._lock:
            self._expire()
            for key in keys:
                b = self._blocks.get(key)
                if b is None or not b.committed:
                    handles.append(BlockHandle(key, False))
                    continue
                b.leases += 1
                held.append(b)
                handles.append(BlockHandle(key, True, self._slab.handle, self._slab.base_offset + b.offset,
                                           b.size, self.device))
            lease_id = secrets.token_hex(16)
            deadline = self._clock() + ttl
            self._leases[lease_id] = _LeaseRecord(deadline, held)
            heapq.heappush(self._deadlines, (deadline, lease_id))
        return Lease(lease_id, tuple(handles), time.time() + ttl)

    def release(self, lease_id: str) -> bool:
        """End a lease early. Returns False when it is unknown or already expired."""
        with self._lock:
            self._expire()
            record = self._leases.pop(lease_id, None)
            if record is None:
                return False
            self._drop_lease(record)
            return True

    def is_leased(self, key: bytes) -> bool:
        """True while a live lease covers the committed block ``key`` (do not evict it)."""
        with self._lock:
            self._expire()
            b = self._blocks.get(key)
            return b is not None and b.leases > 0

    def num_leases(self) -> int:
        """Live leases (after expiring the overdue ones)."""
        with self._lock:
            self._expire()
            return len(self._leases)

    # ------------------------------------------------------------------ lifecycle

    def recover(self) -> Iterable[tuple[bytes, int]]:
        return ()

    def close(self) -> None:
        """Free the slab. Outstanding leases become invalid (workers must not read on)."""
        with self._lock:
            self._blocks.clear()
            self._leases.clear()
            self._deadlines.clear()
            self._slab.close()

    def describe(self) -> str:
        where = f"cuda:{self.device}" if self.backend == "cuda" else "shm stand-in"
        return f"{self.name}(hbm, {self.capacity_bytes} bytes, {where})"


# ---------------------------------------------------------------------- worker side

class _ShmAttachment:
    def __init__(self, name: str):
        if "/" in name or not name:
            raise ValueError(f"not a shared-memory segment name: {name!r}")
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._map, dtype=np.uint8)

    def block(self, offset: int, size: int) -> np.ndarray:
        if offset < 0 or offset + size > self._array.size:
            raise ValueError(f"block [{offset}, {offset + size}) outside a {self._array.size}-byte slab")
        return self._array[offset:offset + size]

    def close(self) -> None:
        pass  # unmapped when the last view is gone


class _CudaAttachment:
    def __init__(self, handle: bytes, device: int):
        import cupy
        from cupy.cuda import runtime

        self._cupy, self._rt, self.device = cupy, runtime, device
        with cupy.cuda.Device(device):
            self.ptr = int(runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))

    def block(self, offset: int, size: int):
        cupy = self._cupy
        mem = cupy.cuda.UnownedMemory(self.ptr + offset, size, self, self.device)
        return cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        if self.ptr:
            with self._cupy.cuda.Device(self.device):
                self._rt.ipcCloseMemHandle(self.ptr)
            self.ptr = 0


_attachments: dict[tuple[bytes, int], Any] = {}
_attach_lock = threading.Lock()


def open_leased_block(handle: BlockHandle):
    """Worker side: a zero-copy 1-D uint8 array over a leased block.

    The slab is opened once per process and handle (CUDA allows one
    ``cudaIpcOpenMemHandle`` of a handle per context) and kept open; call
    :func:`close_attachments` when done. CUDA does not let the process that made the
    handle open it: the daemon itself uses :meth:`HBMTier.device_array`. Returns a CuPy array for a CUDA handle
    (``device >= 0``), a read-only numpy array for the CPU stand-in. The bytes are
    valid until the lease is released or expires.

    Raises:
        ValueError: ``handle.found`` is False or the block lies outside the slab.
        FileNotFoundError: the stand-in segment no longer exists.
        GPUUnavailable: a CUDA handle in a process without a GPU or CuPy.
    """
    if not handle.found:
        raise ValueError(f"block {handle.key.hex()[:16]} was not found; it has no handle")
    cache_key = (handle.ipc_handle, handle.device)
    with _attach_lock:
        att = _attachments.get(cache_key)
        if att is None:
            if handle.device < 0:
                att = _ShmAttachment(handle.ipc_handle.decode())
            else:
                require_gpu("opening a CUDA IPC handle", cupy=True)
                att = _CudaAttachment(handle.ipc_handle, handle.device)
            _attachments[cache_key] = att
    return att.block(handle.offset, handle.size)


def close_attachments() -> None:
    """Close every slab this process opened with :func:`open_leased_block`."""
    with _attach_lock:
        for att in _attachments.values():
            att.close()
        _attachments.clear()
