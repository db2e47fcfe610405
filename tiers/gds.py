"""GPUDirect Storage: block files read and written straight from device memory (kvikio).

The helpers move a payload of ``nbytes`` bytes between device memory and a file at a
given file offset (the NVMe tier's block files put it after a page-aligned header,
:mod:`tiers.nvme.format`); with ``pad=True`` the file is then cut or extended with zeros
to ``file_offset + padded_size(nbytes)``.

kvikio's ``CuFile`` moves the bytes: by GDS (NVMe <-> GPU DMA, no host copy) when the
cuFile driver and file system allow it, otherwise in its compatibility mode (POSIX
reads/writes through kvikio's own pinned bounce buffers). :func:`gds_info` says which.
Page-aligned device addresses and sizes take the direct path; the HBM tier places
blocks on 4096-byte boundaries for that reason.

These helpers do the I/O only. File naming, the header, the ``.tmp`` + rename protocol,
the index and checksums belong to the NVMe tier (:mod:`tiers.nvme.device`).

Every function here needs a CUDA GPU and kvikio; on a CPU machine they raise
:class:`tiers.gpu.GPUUnavailable` and the NVMe tier uses POSIX I/O.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from tiers.errors import BlockCorrupt, MediaIOError

from tiers.gpu import GPUUnavailable, cuda_buffer, gpu_info

__all__ = ["PAGE", "GDSInfo", "gds_available", "gds_info", "padded_size", "read_block_file",
           "write_block_file"]

PAGE = 4096
"""O_DIRECT / GDS unit in bytes; padded files are a multiple of it."""


@dataclass(frozen=True)
class GDSInfo:
    """What :func:`gds_info` found.

    Attributes:
        available: kvikio imports and a CUDA GPU is present: the helpers here work.
        mode: ``"gds"`` (kvikio will try the cuFile driver), ``"compat"`` (kvikio's POSIX
            compatibility mode) or ``""`` when not available.
        reason: why not available (empty when available).
    """

    available: bool
    mode: str
    reason: str


def _compat_mode_preferred() -> bool:
    """kvikio's own answer to "POSIX compatibility mode or real GDS?". ``kvikio.defaults`` is
    a submodule that kvikio >= 26 no longer imports with the package, so it is imported here."""
    defaults = importlib.import_module("kvikio.defaults")
    if hasattr(defaults, "is_compat_mode_preferred"):      # kvikio >= 25.02
        return bool(defaults.is_compat_mode_preferred())
    return bool(defaults.compat_mode())                      # kvikio 24.x


@functools.lru_cache(maxsize=1)
def gds_info() -> GDSInfo:
    """Detect kvikio once (cached), after the GPU detection of :mod:`tiers.gpu`. Never raises.

    Without kvikio installed it answers at once, without the GPU detection (which imports
    CuPy and torch): the NVMe tier asks this at construction (``io = "auto"``).
    """
    if importlib.util.find_spec("kvikio") is None:
        return GDSInfo(False, "", "kvikio is not installed (pip install 'kvstore[gpu]')")
    gpu = gpu_info()
    if not gpu.available:
        return GDSInfo(False, "", gpu.reason)
    try:
        import kvikio  # noqa: F401  (its settings are read below)
    except ImportError:
        return GDSInfo(False, "", "kvikio is not installed (pip install 'kvstore[gpu]')")
    except Exception as e:
        return GDSInfo(False, "", f"kvikio failed to import ({type(e).__name__}: {e})")
    try:
        mode = "compat" if _compat_mode_preferred() else "gds"
    except Exception as e:
        return GDSInfo(False, "", f"kvikio cannot read its settings ({type(e).__name__}: {e})")
    return GDSInfo(True, mode, "")


def gds_available() -> bool:
    """True when the helpers here can run (see :func:`gds_info`)."""
    return gds_info().available


def padded_size(nbytes: int, page: int = PAGE) -> int:
    """Bytes a padded block file of ``nbytes`` payload bytes has: whole pages, at least one."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return -(-max(nbytes, 1) // page) * page


def _kvikio():
    info = gds_info()
    if not info.available:
        raise GPUUnavailable(f"GPUDirect Storage needs a CUDA GPU and kvikio ({info.reason})")
    import kvikio
    return kvikio


