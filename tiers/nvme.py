"""The NVMe tier: one file per block on a local disk, indexed in LMDB; survives restarts.

On-disk format (under the tier's folder ``path``)::

    path/LOCK                      held (flock) by the one process that owns the tier
    path/index/                    LMDB environment: key (32 bytes) -> 24-byte value
    path/blocks/ab/cd/<key hex>    one block's payload: 64 lowercase hex digits of the key,
                                   ab and cd being its first four hex digits
    path/blocks/ab/cd/<key hex>.tmp    a block being written (never read; removed at recovery)
    path/spare/<number>            freed blocks' files kept for reuse; they hold no block

- A block file holds the payload bytes from offset 0. Written with O_DIRECT or from device
  memory (:meth:`NVMeTier.write_device`, kvikio) it is padded with zeros to a multiple of
  4096 bytes; written with buffered I/O it has the exact payload size. Readers accept both
  (the index has the real size), so a block written by either path is read by the other.
- The index value is little-endian ``<QQd``: payload size in bytes, xxh3_64 of the
  payload, write time in Unix seconds.
- Keys appear on disk only as hex, so no key, however hostile, names another path.

Crash safety (SIGKILL at any point): a block is written to ``<hex>.tmp``, renamed to
``<hex>`` (so a partial file never carries the final name), then indexed in one LMDB
transaction; a free removes the index entry before the file. After a crash the
leftovers are temp files and files without an index entry, which :meth:`NVMeTier.recover`
deletes, and index entries whose file is missing or has the wrong size, which it drops.
With ``fsync=True`` files, folders and the index are also flushed to the device before a
block is visible (power-loss safety), at a large cost in put latency.

Files are recycled (:class:`_SpareFiles`): on this team's ext4 machines creating a file
costs 0.03-0.8 ms and unlinking a 1 MiB one 0.4-3 ms (the mount discards freed extents),
renaming one ~30 us. A freed block's file is renamed into ``spare/`` and a new block's temp file is a spare
renamed into place, overwritten and cut to its new length before the final rename. Spare
files are outside the capacity accounting and bounded (``spare_files``, ``spare_bytes``).

Reads verify the size and the checksum of every block on every read; a missing,
truncated or altered file raises :class:`kvstore.errors.BlockCorrupt`, never wrong bytes.

Disk full (ENOSPC/EDQUOT while writing, e.g. a capacity larger than the free space): the
write raises :class:`DiskFull` (a TierFull and a TierIOError); from then on the tier's
capacity is what the disk can take (its blocks, spare files and free space) until the disk
has room for the configured capacity again, so the manager evicts instead of failing.

GPUDirect Storage (``io = "gds"``, or ``"auto"`` when :func:`tiers.gds.gds_available`):
:meth:`NVMeTier.write_device` and :meth:`NVMeTier.read_into_device` move a block's file
straight to and from device memory (an HBM tier's ``device_array``) through kvikio, by
GDS or kvikio's compatibility mode; host writes and reads keep the POSIX path. Same
files, same index, same temp file + rename protocol. The index's xxh3_64 is computed
on the host, so each device write and read also copies the block device -> host once,
through one reused staging buffer (see :class:`_DeviceChecksum`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time

import lmdb
import xxhash

from .errors import BlockCorrupt, BlockExists, BlockNotStored, DiskFull, InvalidAccess, TierFull, TierIOError

from . import gds
from .base import ByteRanges, Capabilities, NO_CAPABILITIES, Tier, TierKind, check_chunk, check_ranges, output_view
from .gds import gds_available, gds_info
from .gpu import GPUUnavailable, allocate_pinned, cuda_buffer

log = logging.getLogger("kvstore.tiers.nvme")

PAGE = 4096
"""O_DIRECT unit in bytes: offsets, lengths and buffer addresses are multiples of it;
also the unit of the tier's capacity accounting (a file takes whole pages on disk)."""

WRITE_BOUNCE_BYTES = 4 << 20
"""Largest bounce buffer a single O_DIRECT write streams through (bytes)."""

STAGING_BYTES = 8 << 20
"""Size of the one host buffer through which device blocks are checksummed (bytes)."""

IO_CHOICES = ("auto", "posix", "gds")

_KEY_BYTES = 32                      # kvstore.keys.KEY_BYTES (tiers do not import kvstore.keys)
_INDEX_VALUE = struct.Struct("<QQd")
_HEX = frozenset("0123456789abcdef")
_ZEROS = memoryview(bytes(PAGE))
_MIN_BOUNCE = 1 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_bytes(nbytes: int) -> int:
    """Capacity a block of ``nbytes`` payload bytes takes: whole 4096-byte pages, at least one."""
    return (max(nbytes, 1) + PAGE - 1) & ~(PAGE - 1)


