"""The one place that decides whether a CUDA GPU is used, and pinned host memory.

Detection runs once per process (:func:`gpu_info`, cached) and every GPU code path in
``tiers`` asks it: the HBM tier, the pinned host arena and GPUDirect Storage. A
machine counts as having a GPU when CuPy (``cupy.cuda.is_available()``) or torch
(``torch.cuda.is_available()``) sees at least one CUDA device. Neither library is
needed on a CPU machine: a missing import just means "no GPU".

Pinned memory: :func:`allocate_pinned` maps one anonymous region and page-locks it
with ``cudaHostRegister`` (portable, so every device and context treats it as
pinned). One registration of the exact size, rather than ``cudaHostAlloc`` through
a caching allocator (torch's host allocator rounds a request up to a power of two:
a 24 GiB host tier would pin 32 GiB).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from dataclasses import dataclass

__all__ = ["GPUInfo", "GPUUnavailable", "PinnedRegion", "allocate_pinned", "cuda_buffer", "gpu_available",
           "gpu_info", "require_gpu"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class GPUUnavailable(RuntimeError):
    """A GPU code path was asked for on a machine (or build) that cannot run it."""


@dataclass(frozen=True)
class GPUInfo:
    """What :func:`gpu_info` found.

    Attributes:
        available: at least one CUDA device is usable.
        device_count: number of CUDA devices (0 without a GPU).
        cupy: CuPy imports and sees a device (needed by the HBM tier, IPC and kernels).
        torch: torch was built with CUDA and sees a device.
        reason: why there is no GPU (empty when ``available``), for logs and test skips.
    """

    available: bool
    device_count: int
    cupy: bool
    torch: bool
    reason: str


def _probe_cupy() -> tuple[bool, int, str]:
    try:
        import cupy
    except ImportError:
        return False, 0, "cupy is not installed"
    except Exception as e:  # a broken CUDA install can fail at import, not only ImportError
        return False, 0, f"cupy failed to import ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return False, 0, "cupy.cuda.is_available() is False"
        return True, int(cupy.cuda.runtime.getDeviceCount()), ""
    except Exception as e:
        return False, 0, f"cupy cannot reach the CUDA driver ({type(e).__name__}: {e})"


def _probe_torch() -> tuple[bool, int, str]:
    try:
        import torch
    except ImportError:
        return False, 0, "torch is not installed"
    try:
        if not torch.cuda.is_available():
            return False, 0, "torch.cuda.is_available() is False"
        return True, int(torch.cuda.device_count()), ""
    except Exception as e:
        return False, 0, f"torch cannot reach the CUDA driver ({type(e).__name__}: {e})"


@functools.lru_cache(maxsize=1)
def gpu_info() -> GPUInfo:
    """Detect CUDA GPUs once (cached for the life of the process).

    Never raises: every failure is a ``GPUInfo(available=False, reason=...)``.
    """
    has_cupy, n_cupy, why_cupy = _probe_cupy()
    has_torch, n_torch, why_torch = _probe_torch()
    count = max(n_cupy, n_torch)
    available = (has_cupy or has_torch) and count > 0
    reason = "" if available else f"no CUDA GPU: {why_cupy or 'cupy sees no device'}; " \
                                  f"{why_torch or 'torch sees no device'}"
    return GPUInfo(available=available, device_count=count, cupy=has_cupy, torch=has_torch, reason=reason)


def gpu_available() -> bool:
    """True when a CUDA GPU can be used (see :func:`gpu_info`)."""
    return gpu_info().available


def require_gpu(what: str, *, cupy: bool = False) -> GPUInfo:
    """Return :func:`gpu_info`, or raise GPUUnavailable saying that ``what`` needs a GPU.

    With ``cupy=True`` CuPy must also be usable (the HBM tier and CUDA IPC use it).
    """
    info = gpu_info()
    if not info.available:
        raise GPUUnavailable(f"{what} needs a CUDA GPU ({info.reason})")
    if cupy and not info.cupy:
        raise GPUUnavailable(f"{what} needs CuPy on this GPU machine: pip install 'kvstore[gpu]'")
    return info


def _host_register(ptr: int, nbytes: int) -> str:
    """Page-lock ``[ptr, ptr + nbytes)``; returns the library that did it."""
    info = gpu_info()
    if info.cupy:
        from cupy.cuda import runtime
        runtime.hostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
        return "cupy"
    import torch
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    if err != 0:
        raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")
    return "torch"


def _host_unregister(ptr: int, backend: str) -> None:
    if backend == "cupy":
        from cupy.cuda import runtime
        runtime.hostUnregister(ptr)
    else:
        import torch
        torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedRegion:
    """One page-locked host mapping of ``nbytes`` bytes (page aligned).

    ``mapping`` is the :class:`mmap.mmap` holding the bytes (a new anonymous one, or the
    one given); ``ptr`` its address.
    :meth:`close` unregisters it (idempotent); the mapping itself is unmapped when
    the last view of it is gone, so a view held elsewhere never dangles.
    """

    def __init__(self, nbytes: int, mapping: mmap.mmap | None = None):
        if nbytes <= 0:
            raise ValueError(f"a pinned region needs nbytes > 0, got {nbytes}")
        require_gpu("pinned host memory")
        self.nbytes = nbytes
        # shared (not private) pages: a fork cannot turn them copy-on-write under DMA. A
        # given mapping (the shared host arena's memfd) is pinned in place, not copied.
        owned = mapping is None
        self.mapping = mmap.mmap(-1, nbytes) if owned else mapping
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self._lock = threading.Lock()
        try:
            self._backend: str | None = _host_register(self.ptr, nbytes)
        except Exception as e:
            if owned:
                self.mapping.close()
            raise MemoryError(f"cannot pin {nbytes} bytes of host memory: {e}") from e

    @property
    def registered(self) -> bool:
        return self._backend is not None

    def close(self) -> None:
        with self._lock:
            if self._backend is not None:
                backend, self._backend = self._backend, None
                _host_unregister(self.ptr, backend)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def allocate_pinned(nbytes: int, alignment: int = 4096) -> tuple[PinnedRegion, int]:
    """One pinned host allocation of at least ``nbytes`` bytes.

    Returns ``(region, start)`` where ``region.ptr + start`` is aligned to
    ``alignment`` bytes and ``[start, start + nbytes)`` lies inside the region.
    Mappings are page aligned, so ``start`` is 0 for alignments up to the page size.

    Raises:
        GPUUnavailable: no CUDA GPU.
        ValueError: ``nbytes <= 0`` or an alignment that is not a power of two.
        MemoryError: the mapping or the page-locking failed (e.g. RLIMIT_MEMLOCK).
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    extra = 0 if alignment <= mmap.PAGESIZE else alignment
    region = PinnedRegion(nbytes + extra)
    start = (-region.ptr) % alignment
    return region, start


def cuda_buffer(obj) -> tuple[int, int]:
    """``(device pointer, nbytes)`` of a C-contiguous array exposing ``__cuda_array_interface__``
    (CuPy arrays, torch CUDA tensors). Raises ValueError for a strided view, TypeError
    for an object without the interface. Needs no GPU (it only reads the interface)."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError(f"{type(obj).__name__} is not a CUDA array") from None
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    count = 1
    for dim in shape:
        count *= dim
    strides = cai.get("strides")
    if strides is not None and count > 1:
        expected, step = [], itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if any(d > 1 and s != e for d, s, e in zip(shape, strides, reversed(expected))):
            raise ValueError("CUDA buffers must be C-contiguous")
    return int(cai["data"][0]), count * itemsize