def _payload_bytes(buf: Any, nbytes: int | None) -> int:
    available = cuda_buffer(buf)[1]
    n = available if nbytes is None else nbytes
    if not 0 <= n <= available:
        raise ValueError(f"{n} bytes requested but the device buffer has {available}")
    return n


def write_block_file(path: str | os.PathLike[str], buf: Any, nbytes: int | None = None, *,
                     file_offset: int = 0, pad: bool = True, fsync: bool = False, truncate: bool = True) -> int:
    """Write the first ``nbytes`` bytes of device buffer ``buf`` to file ``path`` at
    ``file_offset`` (bytes).

    Args:
        path: file to write; created and truncated when ``truncate``, else it must exist
            and its other bytes are kept. The caller picks a temporary name and renames
            it when the block is complete.
        buf: C-contiguous device array (CuPy array, torch CUDA tensor, an HBM tier's
            ``device_array(key)``), any dtype; ``nbytes`` counts bytes.
        nbytes: payload bytes (default: the whole buffer).
        file_offset: where the payload starts in the file (bytes, a multiple of 4096 for GDS).
        pad: make the file ``file_offset + padded_size(nbytes)`` bytes (zeros after the payload).
        fsync: flush the file to the device before returning.
        truncate: create/truncate the file (False: write into the existing file).
    Returns:
        the file's size in bytes when ``pad``, else ``file_offset + nbytes``.
    Raises:
        GPUUnavailable: no GPU or no kvikio.
        ValueError: ``nbytes`` larger than the buffer; TypeError: not a device buffer.
        MediaIOError: the write failed or was short (a file it created is removed).
    """
    kvikio = _kvikio()
    n = _payload_bytes(buf, nbytes)
    size = file_offset + (padded_size(n) if pad else n)
    try:
        f = kvikio.CuFile(path, "w" if truncate else "r+")
        try:
            written = f.write(buf, size=n, file_offset=file_offset) if n else 0
        finally:
            f.close()
        if written != n:
            raise MediaIOError(f"short GDS write to {os.fspath(path)!r}: {written} of {n} bytes")
        if pad:
            os.truncate(path, size)                  # the tail reads as zeros
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except MediaIOError:
        if truncate:
            _remove_quietly(path)
        raise
    except (OSError, RuntimeError) as e:             # kvikio raises RuntimeError for cuFile errors
        if truncate:
            _remove_quietly(path)
        raise MediaIOError(f"GDS write of {n} bytes to {os.fspath(path)!r} failed: {e}") from e
    return size


def read_block_file(path: str | os.PathLike[str], buf: Any, nbytes: int, file_offset: int = 0) -> None:
    """Read ``nbytes`` payload bytes at ``file_offset`` of a file into device buffer ``buf``.

    Accepts padded and unpadded files. Does not verify a checksum (the caller does).

    Raises:
        GPUUnavailable: no GPU or no kvikio.
        ValueError: ``nbytes`` larger than the buffer; TypeError: not a device buffer.
        FileNotFoundError: no such file.
        BlockCorrupt: the file ends before ``file_offset + nbytes``.
        MediaIOError: the read failed or returned fewer bytes than the file holds.
    """
    kvikio = _kvikio()
    n = _payload_bytes(buf, nbytes)
    try:
        on_disk = os.stat(path).st_size
    except FileNotFoundError:
        raise
    except OSError as e:
        raise MediaIOError(f"cannot stat {os.fspath(path)!r}: {e}") from e
    if on_disk < file_offset + n:
        raise BlockCorrupt(f"block file {os.fspath(path)!r} is truncated: {on_disk} of {file_offset + n} bytes")
    if n == 0:
        return
    try:
        f = kvikio.CuFile(path, "r")
        try:
            got = f.read(buf, size=n, file_offset=file_offset)
        finally:
            f.close()
    except (OSError, RuntimeError) as e:
        raise MediaIOError(f"GDS read of {n} bytes from {os.fspath(path)!r} failed: {e}") from e
    if got != n:                       # the file is long enough (above): the read, not the block, failed
        raise MediaIOError(f"short GDS read from {os.fspath(path)!r}: {got} of {n} bytes")


def _remove_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
