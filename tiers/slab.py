"""The memory of the HBM tier: one slab of bytes that blocks are placed in, and how a
worker process finds it.

- :class:`CudaSlab`: one ``cudaMalloc`` on a GPU; its ``cudaIpcMemHandle_t`` is the
  ``handle`` a worker on the same GPU opens (:func:`kvstore.client.ipc.open_block`).
- :class:`ShmSlab`: the CPU stand-in, one :class:`multiprocessing.shared_memory.SharedMemory`
  segment; its name is the ``handle`` (``device == -1``), mapped read-only by a worker
  (Linux ``/dev/shm``).

Both have one interface: ``handle``, ``device``, ``base_offset`` (bytes from the address
the handle opens at to the slab's first byte), ``write``, ``read_into``, ``view``,
``device_array`` and ``close``, all addressed by byte offset in the slab.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from tiers.gpu import cuda_buffer
from tiers.host_copy import copy

_SHM_DIR = "/dev/shm"


class ShmSlab:
    """CPU stand-in for device memory: one shared-memory segment, named by ``handle``.

    The segment is created (and unlinked) through :class:`SharedMemory`, but mapped by
    our own :class:`mmap.mmap` that every view keeps alive: closing the tier while a
    caller still holds a view unlinks the name and leaves the mapping to the last view
    (``SharedMemory.close`` would unmap it under the view). Linux (``/dev/shm``) only.
    """

    device = -1
    base_offset = 0                      # mmap is page aligned

    def __init__(self, nbytes: int):
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
        copy(self.array[offset:offset + src.size], src)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        copy(out, self.array[offset:offset + out.size])

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


class CudaSlab:
    """One ``cudaMalloc`` of ``nbytes`` on ``device`` (through CuPy, not its pool), its
    start aligned to ``alignment`` bytes (a power of two)."""

    def __init__(self, nbytes: int, device: int, alignment: int):
        import cupy
        from cupy.cuda import runtime

        self._cupy, self._rt = cupy, runtime
        self.device = device
        with cupy.cuda.Device(device):
            # cudaMalloc promises 256-byte alignment; GDS wants 4096: over-allocate and shift
            self._mem = cupy.cuda.Memory(nbytes + alignment)
            self.handle = bytes(runtime.ipcGetMemHandle(self._mem.ptr))
        self.base_offset = (-int(self._mem.ptr)) % alignment   # slab start, from the IPC base
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


__all__ = ["CudaSlab", "ShmSlab"]
