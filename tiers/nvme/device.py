"""GPUDirect Storage for the NVMe tier: block files written from and read into device
memory (an HBM tier's ``device_array``) through kvikio, in the same file format as the
POSIX path (:mod:`tiers.nvme.format`), so a block written by one path is read by the
other.

- Write: the payload goes device -> file at offset H by kvikio (GDS DMA, or kvikio's
  compatibility mode), into the tier's temp file; the tier then writes the header
  (with the checksums) by POSIX and renames the file as after a host write.
- Read: the header is read and verified by POSIX, the payload file -> device at offset H
  by kvikio, then every chunk is verified.

The chunk checksums (xxh3_64) are computed on the host, so each device write and read
copies the block device -> host once through ONE reused staging buffer of
:data:`STAGING_BYTES` (pinned when page-locking succeeds): pinned D2H on an H200 runs
at tens of GB/s, above one NVMe drive's bandwidth, so this costs PCIe and CPU time
rather than throughput; it is still a host copy pure GDS would not make. One lock
serialises the buffer's users.

The device side is a :class:`DeviceBackend`; :class:`KvikioBackend` is the real one.
Tests on CPU use a backend over host memory, so the format and checks run without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

import numpy as np
import xxhash

from tiers.errors import BlockCorrupt, InvalidAccess
from tiers.gpu import GPUUnavailable, cuda_buffer
from tiers.nvme.format import HeaderError, IndexEntry, read_header

log = logging.getLogger("kvstore.tiers.nvme")

STAGING_BYTES = 8 << 20
"""Size of the one host buffer through which device blocks are checksummed (bytes)."""


class DeviceBackend(Protocol):
    """Moves bytes between device memory and files or host memory."""

    def to_host(self, host: np.ndarray, device_buf: Any, offset: int) -> None:
        """Copy device bytes ``[offset, offset + host.size)`` of ``device_buf`` into ``host``."""

    def write_file(self, path: str, device_buf: Any, nbytes: int, file_offset: int) -> None:
        """Write the first ``nbytes`` of ``device_buf`` into existing file ``path`` at
        ``file_offset``. Raises MediaIOError, OSError."""

    def read_file(self, path: str, device_buf: Any, nbytes: int, file_offset: int) -> None:
        """Read ``nbytes`` at ``file_offset`` of ``path`` into ``device_buf``. Raises
        BlockCorrupt (short file), MediaIOError, OSError."""

    def host_buffer(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A host staging buffer (uint8, ``nbytes``) and the object that owns it."""


class KvikioBackend:
    """The real device side: kvikio ``CuFile`` (:mod:`tiers.gds`) and CUDA memcpy."""

    def to_host(self, host: np.ndarray, device_buf: Any, offset: int) -> None:
        from cupy.cuda import runtime
        ptr, _ = cuda_buffer(device_buf)
        runtime.memcpy(host.ctypes.data, ptr + offset, host.size, runtime.memcpyDefault)

    def write_file(self, path: str, device_buf: Any, nbytes: int, file_offset: int) -> None:
        from tiers import gds
        gds.write_block_file(path, device_buf, nbytes, file_offset=file_offset, pad=False, truncate=False)

    def read_file(self, path: str, device_buf: Any, nbytes: int, file_offset: int) -> None:
        from tiers import gds
        gds.read_block_file(path, device_buf, nbytes, file_offset)

    def host_buffer(self, nbytes: int) -> tuple[np.ndarray, Any]:
        from tiers.gpu import allocate_pinned
        try:
            region, start = allocate_pinned(nbytes)
            return np.frombuffer(region.mapping, dtype=np.uint8, count=nbytes, offset=start), region
        except (MemoryError, GPUUnavailable) as e:
            log.warning("checksum staging buffer not pinned (%s); using pageable memory", e)
            return np.empty(nbytes, dtype=np.uint8), None


def kvikio_backend() -> DeviceBackend:
    return KvikioBackend()


class DeviceFiles:
    """The NVMe tier's device path over ``backend`` (see the module docstring)."""

    def __init__(self, backend: DeviceBackend, staging_bytes: int = STAGING_BYTES):
        self.backend = backend
        self._staging_bytes = staging_bytes
        self._lock = threading.Lock()
        self._host: np.ndarray | None = None
        self._owner: Any = None

    def device_bytes(self, device_buf: Any) -> int:
        """Bytes in a C-contiguous CUDA array. Raises InvalidAccess (not one)."""
        try:
            return cuda_buffer(device_buf)[1]
        except (TypeError, ValueError) as e:
            raise InvalidAccess(str(e)) from None

    def chunk_sums(self, device_buf: Any, size: int, chunk: int) -> list[int]:
        """xxh3_64 of each ``chunk``-byte chunk of the first ``size`` bytes of ``device_buf``,
        through the staging buffer."""
        sums: list[int] = []
        digest = xxhash.xxh3_64_intdigest
        with self._lock:
            if self._host is None:
                self._host, self._owner = self.backend.host_buffer(max(self._staging_bytes, chunk))
            step = self._host.size // chunk * chunk
            for off in range(0, size, step):
                n = min(step, size - off)
                host = self._host[:n]
                self.backend.to_host(host, device_buf, off)
                view = memoryview(host)
                sums.extend(digest(view[i:i + chunk]) for i in range(0, n, chunk))
        return sums

    def write(self, temp: str, fd: int, device_buf: Any, size: int, chunk: int, header_len: int) -> list[int]:
        """Write a block's payload from ``device_buf`` into its open temp file (``fd``, path
        ``temp``) after the header, pad it to whole pages; return the chunk checksums.
        Raises MediaIOError, OSError."""
        sums = self.chunk_sums(device_buf, size, chunk)
        if size:
            self.backend.write_file(temp, device_buf, size, header_len)
        os.ftruncate(fd, header_len + (-(-size // 4096) * 4096))
        return sums

    def read(self, path: str, key: bytes, entry: IndexEntry, device_buf: Any, what: str) -> None:
        """Read a block into the start of ``device_buf`` and verify its header and chunks.
        Raises BlockCorrupt (only on proof: a bad header or chunk, a short file),
        FileNotFoundError, MediaIOError, OSError (EMFILE, EIO: no proof)."""
        if os.path.islink(path):
            raise BlockCorrupt(f"{what}: {path} is a symbolic link")
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        try:
            header = read_header(path, key)
        except HeaderError as e:
            raise BlockCorrupt(f"{what}: {e}") from None
        if header.size != entry.size or header.chunk_bytes != entry.chunk_bytes:
            raise BlockCorrupt(f"{what}: the header says {header.size} bytes in {header.chunk_bytes}-byte "
                               f"chunks, the index {entry.size} in {entry.chunk_bytes}")
        try:
            self.backend.read_file(path, device_buf, entry.size, header.header_bytes)
        except BlockCorrupt as e:
            raise BlockCorrupt(f"{what}: {e}") from None
        got = self.chunk_sums(device_buf, entry.size, entry.chunk_bytes)
        for i, (a, b) in enumerate(zip(got, header.sums)):
            if a != b:
                raise BlockCorrupt(f"{what} fails its checksum in chunk {i}")

    def close(self) -> None:
        with self._lock:
            self._host = None
            if self._owner is not None:
                self._owner.close()
            self._owner = None


__all__ = ["DeviceBackend", "DeviceFiles", "KvikioBackend", "STAGING_BYTES", "kvikio_backend"]