def _as_byte_view(data: memoryview | bytes) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


_gds_available = gds_available   # the old private name (tests/tiers/test_nvme.py uses it)


def _probe_direct(folder: str) -> bool:
    """True when ``folder``'s filesystem accepts an O_DIRECT open and page-aligned write."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(folder, ".odirect-probe")
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        buf.close()
        return False
    try:
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)
        buf.close()


class _Bounce:
    """A page-aligned host buffer (anonymous mmap) for O_DIRECT I/O."""

    __slots__ = ("mm", "view", "size")

    def __init__(self, size: int):
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        self.size = size

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        except BufferError:   # a slice is still referenced somewhere; the GC unmaps it later
            pass


class _BouncePool:
    """Reusable bounce buffers in power-of-two size classes (at least 1 MiB).

    A lease takes a free buffer of the right class or maps a new one; a release keeps it
    for reuse while the pool holds at most ``max_retained`` bytes of free buffers.
    """

    def __init__(self, max_retained: int):
        self.max_retained = max_retained
        self._free: dict[int, list[_Bounce]] = {}
        self._retained = 0
        self._lock = threading.Lock()

    def lease(self, nbytes: int) -> _Bounce:
        size = max(_MIN_BOUNCE, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._retained -= size
                return free.pop()
        return _Bounce(size)

    def release(self, bounce: _Bounce) -> None:
        with self._lock:
            if self._retained + bounce.size <= self.max_retained:
                self._free.setdefault(bounce.size, []).append(bounce)
                self._retained += bounce.size
                return
        bounce.close()

    def close(self) -> None:
        with self._lock:
            for free in self._free.values():
                for bounce in free:
                    bounce.close()
            self._free.clear()
            self._retained = 0


class _SpareFiles:
    """Freed blocks' files kept for reuse in ``folder``.

    :meth:`give` renames a freed block's file in; :meth:`take` hands out the most recently
    given one (LIFO: its extents are likely the right size already). At most ``max_files``
    files and ``max_bytes`` bytes (as given to :meth:`give`) are held. Spare files contain no
    block: whatever stale bytes they hold are overwritten, and cut, before they carry a
    block's name again.
    """

    def __init__(self, folder: str, max_files: int, max_bytes: int):
        self.folder = folder
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._files: list[tuple[str, int]] = []         # (path, bytes), most recent last
        self._count = 0                                 # files held or being moved in
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self._adopt()

    def _adopt(self) -> None:
        """Register the files a previous run left, within the limits; delete the others."""
        found, removed = [], 0
        for entry in os.scandir(self.folder):
            if entry.name.isdigit() and entry.is_file(follow_symlinks=False):
                found.append((int(entry.name), entry.path, entry.stat(follow_symlinks=False).st_size))
            elif not entry.is_dir(follow_symlinks=False):
                found.append((-1, entry.path, 0))
        for number, path, size in sorted(found):
            self._next = max(self._next, number + 1)
            if number >= 0 and self._count < self.max_files and self._bytes + size <= self.max_bytes:
                self._files.append((path, size))
                self._count += 1
                self._bytes += size
                continue
            removed += 1
            try:
                os.unlink(path)
            except OSError as e:
                log.warning("cannot remove %s: %s", path, e)
        if removed:
            log.info("removed %d files over the limits or not ours from %s", removed, self.folder)

    @property
    def count(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._bytes

    def take(self) -> tuple[str, int] | None:
        """A spare file as ``(path, bytes)`` (its size on disk at most), or None if none is ready."""
        with self._lock:
            if not self._files:
                return None
            path, size = self._files.pop()
            self._count -= 1
            self._bytes -= size
            return path, size

    def give(self, path: str, size: int) -> bool:
        """Move the file at ``path`` (at most ``size`` bytes) into the pool. False when the pool
        is full or the file cannot be moved (the caller then deletes it)."""
        with self._lock:
            if self._closed or self._count >= self.max_files or self._bytes + size > self.max_bytes:
                return False
            spare = os.path.join(self.folder, str(self._next))
            self._next += 1
            self._count += 1
            self._bytes += size
        try:
            os.rename(path, spare)
        except OSError:
            with self._lock:
                self._count -= 1
                self._bytes -= size
            return False
        with self._lock:
            self._files.append((spare, size))
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True


class _Pending:
    """An open reservation: ``size`` payload bytes, ``disk`` bytes of capacity, ``written``
    bytes received, the temp file ``fd`` (-1 until the first write), the running checksum,
    and for O_DIRECT a bounce buffer holding ``tail`` bytes not yet written at ``file_off``;
    ``reused`` is the size of the spare file taken (-1 for a new file)."""

    __slots__ = ("size", "disk", "written", "fd", "hasher", "bounce", "tail", "file_off", "reused")

    def __init__(self, size: int, disk: int):
        self.size = size
        self.disk = disk
        self.written = 0
        self.fd = -1
        self.hasher = xxhash.xxh3_64()
        self.bounce: _Bounce | None = None
        self.tail = 0
        self.file_off = 0
        self.reused = -1


class _DeviceChecksum:
    """xxh3_64 of bytes in device memory, computed on the host through ONE reused staging
    buffer of :data:`STAGING_BYTES` (pinned when the page-locking succeeds, else pageable).

    GDS moves a block between the file and device memory without the bytes reaching the
    host, but the index keeps the payload's xxh3_64. So the device paths pay, per block,
    one device -> host copy of the payload (in ``STAGING_BYTES`` chunks, cudaMemcpy) and
    xxh3_64 over it on one CPU core. Pinned D2H over PCIe on an H200 runs at tens of GB/s,
    well above one NVMe drive's bandwidth, so the copy costs PCIe and CPU time rather than
    throughput; it is still a host copy that pure GDS would not make. One lock serialises
    the buffer's users (the tier's device writes and reads).
    """

    def __init__(self, nbytes: int = STAGING_BYTES):
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._region = None               # tiers.gpu.PinnedRegion, when pinned
        self._host = None                 # numpy uint8 array of nbytes, allocated on first use

    def _buffer(self):
        if self._host is None:
            import numpy as np
            try:
                self._region, start = allocate_pinned(self._nbytes)
                self._host = np.frombuffer(self._region.mapping, dtype=np.uint8, count=self._nbytes, offset=start)
            except (MemoryError, GPUUnavailable) as e:
                log.warning("checksum staging buffer not pinned (%s); using pageable memory", e)
                self._host = np.empty(self._nbytes, dtype=np.uint8)
        return self._host

    def update(self, hasher, device_buf, nbytes: int) -> None:
        """Feed the first ``nbytes`` bytes of C-contiguous device array ``device_buf`` to ``hasher``."""
        from cupy.cuda import runtime
        ptr, available = cuda_buffer(device_buf)
        if nbytes > available:
            raise ValueError(f"{nbytes} bytes requested but the device buffer has {available}")
        with self._lock:
            host = self._buffer()
            for off in range(0, nbytes, host.size):
                n = min(host.size, nbytes - off)
                runtime.memcpy(host.ctypes.data, ptr + off, n, runtime.memcpyDefault)
                hasher.update(host[:n])

    def digest(self, device_buf, nbytes: int) -> int:
        hasher = xxhash.xxh3_64()
        self.update(hasher, device_buf, nbytes)
        return hasher.intdigest()

    def close(self) -> None:
        with self._lock:
            self._host = None
            if self._region is not None:
                self._region.close()
                self._region = None


class NVMeTier(Tier):
    """Blocks as files under ``path`` with an LMDB index (format in the module docstring).

    Args:
        path: the tier's folder (created if missing). One process at a time may open it.
        capacity_bytes: bytes of disk the tier may use, counted in whole 4096-byte pages
            per block (:func:`disk_bytes`) for committed blocks and open reservations.
        name: tier name in logs and stats.
        io: ``"posix"`` (O_DIRECT or buffered file I/O), ``"gds"`` (also move blocks
            to and from device memory through kvikio, :meth:`write_device` and
            :meth:`read_into_device`; needs a CUDA GPU and kvikio) or ``"auto"`` (gds
            when :func:`tiers.gds.gds_available`, else posix). Host writes and reads
            use the POSIX path in every mode. :attr:`io` is the mode chosen.
        fsync: flush files, folders and the index to the device before a put completes.
        direct: ``None`` probes the filesystem once and uses O_DIRECT when it is accepted;
            ``False`` forces buffered I/O; ``True`` requires O_DIRECT.
        map_size: initial LMDB map size in bytes; doubled whenever the index fills it.
        max_bounce_bytes: bytes of free O_DIRECT bounce buffers kept for reuse.
        spare_files: most files kept for reuse in ``path/spare`` (0: no recycling).
        spare_bytes: most bytes those files may hold (default: capacity / 16, at most 1 GiB);
            they are on disk in addition to :attr:`used_bytes`.

    Blocks found in the index at start count against ``capacity_bytes`` at once (the oldest
    written are deleted if they exceed it); :meth:`recover` then checks them against the
    files. Reads and writes of different blocks may run concurrently from several threads.

    Raises:
        ConfigError (a ValueError): bad ``io``, ``io="gds"`` without a CUDA GPU and kvikio,
            ``direct=True`` on a filesystem that refuses O_DIRECT.
        TierIOError: ``path`` is in use by another process or cannot be created.
    """

    kind = TierKind.NVME
    volatile = False

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, name: str = "nvme",
                 io: str = "auto", fsync: bool = False, direct: bool | None = None,
                 map_size: int = 1 << 30, max_bounce_bytes: int = 64 << 20,
                 spare_files: int = 256, spare_bytes: int | None = None):
        if io not in IO_CHOICES:
            raise ValueError(f"io must be one of {', '.join(IO_CHOICES)}, got {io!r}")
        if io == "gds" and not gds_available():
            raise ValueError(f"io = gds needs a CUDA GPU and kvikio ({gds_info().reason})")
        if capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity_bytes}")
        self.name = name
        self.io = "gds" if io == "gds" or (io == "auto" and gds_available()) else "posix"
        self._checksum = _DeviceChecksum()
        self.path = os.path.abspath(os.fspath(path))
        self._capacity = int(capacity_bytes)
        self._disk_limited = False          # the disk filled up before the capacity: see _disk_room
        self._fsync = bool(fsync)
        self._blocks_dir = os.path.join(self.path, "blocks")
        self._lock = threading.Lock()
        self._closed = False
        try:
            os.makedirs(self._blocks_dir, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TierIOError(f"{name}: cannot create the tier folder {self.path}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise TierIOError(f"{name}: {self.path} is in use by another process") from e

        try:
            self._open(direct, map_size, max_bounce_bytes, spare_files, spare_bytes)
        except BaseException:
            if getattr(self, "_env", None) is not None:
                self._env.close()
            os.close(self._lock_fd)
            raise

    def _open(self, direct: bool | None, map_size: int, max_bounce_bytes: int, spare_files: int,
              spare_bytes: int | None) -> None:
        """The rest of ``__init__``, once the folder is locked."""
        accepted = _probe_direct(self.path) if direct is not False else False
        if direct and not accepted:
            raise ValueError(f"{self.name}: the filesystem of {self.path} refuses O_DIRECT")
        self.direct = accepted
        o_direct = os.O_DIRECT if accepted else 0
        self._reuse_flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | o_direct
        self._write_flags = self._reuse_flags | os.O_CREAT | os.O_TRUNC
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | o_direct
        self._bounces = _BouncePool(max_bounce_bytes)
        self._dirs: set[str] = set()
        self._spares: _SpareFiles | None = None
        if spare_files > 0:
            limit = min(self._capacity // 16, 1 << 30) if spare_bytes is None else spare_bytes
            self._spares = _SpareFiles(os.path.join(self.path, "spare"), spare_files, limit)
        try:
            self._env = lmdb.open(os.path.join(self.path, "index"), map_size=max(map_size, 1 << 16),
                                  subdir=True, sync=self._fsync, metasync=self._fsync,
                                  readahead=False, meminit=False, max_dbs=0)
        except lmdb.Error as e:
            raise TierIOError(f"{self.name}: cannot open the index in {self.path}: {e}") from e
        self._index: dict[bytes, tuple[int, int, float]] = {}     # key -> (size, xxh3_64, time)
        self._pending: dict[bytes, _Pending] = {}
        self._used = 0
        self._load_index()

    # -------------------------------------------------------------- paths and index

    def _file_path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self._blocks_dir, h[:2], h[2:4], h)

    def _index_txn(self, apply) -> None:
        """Run ``apply(txn)`` in one write transaction, growing the map when it is full.

        Called with ``self._lock`` held, so no other transaction of this process is open
        (a condition of ``set_mapsize``)."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    apply(txn)
                return
            except lmdb.MapFullError:
                size = self._env.info()["map_size"] * 2
                log.info("%s: index map full; growing it to %d bytes", self.name, size)
                self._env.set_mapsize(size)

    def _load_index(self) -> None:
        bad = []
        with self._env.begin() as txn:
            for key, value in txn.cursor():
                if len(key) != _KEY_BYTES or len(value) != _INDEX_VALUE.size:
                    bad.append(key)
                    continue
                size, checksum, written_at = _INDEX_VALUE.unpack(value)
                self._index[key] = (size, checksum, written_at)
                self._used += disk_bytes(size)
        if bad:
            log.warning("%s: dropping %d malformed index entries", self.name, len(bad))
            self._index_txn(lambda txn: [txn.delete(k) for k in bad])
        if self._used > self._capacity:
            self._trim_to_capacity()

    def _trim_to_capacity(self) -> None:
        """Delete the oldest written blocks until the index fits the capacity."""
        victims = []
        for key, (size, _, _) in sorted(self._index.items(), key=lambda kv: kv[1][2]):
            if self._used <= self._capacity:
                break
            victims.append(key)
            self._used -= disk_bytes(size)
        log.warning("%s: %d stored blocks exceed the capacity of %d bytes; deleting the %d oldest",
                    self.name, len(self._index), self._capacity, len(victims))
        self._index_txn(lambda txn: [txn.delete(k) for k in victims])
        for key in victims:
            del self._index[key]
            try:
                os.unlink(self._file_path(key))
            except FileNotFoundError:
                pass

    # -------------------------------------------------------------- accounting

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity; after the disk filled up (:class:`DiskFull`), what the
        disk can take, until it has room for the configured capacity again."""
        return self._disk_room() if self._disk_limited else self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def spare_bytes(self) -> int:
        """Bytes (at most) in spare files: on disk, but outside :attr:`used_bytes`."""
        return self._spares.nbytes if self._spares is not None else 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def fits(self, nbytes: int) -> bool:
        return nbytes >= 0 and self._used + disk_bytes(nbytes) <= self.capacity_bytes

    def size_of(self, key: bytes) -> int:
        entry = self._index.get(key)
        if entry is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        return entry[0]

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(device_files=self) if self.device_io else NO_CAPABILITIES

    @property
    def device_io(self) -> bool:
        """True when :meth:`write_device` and :meth:`read_into_device` can be used
        (``io`` is ``"gds"``): the manager moves HBM <-> NVMe through them."""
        return self.io == "gds"

    # -------------------------------------------------------------- two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise ValueError(f"{self.name}: block keys are {_KEY_BYTES} bytes")
        if nbytes < 0:
            raise ValueError(f"block size must be >= 0 bytes, got {nbytes}")
        disk = disk_bytes(nbytes)
        with self._lock:
            if key in self._index or key in self._pending:
                raise BlockExists(f"block {key.hex()[:16]} already present in {self.name}")
            capacity = self.capacity_bytes
            if self._used + disk > capacity:
                raise TierFull(f"{self.name}: {nbytes} bytes do not fit "
                               f"({self._used}/{capacity} bytes used)")
            self._used += disk
            self._pending[key] = _Pending(nbytes, disk)

    def _open_temp(self, key: bytes, p: _Pending) -> int:
        """Open the block's temp file: a spare file renamed into place, or a new file."""
        path = self._file_path(key)
        folder = os.path.dirname(path)
        if folder not in self._dirs:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._dirs.add(folder)
        temp = path + ".tmp"
        spare = self._spares.take() if self._spares is not None else None
        if spare is not None:
            try:
                os.rename(spare[0], temp)
                fd = os.open(temp, self._reuse_flags)
                p.reused = spare[1]
                return fd
            except OSError as e:               # not a usable file: make a new one
                log.debug("%s: spare file %s not reused: %s", self.name, spare[0], e)
                for stale in (spare[0], temp):
                    try:
                        os.unlink(stale)
                    except OSError:
                        pass
        return os.open(temp, self._write_flags, 0o600)

    def write(self, key: bytes, offset: int, data: memoryview | bytes) -> None:
        src = _as_byte_view(data)
        n = src.nbytes
        with self._lock:
            p = self._pending.get(key)
            if p is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            check_chunk(offset, n, p.written, p.size)
            p.written = offset + n
        try:
            if p.fd < 0:
                p.fd = self._open_temp(key, p)
            p.hasher.update(src)
            if self.direct:
                self._stage(p, src)
            else:
                _pwrite_all(p.fd, src, offset)
        except OSError as e:
            self._discard(key, p)
            if e.errno in _DISK_FULL:
                raise self._disk_full(f"writing block {key.hex()[:16]} failed: disk full") from e
            raise TierIOError(f"{self.name}: writing block {key.hex()[:16]} failed: {e}") from e

    def write_from_device(self, key: bytes, device_buf) -> None:
        """Fill a reserved block from device memory: the block's whole payload (its reserved
        size, from the start of ``device_buf``) in one kvikio write (GDS, or kvikio's
        compatibility mode) to the block's temp file, padded to whole pages as with
        O_DIRECT. :meth:`commit` then publishes it as after :meth:`write` (rename, index
        with the payload's xxh3_64, fsync when configured); :meth:`abort` drops it.

        The checksum costs one device -> host copy of the payload (see :class:`_DeviceChecksum`).

        Args:
            device_buf: C-contiguous CUDA array (``__cuda_array_interface__``: an HBM tier's
                ``device_array(key)``, a CuPy array, a torch CUDA tensor) of at least the
                block's reserved size in bytes.
        Raises:
            ValueError: not reserved, already partly written, or ``device_buf`` too small.
            TypeError: ``device_buf`` is not a CUDA array.
            DiskFull / TierIOError: the write failed (the reservation is dropped).
            GPUUnavailable: no GPU or no kvikio (``io`` is not ``"gds"``).
        """
        if not self.device_io:
            raise GPUUnavailable(f"{self.name}: device writes need io = gds (this tier uses {self.io})")
        available = cuda_buffer(device_buf)[1]
        with self._lock:
            p = self._pending.get(key)
            if p is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            if p.written:
                raise ValueError(f"block {key.hex()[:16]} already has {p.written} bytes written")
            if available < p.size:
                raise ValueError(f"the device buffer has {available} bytes, the block {p.size}")
            p.written = p.size
        temp = self._file_path(key) + ".tmp"
        try:
            folder = os.path.dirname(temp)
            if folder not in self._dirs:
                os.makedirs(folder, mode=0o700, exist_ok=True)
                self._dirs.add(folder)
            self._checksum.update(p.hasher, device_buf, p.size)
            p.file_off = gds.write_block_file(temp, device_buf, p.size, pad=True)
            # commit() fsyncs (when configured) and closes this fd, then renames as after write()
            p.fd = os.open(temp, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except BaseException as e:
            self._discard(key, p)
            cause = e.__cause__ if isinstance(e, TierIOError) else e
            if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
                raise self._disk_full(f"writing block {key.hex()[:16]} failed: disk full") from e
            if isinstance(e, OSError) and not isinstance(e, TierIOError):
                raise TierIOError(f"{self.name}: writing block {key.hex()[:16]} failed: {e}") from e
            raise

    def _disk_full(self, what: str) -> DiskFull:
        """The filesystem is full: from now on the capacity follows the room on the disk
        (:meth:`_disk_room`), so the manager evicts from this tier to make room instead of
        failing every later write. Returns the error to raise."""
        self._disk_limited = True
        room = self._disk_room()
        log.warning("%s: %s; capacity held to the %d bytes the disk can take (configured %d) "
                    "until it has room again", self.name, what, room, self._capacity)
        return DiskFull(f"{self.name}: {what} (capacity now {room} bytes)")

    def _disk_room(self) -> int:
        """Bytes this tier can hold on its disk: its blocks, its spare files (reused for new
        blocks) and the free space; the configured capacity again once that is reached."""
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        room = self._used + self.spare_bytes + free
        if room >= self._capacity:
            if self._disk_limited:
                log.info("%s: the disk has room again; capacity back to %d bytes", self.name, self._capacity)
            self._disk_limited = False
            return self._capacity
        return room

    def _stage(self, p: _Pending, src: memoryview) -> None:
        """O_DIRECT: copy ``src`` into the bounce buffer, writing it out whenever it is
        full and, once the block is complete, the zero-padded last pages."""
        if p.bounce is None:
            p.bounce = self._bounces.lease(min(disk_bytes(p.size), WRITE_BOUNCE_BYTES))
        buf, cap = p.bounce.view, p.bounce.size
        pos, n = 0, src.nbytes
        while pos < n:
            take = min(n - pos, cap - p.tail)
            buf[p.tail:p.tail + take] = src[pos:pos + take]
            p.tail += take
            pos += take
            if p.tail == cap:
                _pwrite_all(p.fd, buf[:cap], p.file_off)
                p.file_off += cap
                p.tail = 0
        if p.written == p.size and p.tail:
            end = disk_bytes(p.tail)
            buf[p.tail:end] = _ZEROS[:end - p.tail]
            _pwrite_all(p.fd, buf[:end], p.file_off)
            p.file_off += end
            p.tail = 0

    def commit(self, key: bytes) -> None:
        with self._lock:
            p = self._pending.get(key)
            if p is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            if p.written != p.size:
                raise InvalidAccess(f"block {key.hex()[:16]}: {p.written} of {p.size} bytes written")
        final = self._file_path(key)
        renamed = False
        try:
            if p.fd < 0:                       # a zero-byte block: no write call came
                p.fd = self._open_temp(key, p)
            if p.reused > 0:                   # a spare file: cut stale bytes past the payload
                os.ftruncate(p.fd, p.file_off if self.direct else p.size)
            if self._fsync:
                os.fsync(p.fd)
            fd, p.fd = p.fd, -1
            os.close(fd)
            os.rename(final + ".tmp", final)
            renamed = True
            if self._fsync:
                dir_fd = os.open(os.path.dirname(final), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            entry = (p.size, p.hasher.intdigest(), time.time())
            value = _INDEX_VALUE.pack(*entry)
            with self._lock:
                self._index_txn(lambda txn: txn.put(key, value))
                del self._pending[key]
                self._index[key] = entry
        except (OSError, lmdb.Error) as e:
            self._discard(key, p, final if renamed else None)
            if isinstance(e, OSError) and e.errno in _DISK_FULL:
                raise self._disk_full(f"committing block {key.hex()[:16]} failed: disk full") from e
            raise TierIOError(f"{self.name}: committing block {key.hex()[:16]} failed: {e}") from e
        finally:
            if p.bounce is not None:
                self._bounces.release(p.bounce)
                p.bounce = None

    def _discard(self, key: bytes, p: _Pending, final: str | None = None) -> None:
        """Drop a reservation: its capacity, its temp file (and ``final`` if given)."""
        with self._lock:
            if self._pending.get(key) is p:
                del self._pending[key]
                self._used -= p.disk
        if p.fd >= 0:
            fd, p.fd = p.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        for path in (self._file_path(key) + ".tmp", final):
            if path is None:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("%s: cannot remove %s: %s (recovery will)", self.name, path, e)
        if p.bounce is not None:
            self._bounces.release(p.bounce)
            p.bounce = None

    def abort(self, key: bytes) -> None:
        p = self._pending.get(key)
        if p is not None:
            self._discard(key, p)

    # -------------------------------------------------------------- read / free

    def read_into(self, key: bytes, out, ranges: ByteRanges | None = None) -> int:
        """Read a block (or ``ranges`` of it) into ``out``, verifying its size and xxh3_64
        checksum (see :meth:`Tier.read_into`). This port reads the whole file to verify it."""
        total = check_ranges(ranges, self.size_of(key))
        dst = output_view(out, total)
        data = memoryview(self._read(key, ranges))
        dst[:total] = data
        return total

    def _read(self, key: bytes, ranges: ByteRanges | None = None) -> bytes:
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        size, checksum = entry[0], entry[1]
        if ranges:
            check_ranges(ranges, size)
        path = self._file_path(key)
        try:
            fd = os.open(path, self._read_flags)
        except FileNotFoundError:
            raise BlockCorrupt(f"{self.name}: block {key.hex()[:16]}: file {path} is missing") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BlockCorrupt(f"{self.name}: block {key.hex()[:16]}: {path} is a symbolic link") from None
            raise TierIOError(f"{self.name}: cannot open {path}: {e}") from e
        try:
            if self.direct:
                return self._read_direct(fd, key, size, checksum, ranges)
            return self._read_buffered(fd, key, size, checksum, ranges)
        except OSError as e:
            raise TierIOError(f"{self.name}: reading block {key.hex()[:16]} failed: {e}") from e
        finally:
            os.close(fd)

    def _verify(self, key: bytes, payload, size: int, got: int, checksum: int) -> None:
        if got < size:
            raise BlockCorrupt(f"{self.name}: block {key.hex()[:16]} is truncated: "
                               f"{got} of {size} bytes on disk")
        self._check_sum(key, xxhash.xxh3_64_intdigest(payload), checksum)

    def _check_sum(self, key: bytes, actual: int, checksum: int) -> None:
        if actual != checksum:
            raise BlockCorrupt(f"{self.name}: block {key.hex()[:16]} fails its checksum "
                               f"(xxh3_64 {actual:016x}, indexed {checksum:016x})")

    def _read_direct(self, fd: int, key: bytes, size: int, checksum: int, ranges) -> bytes:
        padded = disk_bytes(size)
        bounce = self._bounces.lease(padded)
        try:
            buf, got = bounce.view, 0
            while got < padded:
                n = os.preadv(fd, [buf[got:padded]], got)
                got += n
                if n <= 0 or got % PAGE:           # end of file
                    break
            payload = buf[:min(got, size)]
            self._verify(key, payload, size, got, checksum)
            if not ranges:
                return bytes(payload)
            return b"".join(payload[off:off + n] for off, n in ranges)
        finally:
            payload = buf = None
            self._bounces.release(bounce)

    def _read_buffered(self, fd: int, key: bytes, size: int, checksum: int, ranges) -> bytes:
        data = os.pread(fd, size, 0)
        if len(data) < size:                        # short read: large block or truncated file
            parts, got = [data], len(data)
            while got < size:
                more = os.pread(fd, size - got, got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self._verify(key, data, size, len(data), checksum)
        if not ranges:
            return data
        view = memoryview(data)
        return b"".join(view[off:off + n] for off, n in ranges)

    def read_into_device(self, key: bytes, device_buf) -> int:
        """Read a committed block into the start of device buffer ``device_buf`` by kvikio
        (GDS, or its compatibility mode), then verify its size and xxh3_64 checksum like
        :meth:`read`. Returns the payload bytes read.

        The checksum costs one device -> host copy of the payload (see :class:`_DeviceChecksum`).
        On BlockCorrupt the buffer holds the bad bytes: the caller drops them (the manager
        aborts the reservation they were read into).

        Raises:
            KeyError: not stored here.
            BlockCorrupt: file missing, a symbolic link, truncated, or failing its checksum.
            TierIOError: the read failed.
            ValueError: ``device_buf`` is smaller than the block; TypeError: not a CUDA array.
            GPUUnavailable: no GPU or no kvikio (``io`` is not ``"gds"``).
        """
        if not self.device_io:
            raise GPUUnavailable(f"{self.name}: device reads need io = gds (this tier uses {self.io})")
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        size, checksum = entry[0], entry[1]
        path = self._file_path(key)
        what = f"{self.name}: block {key.hex()[:16]}"
        if os.path.islink(path):                   # the POSIX path opens with O_NOFOLLOW
            raise BlockCorrupt(f"{what}: {path} is a symbolic link")
        try:
            gds.read_block_file(path, device_buf, size)
        except FileNotFoundError:
            raise BlockCorrupt(f"{what}: file {path} is missing") from None
        except BlockCorrupt as e:                  # truncated file or short read
            raise BlockCorrupt(f"{what}: {e}") from None
        except TierIOError as e:
            raise TierIOError(f"{self.name}: reading block {key.hex()[:16]} failed: {e}") from e
        self._check_sum(key, self._checksum.digest(device_buf, size), checksum)
        return size

    def free(self, key: bytes) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
            try:
                self._index_txn(lambda txn: txn.delete(key))
            except lmdb.Error as e:
                self._index[key] = entry
                raise TierIOError(f"{self.name}: cannot delete block {key.hex()[:16]} from the index: {e}") from e
            self._used -= disk_bytes(entry[0])
        path = self._file_path(key)
        if self._spares is not None and self._spares.give(path, disk_bytes(entry[0])):
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("%s: cannot remove %s: %s (recovery will)", self.name, path, e)

    # -------------------------------------------------------------- restart

    def recover(self) -> list[tuple[bytes, int]]:
        """Reconcile the index with the files; return the surviving blocks as ``(key, nbytes)``,
        oldest written first.

        Keeps an index entry only when its file exists with the payload size or the padded
        size; drops the other entries, and deletes temp files and block files that have no
        index entry. Checksums are not read here (every read verifies them). Call it once at
        start, before any write.
        """
        ok: set[bytes] = set()
        orphans = temps = bad_files = 0
        with self._lock:
            for top in os.scandir(self._blocks_dir):
                if not top.is_dir(follow_symlinks=False):
                    continue
                for sub in os.scandir(top.path):
                    if not sub.is_dir(follow_symlinks=False):
                        continue
                    prefix = top.name + sub.name
                    for f in os.scandir(sub.path):
                        name = f.name
                        if name.endswith(".tmp"):
                            hex_name = name[:-4]
                            if len(hex_name) == 2 * _KEY_BYTES and set(hex_name) <= _HEX \
                                    and bytes.fromhex(hex_name) in self._pending:
                                continue                    # a write in flight
                            temps += 1
                        elif len(name) == 2 * _KEY_BYTES and set(name) <= _HEX:
                            key = bytes.fromhex(name)
                            entry = self._index.get(key) if name.startswith(prefix) else None
                            if entry is None:           # not indexed, or in the wrong folder
                                orphans += 1
                            else:
                                st = f.stat(follow_symlinks=False)
                                if f.is_file(follow_symlinks=False) and st.st_size in (entry[0], disk_bytes(entry[0])):
                                    ok.add(key)
                                    continue
                                bad_files += 1
                        else:
                            log.warning("%s: leaving alone an unknown file %s", self.name, f.path)
                            continue
                        try:
                            os.unlink(f.path)
                        except OSError as e:
                            log.warning("%s: cannot remove %s: %s", self.name, f.path, e)
            dropped = [k for k in self._index if k not in ok]
            if dropped:
                self._index_txn(lambda txn: [txn.delete(k) for k in dropped])
                for key in dropped:
                    self._used -= disk_bytes(self._index.pop(key)[0])
            blocks = sorted(self._index.items(), key=lambda kv: kv[1][2])
        log.info("%s: recovered %d blocks (%d bytes on disk); dropped %d index entries without a "
                 "valid file (%d files of the wrong size), removed %d orphan files and %d temp files",
                 self.name, len(blocks), self._used, len(dropped), bad_files, orphans, temps)
        return [(key, entry[0]) for key, entry in blocks]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.items())
        for key, p in pending:
            self._discard(key, p)
        if self._spares is not None:
            self._spares.close()
        self._env.close()
        self._bounces.close()
        self._checksum.close()
        os.close(self._lock_fd)           # releases the flock

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        if self.device_io:
            mode += f", kvikio {gds_info().mode} for device buffers"
        return f"{self.name}(nvme, {self.capacity_bytes} bytes, {self.path}, {mode})"
