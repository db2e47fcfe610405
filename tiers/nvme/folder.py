"""An NVMe tier's folder, opened for use: locked against a second process, its filesystem
probed for O_DIRECT, its index reconciled with its block files (:mod:`tiers.nvme.recover`),
its capacity accounted (the oldest blocks deleted beyond it), and the removal of a freed
block's file (into the spare files, or unlinked).

Layout of the folder: :mod:`tiers.nvme.format`.
"""

from __future__ import annotations

import logging
import os

import lmdb

from tiers.errors import MediaUnavailable
from tiers.nvme.commit import REPAIR_HINT
from tiers.nvme.files import lock_folder, probe_direct
from tiers.nvme.format import IndexEntry, block_path
from tiers.nvme.index import BlockIndex
from tiers.nvme.parked import ParkedFiles
from tiers.nvme.recover import RecoveryReport, reconcile, trim_to_capacity
from tiers.nvme.space import Space
from tiers.nvme.spare import SpareFiles, remove_files

log = logging.getLogger("kvstore.tiers.nvme")


class BlockFolder:
    """The on-disk state of one NVMe tier: the folder lock, the index, the capacity
    accounting and the spare files.

    Args:
        path: the tier's folder (absolute; created if missing).
        capacity_bytes: bytes of disk the blocks' files may take.
        name: tier name in logs and errors.
        direct: None uses O_DIRECT when the filesystem accepts it; False never; True
            requires it.
        fsync: flush the index to the device with every update.
        map_size: initial LMDB map size in bytes.
        spare_files: most freed files kept for reuse in ``path/spare`` (0: none).
        spare_bytes: most bytes those files may hold (None: what the capacity leaves beside
            the blocks; blocks and spare files together never exceed it, :mod:`tiers.nvme.spare`).
        rebuild_index: move the index aside and rebuild it from the block files' headers.

    Attributes:
        direct: the folder's files are read and written with O_DIRECT.
        index: the :class:`~tiers.nvme.index.BlockIndex`, agreeing with the files.
        space: the :class:`~tiers.nvme.space.Space` the blocks' files take.
        spares: the :class:`~tiers.nvme.spare.SpareFiles`, or None.
        parked: evicted blocks' files kept for the next reservation
            (:class:`~tiers.nvme.parked.ParkedFiles`, under the tier's lock).
        recovery: what opening found and did (:class:`~tiers.nvme.recover.RecoveryReport`).

    Raises:
        MediaUnavailable: the folder cannot be used, is held by another process, refuses
            O_DIRECT with ``direct=True``, or has an index that cannot be rebuilt.

    Not thread-safe: the tier calls :meth:`forget` under its lock and :meth:`drop` right
    after it, without the lock, while no reservation runs (they wait for it).
    """

    def __init__(self, path: str, capacity_bytes: int, *, name: str, direct: bool | None, fsync: bool,
                 map_size: int, spare_files: int, spare_bytes: int | None, rebuild_index: bool):
        self.path = path
        self.name = name
        self.blocks_dir = os.path.join(path, "blocks")
        self.index: BlockIndex | None = None
        self._lock_fd = lock_folder(path, name)
        try:
            self._open(capacity_bytes, direct, fsync, map_size, spare_files, spare_bytes, rebuild_index)
        except BaseException:
            if self.index is not None:
                self.index.close()
            os.close(self._lock_fd)
            raise

    def _open(self, capacity, direct, fsync, map_size, spare_files, spare_bytes, rebuild_index) -> None:
        """The rest of ``__init__``, once the folder is locked."""
        accepted = probe_direct(self.path) if direct is not False else False
        if direct and not accepted:
            raise MediaUnavailable(f"{self.name}: the filesystem of {self.path} refuses O_DIRECT (direct=True)")
        self.direct = accepted
        self.spares: SpareFiles | None = None
        self.parked = ParkedFiles()
        self.space = Space(self.path, capacity, lambda: self.spare_bytes, self.name)
        report = self.recovery = RecoveryReport()
        try:
            self.index = BlockIndex(self.path, fsync=fsync, map_size=map_size, name=self.name,
                                    rebuild=rebuild_index)
            report.index_damage, report.index_moved_to = self.index.damage, self.index.moved_to
            reconcile(self.blocks_dir, os.path.join(self.path, "quarantine"), self.index, report)
            report.index_rebuilt = (rebuild_index or self.index.damage is not None
                                    or (self.index.absent and report.adopted > 0))
        except (OSError, lmdb.Error) as e:
            raise MediaUnavailable(f"{self.name}: cannot open or rebuild the index in {self.path}: {e}; "
                                   f"{REPAIR_HINT.format(path=self.path)}") from e
        self.space.used = sum(e.file_bytes for e in self.index.entries.values())
        if self.space.used > capacity:
            report.trimmed = trim_to_capacity(self.index, self.space, self.remove_file, self.name)
        report.blocks, report.file_bytes = len(self.index.entries), self.space.used
        if spare_files > 0:               # adopts the spare files a previous run left, within the room
            limit = spare_bytes if spare_bytes is not None else (lambda: self.space.configured - self.space.used)
            self.spares = SpareFiles(os.path.join(self.path, "spare"), spare_files, limit)
        level = logging.WARNING if (report.quarantined or report.index_damage) else logging.INFO
        log.log(level, "%s: opened %s: %s", self.name, self.path, report.summary())

    @property
    def spare_bytes(self) -> int:
        """Bytes (at most) in spare and parked files: on disk, but outside ``space.used``."""
        return (self.spares.nbytes if self.spares is not None else 0) + self.parked.nbytes

    def file_of(self, key: bytes) -> str:
        """Path of a block's file (``blocks/abc/<key hex>``)."""
        return block_path(self.blocks_dir, key)

    def remove_file(self, key: bytes, nbytes: int) -> None:
        """Move a block's file (``nbytes`` on disk) to the spare files, or delete it."""
        path = self.file_of(key)
        if self.spares is None or not self.spares.give(path, nbytes):
            remove_files([path])

    def forget(self, key: bytes, entry: IndexEntry) -> None:
        """The first half of deleting a committed block, under the tier's lock: it leaves
        the index in memory (a read finds it gone) and gives its space back (so its file
        may stay as a spare within the capacity). :meth:`drop` does the rest."""
        self.index.entries.pop(key, None)
        self.space.give(entry.file_bytes)

    def drop(self, key: bytes, entry: IndexEntry) -> None:
        """The second half, without the tier's lock (a rename and an index transaction: other
        threads' writes and commits go on meanwhile): the block's file goes (so a freed block
        never comes back), then its index entry on disk. An index that cannot be written
        keeps the entry on disk only; the next start drops it (the file is gone)."""
        self.remove_file(key, entry.file_bytes)
        try:
            self.index.delete([key])
        except lmdb.Error as e:
            self.index.entries.pop(key, None)
            log.warning("%s: cannot delete block %s from the index (%s); the next start will",
                        self.name, key.hex()[:16], e)

    def close(self) -> None:
        """Close the spare files and the index and release the folder lock."""
        if self.spares is not None:
            self.spares.close()
        self.index.close()
        os.close(self._lock_fd)           # releases the flock


__all__ = ["BlockFolder"]
