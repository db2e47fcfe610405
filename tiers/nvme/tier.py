"""The NVMe tier: one self-describing file per block on a local disk, an LMDB index;
blocks survive restarts.

Modules (one responsibility each):

==========================  =============================================================
:mod:`tiers.nvme.tier`      the tier: the Tier interface, reads, frees, device files
:mod:`tiers.nvme.folder`    the folder opened: lock, O_DIRECT probe, index reconciled, removal
:mod:`tiers.nvme.format`    on-disk format: folder layout, block header, index values
:mod:`tiers.nvme.commit`    the two-phase write protocol: reservations, temp files, commit
:mod:`tiers.nvme.group`     group commit: fsync'ed commits in flight share their flushes
:mod:`tiers.nvme.write`     writing a block file (chunk checksums, O_DIRECT staging)
:mod:`tiers.nvme.read`      ranged, verified reads straight into the caller's buffer
:mod:`tiers.nvme.files`     folder lock, aligned buffers, O_DIRECT probe, vectored I/O
:mod:`tiers.nvme.index`     the LMDB index, checked before it is mapped
:mod:`tiers.nvme.recover`   index <-> files reconciliation at start
:mod:`tiers.nvme.repair`    offline index repair and audit of a closed folder
:mod:`tiers.nvme.space`     capacity accounting, disk full
:mod:`tiers.nvme.spare`     freed files kept for reuse
:mod:`tiers.nvme.parked`    evicted blocks' files parked for the next write
:mod:`tiers.nvme.device`    GPUDirect Storage (kvikio) in the same format
==========================  =============================================================

Crash safety (SIGKILL at any point): a block is written to a temp file (``<hex>.tmp``, or
a spare file where it lies; payload, then the header with its checksums), renamed to
``<hex>`` (so a file with a block's name is always complete), then indexed; a free moves
the file away before it drops the index entry, so a freed block never comes back (an
evicted block's file is parked for the next write instead: :mod:`tiers.nvme.parked`). At
start (:mod:`tiers.nvme.recover`) temp files are deleted and every other file is checked
against the index; a block file the index does not know (a crash between rename and
index update, a lost or damaged index) is indexed from its header. With ``fsync=True`` files, folders and the index are also
flushed before a block is visible (power-loss safety), in that order; commits in flight
together share one index transaction and issue their flushes together
(:mod:`tiers.nvme.group`), so the cost is per batch of commits rather than per block.

Reads verify every byte they serve: the header (magic, checksum, key, size) and the
xxh3_64 of every chunk read; a missing, truncated, misplaced or altered file raises
:class:`~tiers.errors.BlockCorrupt`, never wrong bytes. A file that cannot be opened or
read now (EMFILE, ENFILE, EIO, ...) raises :class:`~tiers.errors.MediaIOError`: that
proves nothing about the block, which stays stored and readable once the fault is gone.

Disk full (ENOSPC/EDQUOT while writing, e.g. a capacity larger than the free space): the
write raises :class:`~tiers.errors.DiskFull`; from then on :attr:`NVMeTier.capacity_bytes`
is what the disk can take (its blocks, spare files and free space) until the disk has
room for the configured capacity again, so the manager evicts instead of failing.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from tiers.base import Tier, TierKind
from tiers.buffers import ByteRanges, byte_view, check_ranges, output_view
from tiers.capabilities import NO_CAPABILITIES, Capabilities
from tiers.errors import BlockCorrupt, BlockMissing, BlockNotStored, InvalidAccess, MediaIOError
from tiers.gds import gds_available, gds_info
from tiers.nvme.commit import Reservations
from tiers.nvme.files import BufferPool, ReadThreads
from tiers.nvme.folder import BlockFolder
from tiers.nvme.format import (
    DEFAULT_CHUNK_BYTES,
    IndexEntry,
    block_path,
    check_chunk_bytes,
    file_bytes,
    floor_page,
    header_bytes,
)
from tiers.nvme.read import HeaderCache, ReadCounters, read_block
from tiers.nvme.write import BlockWriter

IO_CHOICES = ("auto", "posix", "gds")


class NVMeTier(Tier):
    """Blocks as files under ``path`` with an LMDB index (format: :mod:`tiers.nvme.format`).

    Args:
        path: the tier's folder (created if missing). One process at a time may open it.
        capacity_bytes: bytes of disk the tier may use: each block costs its whole file,
            header and padding included (:func:`tiers.nvme.format.file_bytes`).
        name: tier name in logs and stats.
        io: ``"posix"``, ``"gds"`` (also move blocks to and from device memory through
            kvikio, declared as ``capabilities.device_files``; needs a CUDA GPU and
            kvikio) or ``"auto"`` (gds when :func:`tiers.gds.gds_available`). Host
            writes and reads use POSIX I/O in every mode.
        fsync: flush files, folders and the index to the device before a commit returns
            (commits from several threads share the flushes: :mod:`tiers.nvme.group`).
        direct: None probes the filesystem and uses O_DIRECT when it is accepted; False
            forces buffered I/O; True requires O_DIRECT.
        chunk_bytes: checksum granularity of new blocks (a power of two >= 4096 bytes):
            a ranged read reads and verifies whole chunks.
        map_size: initial LMDB map size in bytes; doubled whenever the index fills it.
        max_buffer_bytes: bytes of free aligned buffers kept for reuse.
        header_cache_bytes: memory for the chunk checksums of recently written or read
            blocks (a read of a cached block skips its header).
        read_threads: threads issuing the separate reads of one ranged read together
            (a TP rank's KV heads); 1 reads them one by one.
        spare_files: most freed files kept for reuse in ``path/spare`` (0: none); a write
            into a reused file overwrites its extents (2-3x faster than into a new file
            on ext4: :mod:`tiers.nvme.spare`).
        spare_bytes: most bytes those files may hold, on disk in addition to
            :attr:`used_bytes`; default: what the capacity leaves beside the blocks (a
            reservation that needs more removes spare files first), so blocks and spare
            files together never take more than ``capacity_bytes``: :mod:`tiers.nvme.spare`.
        rebuild_index: move the index aside and rebuild it from the block files
            (what :func:`tiers.nvme.repair.repair_index` does).

    Opening (:class:`tiers.nvme.folder.BlockFolder`) reconciles the index with the files
    (:mod:`tiers.nvme.recover`; the outcome is :attr:`recovery`) and deletes the oldest blocks beyond ``capacity_bytes``.
    Reads and writes of different blocks may run concurrently from several threads.

    Raises:
        ValueError: a bad argument, ``io="gds"`` without a CUDA GPU and kvikio.
        MediaUnavailable: ``path`` cannot be used, is held by another process, refuses
            O_DIRECT with ``direct=True``, or has an index that cannot be rebuilt.
    """

    kind = TierKind.NVME
    volatile = False

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, name: str = "nvme",
                 io: str = "auto", fsync: bool = False, direct: bool | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, map_size: int = 1 << 30,
                 max_buffer_bytes: int = 64 << 20, header_cache_bytes: int = 32 << 20, read_threads: int = 4,
                 spare_files: int = 16384, spare_bytes: int | None = None, rebuild_index: bool = False):
        if io not in IO_CHOICES:
            raise ValueError(f"io must be one of {', '.join(IO_CHOICES)}, got {io!r}")
        if io == "gds" and not gds_available():
            raise ValueError(f"io = gds needs a CUDA GPU and kvikio ({gds_info().reason})")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity must be an integer >= 0 bytes, got {capacity_bytes!r}")
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.name = name
        self.io = "gds" if io == "gds" or (io == "auto" and gds_available()) else "posix"
        self.path = os.path.abspath(os.fspath(path))
        self._fsync = bool(fsync)
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._counts = [0, 0, 0]             # reads, bytes served, bytes read
        self._closed = False
        self._headers = HeaderCache(header_cache_bytes)
        self._threads = ReadThreads(read_threads) if read_threads > 1 else None
        self._device = None
        self._folder = BlockFolder(self.path, capacity_bytes, name=name, direct=direct, fsync=self._fsync,
                                   map_size=map_size, spare_files=spare_files, spare_bytes=spare_bytes,
                                   rebuild_index=rebuild_index)
        self.direct = self._folder.direct
        self.recovery = self._folder.recovery
        self._index, self._space = self._folder.index, self._folder.space
        self._blocks_dir = self._folder.blocks_dir
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.direct else 0)
        self._pool = BufferPool(max_buffer_bytes)
        self._writes = Reservations(folder=self.path, name=self.name, lock=self._lock, index=self._index,
                                    space=self._space, writer=BlockWriter(self.direct, self._pool),
                                    spares=self._folder.spares, parked=self._folder.parked,
                                    remove_file=self._folder.remove_file, direct=self.direct,
                                    fsync=self._fsync, headers=self._headers)
        if self.io == "gds":
            from tiers.nvme.device import DeviceFiles, kvikio_backend
            self._device = DeviceFiles(kvikio_backend())

    # -------------------------------------------------------------- accounting

    @property
    def capabilities(self) -> Capabilities:
        """``device_files`` (GPUDirect Storage) when ``io`` is ``"gds"``."""
        return Capabilities(device_files=self) if self._device is not None else NO_CAPABILITIES

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity; after the disk filled up (DiskFull), what the disk can
        take, until it has room for the configured capacity again."""
        return self._space.capacity

    @property
    def used_bytes(self) -> int:
        return self._space.used

    @property
    def max_block_bytes(self) -> int:
        cap = self.capacity_bytes
        return max(0, floor_page(cap - header_bytes(cap, self.chunk_bytes)))

    @property
    def spare_bytes(self) -> int:
        """Bytes (at most) in spare and parked files: on disk, but outside :attr:`used_bytes`."""
        return self._folder.spare_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._index.entries

    def __len__(self) -> int:
        return len(self._index.entries)

    def fits(self, nbytes: int) -> bool:
        return nbytes >= 0 and self._space.fits(file_bytes(nbytes, self.chunk_bytes))

    def size_of(self, key: bytes) -> int:
        return self._entry(key).size

    def read_counters(self) -> ReadCounters:
        """Reads since the tier opened, with the bytes read from the files (amplification)."""
        with self._counts_lock:
            return ReadCounters(*self._counts)

    def _entry(self, key: bytes) -> IndexEntry:
        entry = self._index.entries.get(key)
        if entry is None:
            raise BlockNotStored(f"block {bytes(key).hex()[:16]} is not stored in {self.name}")
        return entry

    def _raise_if_freed(self, key: bytes, entry: IndexEntry) -> None:
        """Raise BlockNotStored when ``key`` is no longer indexed as ``entry``: a read that
        found its file missing or altered raced a free (and the file's reuse), which proves
        nothing about the bytes stored."""
        if self._index.entries.get(key) is not entry:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}") from None

    def _file(self, key: bytes) -> str:
        return block_path(self._blocks_dir, key)

    def _what(self, key: bytes) -> str:
        return f"{self.name}: block {key.hex()[:16]}"

    # -------------------------------------------------------------- two-phase write (nvme_commit)

    def reserve(self, key: bytes, nbytes: int) -> None:
        self._writes.reserve(key, nbytes, self.chunk_bytes)

    def write(self, key: bytes, offset: int, data: Any) -> None:
        self._writes.write(key, offset, byte_view(data))

    def commit(self, key: bytes) -> None:
        self._writes.commit(key)

    def abort(self, key: bytes) -> None:
        self._writes.abort(key)

    # -------------------------------------------------------------- reads

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Read a block (or ``ranges`` of it, concatenated) into the start of ``out``,
        reading from the file only the chunks the ranges touch and verifying each against
        the header (see :mod:`tiers.nvme.read`). Page-aligned ``out`` under O_DIRECT is
        filled by the kernel directly; other buffers through a pooled bounce buffer.

        Raises BlockNotStored, InvalidAccess (a range outside the block, ``out`` too small
        or read-only), BlockCorrupt (missing, truncated, misplaced or altered file: the
        caller frees the block), MediaIOError (the open or a read failed: EMFILE, EIO, ...;
        the block stays)."""
        entry = self._entry(key)
        total = check_ranges(ranges, entry.size)
        view = output_view(out, total)
        path = self._file(key)
        try:
            fd = os.open(path, self._read_flags)
        except OSError as e:
            self._raise_if_freed(key, entry)
            if e.errno == errno.ENOENT:
                raise BlockMissing(f"{self._what(key)}: file {path} is missing") from None
            if e.errno == errno.ELOOP:
                raise BlockCorrupt(f"{self._what(key)}: {path} is a symbolic link") from None
            raise MediaIOError(f"{self.name}: cannot open {path}: {e}") from e
        try:
            nread, sums = read_block(fd, key, entry, view, ranges, direct=self.direct, pool=self._pool,
                                     what=self._what(key),
                                     sums=self._headers.get(key, entry.size, entry.chunk_bytes),
                                     threads=self._threads)
            if sums is not None:
                self._headers.put(key, entry.size, entry.chunk_bytes, sums)
        except BlockCorrupt:
            self._headers.drop(key)
            self._raise_if_freed(key, entry)
            raise
        except OSError as e:
            raise MediaIOError(f"{self.name}: reading block {key.hex()[:16]} failed: {e}") from e
        finally:
            os.close(fd)
        with self._counts_lock:
            self._counts[0] += 1
            self._counts[1] += total
            self._counts[2] += nread
        return total

    # -------------------------------------------------------------- device files (GDS)

    def write_from_device(self, key: bytes, device_buf: Any) -> None:
        """Fill a whole reservation from C-contiguous device array ``device_buf`` (at least
        the reserved size in bytes) by kvikio (:mod:`tiers.nvme.device`); :meth:`commit`
        then writes the header and publishes the block as after :meth:`write`.

        Raises BlockNotStored (not reserved), InvalidAccess (already partly written, a
        buffer too small or not a CUDA array), DiskFull/MediaIOError (the reservation is
        then dropped), MediaIOError when ``io`` is not ``"gds"``.
        """
        device = self._require_device()
        self._writes.write_from_device(key, device, device_buf, device.device_bytes(device_buf))

    def read_into_device(self, key: bytes, device_buf: Any) -> int:
        """Read a committed block into the start of device array ``device_buf`` by kvikio
        and verify its header and every chunk; return its size in bytes. On BlockCorrupt
        the buffer holds the bad bytes (the caller drops them).

        Raises BlockNotStored (also when the block was freed during the read), BlockCorrupt
        (missing, truncated, altered file), InvalidAccess (buffer too small or not a CUDA
        array), MediaIOError.
        """
        device = self._require_device()
        entry = self._entry(key)
        if device.device_bytes(device_buf) < entry.size:
            raise InvalidAccess(f"the device buffer is smaller than the block's {entry.size} bytes")
        path = self._file(key)
        try:
            device.read(path, key, entry, device_buf, self._what(key))
        except FileNotFoundError:
            self._raise_if_freed(key, entry)
            raise BlockMissing(f"{self._what(key)}: file {path} is missing") from None
        except BlockCorrupt:
            self._raise_if_freed(key, entry)
            raise
        except (OSError, RuntimeError) as e:
            raise MediaIOError(f"{self.name}: reading block {key.hex()[:16]} failed: {e}") from e
        with self._counts_lock:
            self._counts[0] += 1
            self._counts[1] += entry.size
            self._counts[2] += entry.file_bytes
        return entry.size

    def _require_device(self):
        if self._device is None:
            raise MediaIOError(f"{self.name}: device file I/O needs io = gds (this tier uses {self.io})")
        return self._device

    # -------------------------------------------------------------- free, restart, close

    def free(self, key: bytes) -> None:
        """Free a block: gone for readers and its space back at once (tier's lock held); its file
        and index entry go after it, without the lock (:meth:`BlockFolder.drop`; reservations
        and the tier's close wait for it)."""
        with self._lock:
            entry = self._entry(key)
            self._headers.drop(key)
            self._folder.forget(key, entry)
            self._writes.frees.begin_locked()
        try:
            self._folder.drop(key, entry)
        finally:
            self._writes.frees.end()

    def evict(self, key: bytes) -> None:
        """Free a block to make room for the next reservation, with no disk I/O: gone for
        readers and its space back at once; its file is *parked* (:mod:`tiers.nvme.parked`):
        the next reservation's writer thread reuses it and deletes its index entry. A crash
        before that brings the block back at the next start; a graceful close does not.
        Raises BlockNotStored."""
        with self._lock:
            if not self._closed:                # closed: nothing would move it; freed instead
                entry = self._entry(key)
                self._headers.drop(key)
                self._folder.forget(key, entry)
                self._folder.parked.park(key, self._file(key), entry.file_bytes)
                return
        self.free(key)

    def forget_evicted(self, key: bytes) -> None:
        """A deleted block's parked file (if :meth:`evict` left one) goes now, with its index entry."""
        self._writes.frees.drop_parked(key)

    def recover(self) -> list[tuple[bytes, int]]:
        """The blocks held, as ``(key, payload bytes)``, oldest written first. Opening the
        tier already reconciled the index with the files (:attr:`recovery` says what it found)."""
        with self._lock:
            items = sorted(self._index.entries.items(), key=lambda kv: kv[1].written_at)
        return [(key, entry.size) for key, entry in items]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writes.close()
        self._pool.close()
        if self._threads is not None:
            self._threads.close()
        if self._device is not None:
            self._device.close()
        self._folder.close()              # spare files, index, folder lock

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        if self._device is not None:
            mode += f", kvikio {gds_info().mode} for device buffers"
        return f"{self.name}(nvme, {self.capacity_bytes} bytes, {self.path}, {mode})"


__all__ = ["IO_CHOICES", "NVMeTier", "ReadCounters"]
