"""The NVMe tier's two-phase write protocol: reservations, temp files, commit.

::

    reserve(key, n)      capacity counted (Space.take); an evicted block's parked file
                         (tiers.nvme.parked) or a spare file set aside; nothing written
    write(key, off, b)   first call opens the temp file: the parked file renamed to
                         blocks/abc/<hex>.tmp, the spare file where it lies (spare/<n>),
                         or a new <hex>.tmp; bytes go through BlockWriter
    commit(key)          header written; leftovers cut; close; rename temp -> <hex>;
                         index put (and the parked file's old entry dropped) (with
                         fsync: fdatasync; close; rename; fsync folder; one synchronous
                         index transaction for the commits in flight: tiers.nvme.group)
    abort(key)           temp file removed, capacity returned (while another thread writes
                         or commits it: capacity now, the file when that I/O ends, the key
                         busy until then; once a commit has decided to publish the block,
                         just before its rename, too late: the block stays)

A failure anywhere drops the reservation and its files (a renamed file too, when the
index update failed), so a failed commit leaves nothing. A crash leaves a temp file
(removed at the next start, or kept as a spare file) or a complete, renamed file
(indexed from its header at the next start if the index update was lost). With fsync a
block is indexed only once its bytes and its name are on the device, and a commit returns
only once its index entry is.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import lmdb

from tiers.buffers import check_chunk
from tiers.errors import BlockExists, BlockNotStored, InvalidAccess, MediaIOError
from tiers.nvme.format import KEY_BYTES, IndexEntry, block_path
from tiers.nvme.group import GroupCommit, fdatasync, fsync_folder
from tiers.nvme.spare import SpareFiles, remove_files
from tiers.nvme.index import BlockIndex
from tiers.nvme.parked import Frees, ParkedFiles
from tiers.nvme.read import HeaderCache
from tiers.nvme.space import DISK_FULL_ERRNOS, Space
from tiers.nvme.write import BlockWriter, PendingBlock

log = logging.getLogger("kvstore.tiers.nvme")

REPAIR_HINT = "stop the daemon and run `kvstore repair-index {path}`"


class Reservations:
    """Open reservations of one NVMe tier folder and the steps that publish them.

    ``lock`` is the tier's lock (it guards ``pending``, the frees in flight, the index's
    in-memory entries and ``space``); file I/O and index transactions run outside it.
    """

    def __init__(self, *, folder: str, name: str, lock: threading.Lock, index: BlockIndex, space: Space,
                 writer: BlockWriter, spares: SpareFiles | None, parked: ParkedFiles,
                 remove_file: Callable[[bytes, int], None], direct: bool, fsync: bool, headers: HeaderCache):
        self.folder = folder
        self.blocks_dir = os.path.join(folder, "blocks")
        self.name = name
        self.pending: dict[bytes, PendingBlock] = {}
        self.closed = False                    # set by close(): reservations refused
        self._lock = lock
        self._index = index
        self._space = space
        self._writer = writer
        self._spares = spares
        self.parked = parked
        self.frees = Frees(lock, parked, index, remove_file)
        """Frees and parked files moving without the lock (:class:`tiers.nvme.parked.Frees`)."""
        self._fsync = fsync
        self._headers = headers
        self._dirs: set[str] = set()
        self.group = GroupCommit(self._index_batch) if fsync else None
        """The shared index transactions of fsync'ed commits (None without fsync)."""
        o_direct = os.O_DIRECT if direct else 0
        self._reuse_flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | o_direct
        self._new_flags = self._reuse_flags | os.O_CREAT | os.O_TRUNC

    def reserve(self, key: bytes, nbytes: int, chunk: int) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidAccess(f"{self.name}: block keys are {KEY_BYTES} bytes")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidAccess(f"block size must be an integer >= 0 bytes, got {nbytes!r}")
        p = PendingBlock(key, nbytes, chunk, block_path(self.blocks_dir, key))
        with self._lock:
            self.frees.wait_locked()
            if self.closed:
                raise MediaIOError(f"{self.name} is closed")
            if key in self._index.entries or key in self.pending:
                raise BlockExists(f"block {key.hex()[:16]} is already in {self.name}")
            self._space.take(p.disk, f"a block of {nbytes} bytes")
            self.pending[key] = p
            own, robbed = self.parked.claim(p) if self.parked.files else (None, None)
            growth = 0                          # bytes of new files to make (the disk may be full)
            for r in (p, robbed):               # robbed: a reservation whose file was this key's
                if r is not None and r.spare is None and not self.parked.claim_other(r):
                    r.spare = self._spares.take(r.disk) if self._spares is not None else None
                if r is not None:
                    growth += r.disk - (r.spare[1] if r.spare else 0)
            shed = self._shed_locked(growth - (own.nbytes if own is not None else 0))
            if own is not None:                 # too large to reuse, and its name is this block's
                shed[1].append(own)
                self.frees.begin_locked()
        self._drop(shed)

    def _shed_locked(self, growth: int) -> tuple[list[str], list]:
        """Spare files, then unclaimed parked files, to delete (under the lock; the parked ones
        count as frees in flight) so that blocks, spare and parked files stay within the
        configured capacity, and, after the disk filled up, the filesystem has the ``growth``
        bytes a new reservation's file still needs. :meth:`_drop` deletes them."""
        spares = self._spares
        held = spares.nbytes if spares is not None else 0
        over = self._space.used + held + self.parked.nbytes - self._space.configured
        over = max(over, self._space.disk_short(growth))
        if over <= 0:
            return [], []
        paths = spares.shed(over) if spares is not None else []
        parked = self.parked.shed(over - (held - spares.nbytes if spares is not None else 0))
        self.frees.begin_locked(len(parked))
        return paths, parked

    def _drop(self, shed: tuple[list[str], list]) -> None:
        """Delete what :meth:`_shed_locked` chose (without the lock)."""
        remove_files(shed[0])
        if shed[1]:
            self.frees.move(None, "", shed[1], delete=True)

    def get(self, key: bytes) -> PendingBlock:
        """The reservation of ``key`` (call under the lock). Raises BlockNotStored."""
        p = self.pending.get(key)
        if p is None or p.dropped:
            raise BlockNotStored(f"block {bytes(key).hex()[:16]} is not reserved in {self.name}")
        return p

    def open_temp(self, p: PendingBlock) -> int:
        """Open the block's temp file (:attr:`PendingBlock.temp`): the spare file set aside
        for it, where it lies (one rename, at commit), or a new ``<path>.tmp``."""
        folder = os.path.dirname(p.path)
        if folder not in self._dirs:
            self._make_folder(folder)
            self._dirs.add(folder)
        with self._lock:
            self.frees.wait_taken_locked(p)    # a file it had claimed, taken from it, goes first
            parked = self.parked.begin_move(p)
            spare, p.spare = p.spare, None
        if parked is not None:                 # its index entry goes with this block's commit (p.stale)
            if self.frees.move(parked, p.path + ".tmp", [], p):
                spare = (p.path + ".tmp", parked.nbytes)
        if spare is not None:
            try:
                fd = os.open(spare[0], self._reuse_flags)
                p.temp, p.reused = spare
                return fd
            except OSError as e:               # not a usable file: make a new one
                log.debug("%s: spare file %s not reused: %s", self.name, spare[0], e)
                remove_files([spare[0]])
        p.temp = p.path + ".tmp"
        return os.open(p.temp, self._new_flags, 0o600)

    def _open(self, p: PendingBlock) -> None:
        """Open the reservation's temp file (:meth:`open_temp`) as ``p.fd``, unless the
        reservation was dropped meanwhile (an abort or the tier's close on another thread):
        then BlockNotStored is raised and the file removed when the I/O ends."""
        fd = self.open_temp(p)
        with self._lock:
            p.fd = fd                          # a dropped one's: closed when its I/O ends (_end_io)
            if not p.dropped:
                return
        raise BlockNotStored(f"block {p.key.hex()[:16]}: its reservation in {self.name} was dropped "
                             f"while its file was opened")

    def _make_folder(self, folder: str) -> None:
        """Create a block's folder ``blocks/abc`` unless it exists: one ``mkdir`` when it does
        not, none of ``os.makedirs``' checks. With fsync the new folder's name is flushed."""
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            return
        except FileNotFoundError:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        if self._fsync:
            fsync_folder(os.path.dirname(folder))

    def write(self, key: bytes, offset: int, src: memoryview) -> None:
        with self._lock:
            p = self.get(key)
            check_chunk(offset, src.nbytes, p.written, p.size)
            p.written = offset + src.nbytes
            p.io += 1
        self._fill(p, lambda: self._writer.write(p, offset, src), (OSError,))

    def write_from_device(self, key: bytes, device: Any, device_buf: Any, available: int) -> None:
        """Fill a whole reservation from device memory through ``device``
        (:class:`tiers.nvme.device.DeviceFiles`); ``available`` is the buffer's size."""
        with self._lock:
            p = self.get(key)
            if p.written:
                raise InvalidAccess(f"block {key.hex()[:16]} already has {p.written} bytes written")
            if available < p.size:
                raise InvalidAccess(f"the device buffer has {available} bytes, the block {p.size}")
            p.written = p.size
            p.io += 1

        def from_device() -> None:
            p.sums = device.write(p.temp, p.fd, device_buf, p.size, p.chunk, p.header_len)
            p.file_off = p.disk
        self._fill(p, from_device, (OSError, RuntimeError))

    def _fill(self, p: PendingBlock, step, errors: tuple) -> None:
        """Run ``step`` (bytes into ``p``'s file, opened first if need be) as one I/O of
        ``p`` (``p.io`` counted by the caller under the lock); ``errors`` drop the reservation
        and are raised as MediaIOError (DiskFull for ENOSPC)."""
        failed = None
        try:
            if p.fd < 0:
                self._open(p)
            step()
        except errors as e:
            failed = e
        finally:
            self._end_io(p)
        if failed is not None:
            self.discard(p)
            raise self.io_error("writing", p.key, failed) from failed

    def commit(self, key: bytes) -> None:
        with self._lock:
            p = self.get(key)
            if p.written != p.size:
                raise InvalidAccess(f"block {key.hex()[:16]}: {p.written} of {p.size} bytes written")
            self.frees.wait_key_locked(key)    # the old file of its name moving away goes first
            p.io += 1
        final = p.path
        renamed = False
        err: BaseException | None = None
        try:
            if p.fd < 0:                       # a zero-byte block: no write call came
                self._open(p)
            self._writer.finish(p)
            if p.reused > p.disk:              # a spare file: cut stale bytes past the block
                os.ftruncate(p.fd, p.disk)
            if self._fsync:
                fdatasync(p.fd)                # the bytes, then the name, then the index entry
            fd, p.fd = p.fd, -1
            os.close(fd)
            with self._lock:                   # the commit or an abort, once: a later abort is too late
                if p.dropped:
                    raise BlockNotStored(f"block {key.hex()[:16]}: its reservation in {self.name} "
                                         f"was dropped while it was committed")
                p.sealed = True
            # its checksums cached before it can be read (or freed): a free after that drops them
            self._headers.put(key, p.size, p.chunk, tuple(p.sums))
            os.rename(p.temp, final)
            p.temp, renamed = "", True
            if self.group is not None:
                fsync_folder(os.path.dirname(final))
                err = self.group.commit(p)     # one index transaction for the commits in flight
            else:
                # the index transaction without the tier's lock (sealed: no abort drops it)
                self._index.put(key, IndexEntry(p.size, p.chunk, p.written_at, p.header_len), p.stale)
                with self._lock:
                    del self.pending[key]
        except BaseException as e:  # noqa: BLE001 - any failure (the tier closed under it too) cleans up
            err = e
        finally:
            self._writer.release(p)
        if err is not None:
            self._headers.drop(key)
            if renamed:                        # while it is pending, the name is no one else's
                remove_files([final])
            with self._lock:
                p.sealed = False
        self._end_io(p)
        if err is not None:
            self.discard(p)
            if isinstance(err, (BlockNotStored, MediaIOError)) or not isinstance(err, Exception):
                raise err
            raise self.io_error("committing", key, err) from err

    def _index_batch(self, batch: list[PendingBlock]) -> list[BaseException | None]:
        """Index ``batch`` (durable, named blocks) in one synchronous LMDB transaction;
        the same error (or None) for each block."""
        try:                                   # outside the tier's lock: it may take a few ms
            self._index.put_many([(p.key, IndexEntry(p.size, p.chunk, p.written_at, p.header_len)) for p in batch],
                                 [k for p in batch for k in p.stale])
        except lmdb.Error as e:
            return [e] * len(batch)
        with self._lock:
            for p in batch:                    # sealed: no abort dropped them
                del self.pending[p.key]
        return [None] * len(batch)

    def abort(self, key: bytes) -> None:
        p = self.pending.get(key)
        if p is not None:
            self.discard(p)

    def discard(self, p: PendingBlock) -> None:
        """Drop a reservation: its capacity and the spare file set aside for it (back to the
        spare files, or deleted) now; its temp file now, or, while a thread writes or commits
        it, when that thread's I/O ends (:meth:`_end_io`): the reservation stays pending
        until then, so its file descriptor and its temp file's name are never reused under it."""
        shed: tuple[list[str], list] = ([], [])
        with self._lock:
            if p.sealed:                        # its commit is publishing it: the abort is too late
                return
            if self.pending.get(p.key) is p and not p.dropped:
                self._space.give(p.disk)
            p.dropped = True
            if p.parked is not None:            # never moved: it stays parked
                self.parked.release(p)
            spare, p.spare = p.spare, None
            if spare is not None:               # never moved: back among the spare files
                self._spares.put_back(*spare)
                shed = self._shed_locked(0)
            stale, p.stale = p.stale, []
            files = self._claim_locked(p)
        self._drop(shed)
        self.frees.drop_stale(stale)
        if files is not None:
            self._remove(p, *files)

    def _end_io(self, p: PendingBlock) -> None:
        """A write or commit of ``p`` ended: the last one of a dropped reservation removes
        its files."""
        with self._lock:
            p.io -= 1
            files = self._claim_locked(p)
        if files is not None:
            self._remove(p, *files)

    def _claim_locked(self, p: PendingBlock) -> tuple[int, str] | None:
        """A dropped reservation's file descriptor and temp file name, once, for the thread
        that removes them, when no other thread writes or commits it (None otherwise). The
        removal counts as I/O: the reservation stays pending, its key busy, until it ends."""
        if not p.dropped or p.io:
            return None
        p.io += 1
        taken = (p.fd, p.temp)
        p.fd, p.temp = -1, ""
        return taken

    def _remove(self, p: PendingBlock, fd: int, temp: str) -> None:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        if temp:
            remove_files([temp])
        with self._lock:
            stale, p.stale = p.stale, []
        self.frees.drop_stale(stale)
        self._writer.release(p)
        with self._lock:
            p.io -= 1
            if p.io == 0 and self.pending.get(p.key) is p:
                del self.pending[p.key]

    def close(self) -> None:
        """Before the index closes: reservations dropped, parked files moved (evicted blocks do
        not come back), frees and moves in flight ended, their reservations' stale entries dropped."""
        with self._lock:
            self.closed = True
            pending = list(self.pending.values())
        for p in pending:
            self.discard(p)
        self.frees.drop_parked()
        with self._lock:
            self.frees.wait_all_locked()
            stale = [k for p in self.pending.values() for k in p.stale]    # sealed ones' too
        self.frees.drop_stale(stale)

    def io_error(self, doing: str, key: bytes, e: BaseException) -> MediaIOError:
        """The error to raise for a failed write step: DiskFull for ENOSPC/EDQUOT."""
        cause = e.__cause__ if isinstance(e, MediaIOError) and e.__cause__ is not None else e
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            with self._lock:
                return self._space.disk_full(f"{doing} block {key.hex()[:16]} failed: disk full")
        if isinstance(e, lmdb.Error):
            return MediaIOError(f"{self.name}: block {key.hex()[:16]}: the index update failed ({e}); "
                               f"if it persists, {REPAIR_HINT.format(path=self.folder)}")
        return MediaIOError(f"{self.name}: {doing} block {key.hex()[:16]} failed: {e}")


__all__ = ["REPAIR_HINT", "Reservations", "fsync_folder"]
