"""Worker side of HBM leases: open a leased block in place (CUDA IPC, or the CPU stand-in).

The daemon's HBM tier (:mod:`tiers.hbm`) hands out, per leased block, the slab's IPC
handle, the block's offset and size and the CUDA device (:class:`tiers.base.IpcHandle`,
the ``BlockHandle`` message of ``proto/kvstore.proto``). :func:`open_block` opens the
slab once per process and handle and returns a zero-copy array over the block.

Without a GPU the slab is a shared-memory segment under ``/dev/shm`` whose name plays
the handle (``device == -1``); it is mapped read-only.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Protocol

import numpy as np

_SHM_DIR = "/dev/shm"


class BlockLocation(Protocol):
    """Where a leased block lives (:class:`tiers.base.IpcHandle`, or a client's copy)."""

    handle: bytes
    offset: int
    size: int
    device: int


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
        try:
            import cupy
        except ImportError:
            raise RuntimeError("opening a CUDA IPC handle needs CuPy: pip install 'kvstore[gpu]'") from None
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


def open_block(handle: BlockLocation):
    """A zero-copy 1-D uint8 array over a leased block.

    The slab is opened once per process and handle (CUDA allows one
    ``cudaIpcOpenMemHandle`` of a handle per context) and kept open; call
    :func:`close_attachments` when done. CUDA does not let the process that made the
    handle open it: the daemon itself uses :meth:`HBMTier.device_array`. Returns a CuPy array for a CUDA handle
    (``device >= 0``), a read-only numpy array for the CPU stand-in. The bytes are
    valid until the lease is released or expires.

    Raises:
        ValueError: the block lies outside the slab, or a bad segment name.
        FileNotFoundError: the stand-in segment no longer exists.
        RuntimeError: a CUDA handle in a process without CuPy or a GPU.
    """
    cache_key = (handle.handle, handle.device)
    with _attach_lock:
        att = _attachments.get(cache_key)
        if att is None:
            if handle.device < 0:
                att = _ShmAttachment(handle.handle.decode())
            else:
                att = _CudaAttachment(handle.handle, handle.device)
            _attachments[cache_key] = att
    return att.block(handle.offset, handle.size)


def close_attachments() -> None:
    """Close every slab this process opened with :func:`open_block`."""
    with _attach_lock:
        for att in _attachments.values():
            att.close()
        _attachments.clear()
