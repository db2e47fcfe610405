"""Evicted blocks' files parked for the next reservation: an eviction with no disk I/O.

A free moves the block's file to the spare files and deletes its index entry: a rename and
an LMDB transaction (0.1-0.3 ms; a flushed one with fsync). The store evicts under its own
lock to make room for the block it is about to write, so that disk work stalled every
other thread of the store. :meth:`tiers.nvme.tier.NVMeTier.evict` does only the
bookkeeping (the block leaves the index in memory, its space is given back) and *parks*
the file: it keeps its name and its index entry on disk. The next reservation claims it
as its spare file (:meth:`ParkedFiles.claim`); that reservation's writer thread, holding
no lock, renames it to the reservation's temp file before it writes a byte, and its commit
drops the evicted block's index entry in the same transaction as its own. Parked files no
reservation claims (more evicted than written, or sizes that do not fit) stay parked,
counted beside the blocks like spare files: a reservation that needs their room (capacity,
or a full disk) deletes them, and the tier's close moves them to the spare files.

The cost: a crash while a file is parked (until a reservation claims it, a few
milliseconds under load for a file of the size being written; never after a graceful close) brings its block back at the next start, whole and
verified like any block. A deleted block never comes back: deleting a key also moves its
parked file, or waits for its move (:meth:`tiers.nvme.tier.NVMeTier.forget_evicted`).

:class:`ParkedFiles` is bookkeeping under the tier's lock; :class:`Frees` moves files
without it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import lmdb

from tiers.nvme.spare import remove_files

log = logging.getLogger("kvstore.tiers.nvme")


class Parked:
    """The parked file of block ``key`` at ``path`` (``nbytes`` on disk); ``owner``: the
    reservation (:class:`tiers.nvme.write.PendingBlock`) that claimed it, or None."""

    __slots__ = ("key", "path", "nbytes", "owner")

    def __init__(self, key: bytes, path: str, nbytes: int):
        self.key, self.path, self.nbytes = key, path, nbytes
        self.owner: Any = None


class ParkedFiles:
    """The parked files of one tier (see the module docstring).

    ``nbytes`` counts the parked bytes no reservation holds as its file (on disk, outside
    the tier's used bytes, like spare files); ``moving`` the keys whose parked file a
    thread is renaming now (a commit of the same key waits for it to end).
    """

    def __init__(self) -> None:
        self.files: dict[bytes, Parked] = {}          # parked order: most recent last
        self.nbytes = 0
        self.moving: set[bytes] = set()

    def park(self, key: bytes, path: str, nbytes: int) -> None:
        self.files[key] = Parked(key, path, nbytes)
        self.nbytes += nbytes

    def claim(self, p: Any) -> tuple[Parked | None, Any]:
        """Give reservation ``p`` a parked file no larger than ``p.disk`` as its spare file
        (``p.spare``; ``p.parked`` is its :class:`Parked`): the parked file of its own key, taken from any
        reservation that claimed it (its name is about to be this block's), else the most
        recently parked one that fits. Returns the parked file of its own key when it is too
        large to reuse (out of the parked files and moving, for the caller to delete now),
        and the reservation it was taken from (its spare now None), or None for either."""
        own = self.files.get(p.key)
        if own is None:
            self.claim_other(p)
            return None, None
        robbed = own.owner
        if own.nbytes > p.disk:
            return self.take(p.key), robbed     # deleted: the robbed reservation waits for that
        self._unclaim(own)
        self._give(own, p)
        return None, robbed

    def claim_other(self, p: Any) -> bool:
        """Give ``p`` the most recently parked unclaimed file no larger than ``p.disk`` (as
        :meth:`claim`, not its own key's); False when none fits."""
        for e in reversed(self.files.values()):
            if e.owner is None and e.nbytes <= p.disk and e.key != p.key:
                self._give(e, p)
                return True
        return False

    def _give(self, e: Parked, p: Any) -> None:
        e.owner = p
        p.parked = e
        p.spare = (e.path, e.nbytes)
        self.nbytes -= e.nbytes

    def release(self, p: Any) -> None:
        """Reservation ``p`` was dropped before it moved its parked file (its spare): the file
        stays parked, unclaimed."""
        e = p.parked
        if e is not None:
            e.owner = None
            self.nbytes += e.nbytes
        p.parked = None
        p.spare = None

    def _unclaim(self, e: Parked) -> None:
        owner = e.owner
        if owner is None:
            return
        owner.spare = None
        owner.parked = None
        e.owner = None
        self.nbytes += e.nbytes

    def begin_move(self, p: Any) -> Parked | None:
        """``p``'s parked spare file (its temp file to be), out of the parked files and into
        :attr:`moving` (``p.parked`` and ``p.spare`` cleared), or None when it has none."""
        e = p.parked
        if e is None:
            return None
        p.parked = p.spare = None
        del self.files[e.key]
        self.moving.add(e.key)
        return e

    def unclaimed(self) -> list[Parked]:
        """Every unclaimed parked file, out of the parked files and moving (the tier's close)."""
        return [self.take(e.key) for e in list(self.files.values()) if e.owner is None]

    def shed(self, nbytes: int) -> list[Parked]:
        """Unclaimed parked files of at least ``nbytes`` bytes in all (the oldest first, fewer
        when fewer are held), out of the parked files and moving, for the caller to delete."""
        out: list[Parked] = []
        for e in list(self.files.values()):
            if nbytes <= 0:
                break
            if e.owner is None:
                out.append(self.take(e.key))
                nbytes -= e.nbytes
        return out

    def take(self, key: bytes) -> Parked | None:
        """The parked file of ``key`` alone, out of the parked files and into :attr:`moving`
        (taken from any reservation that claimed it), or None."""
        e = self.files.get(key)
        if e is None:
            return None
        if e.owner is not None:             # its writer makes no file until this one is gone
            e.owner.awaits = key
        self._unclaim(e)
        del self.files[key]
        self.nbytes -= e.nbytes
        self.moving.add(key)
        return e

    def end_move(self, keys) -> None:
        self.moving.difference_update(keys)


def move_files(spare: Parked | None, temp: str, others: list[Parked], remove_file: Callable[[bytes, int], None],
               index: Any, delete: bool = False) -> bool:
    """Move parked files, holding no lock (their keys in :attr:`ParkedFiles.moving`):
    ``spare`` renamed to ``temp`` (a reservation's temp file: its index entry is dropped
    by that reservation's commit, in the same transaction), ``others`` to the spare files
    (``remove_file(key, nbytes)``; with ``delete`` deleted), then their index entries
    deleted in one transaction (after the files: a crash in between leaves entries without
    files, which the next start drops). Returns whether ``spare`` is at ``temp`` now."""
    renamed = False
    if spare is not None:
        try:
            os.rename(spare.path, temp)
            renamed = True
        except OSError as e:                # gone or not movable: the reservation makes a new file
            log.debug("parked file %s not reused: %s", spare.path, e)
            remove_files([spare.path])
    if delete:
        remove_files([e.path for e in others])
    else:
        for e in others:
            remove_file(e.key, e.nbytes)
    keys = [e.key for e in others]
    if keys:
        try:
            index.drop_stale(keys)
        except lmdb.Error as e:
            log.warning("cannot delete %d evicted blocks from the index (%s); the next start will",
                        len(keys), e)
    return renamed


class Frees:
    """Freed and parked files of one tier that a thread moves without the tier's ``lock``.

    A free (:meth:`tiers.nvme.tier.NVMeTier.free`) and the parked files moved to the spare
    files count as frees in flight: a reservation waits for them (:meth:`wait_locked`), so
    that it sees the freed files among the spare files and the disk, not half-way (one made
    meanwhile found no spare file, made a new file and left blocks and spare files above
    the capacity, or failed with DiskFull on a full disk). A commit waits for the old file of
    its own name (:meth:`wait_key_locked`), the tier's close for all (:meth:`wait_all_locked`).

    Args:
        lock: the tier's lock; parked: its :class:`ParkedFiles`; index: its
            :class:`~tiers.nvme.index.BlockIndex`; remove_file: ``(key, nbytes)`` moves a
            block's file to the spare files or deletes it.
    """

    def __init__(self, lock: threading.Lock, parked: ParkedFiles, index: Any,
                 remove_file: Callable[[bytes, int], None]):
        self.parked = parked
        self._count = 0
        self._ended = threading.Condition(lock)
        self._lock = lock
        self._index = index
        self._remove_file = remove_file

    def begin_locked(self, n: int = 1) -> None:
        """``n`` frees are about to move files without the lock; :meth:`end` once they have."""
        self._count += n

    def end(self, n: int = 1) -> None:
        with self._lock:
            self._end_locked(n)

    def _end_locked(self, n: int) -> None:
        self._count -= n
        self._ended.notify_all()

    def wait_locked(self) -> None:
        """Wait (under the lock, dropped meanwhile) until no free is moving a file."""
        while self._count:
            self._ended.wait()

    def wait_taken_locked(self, p: Any) -> None:
        """Wait until no file taken from reservation ``p`` (``p.awaits``) is moving, however often
        it is robbed meanwhile."""
        while p.awaits is not None and p.awaits in self.parked.moving:
            self._ended.wait()
        p.awaits = None

    def wait_key_locked(self, key: bytes) -> None:
        """Wait until no parked file of ``key`` is moving (its name is about to be reused)."""
        while key in self.parked.moving:
            self._ended.wait()

    def wait_all_locked(self) -> None:
        """Wait until no free and no parked file is moving (the tier's close)."""
        while self._count or self.parked.moving:
            self._ended.wait()

    def move(self, spare: Parked | None, temp: str, others: list[Parked], p: Any = None,
             delete: bool = False) -> bool:
        """:func:`move_files` without the lock (``others`` counted by :meth:`begin_locked`
        before); their keys leave :attr:`ParkedFiles.moving` after, when ``spare``'s key joins
        ``p.stale`` (the index entries reservation ``p`` drops: under the lock, so that an
        abort sees it)."""
        try:
            return move_files(spare, temp, others, self._remove_file, self._index, delete)
        finally:
            with self._lock:
                self.parked.end_move([e.key for e in ([spare] if spare else []) + others])
                if spare is not None and p is not None:
                    p.stale.append(spare.key)
                self._end_locked(len(others))

    def drop_stale(self, stale: list[bytes]) -> None:
        """Delete the index entries of evicted blocks whose files a dropped reservation took."""
        if stale:
            try:
                self._index.drop_stale(stale)
            except lmdb.Error as e:
                log.debug("stale index entries kept until the next start: %s", e)

    def drop_parked(self, key: bytes | None = None) -> None:
        """Move the parked file of ``key`` (None: every unclaimed one) to the spare files and
        delete its index entry, now (a deleted block's; the tier's close)."""
        claimed = False
        with self._lock:
            if key is None:
                others = self.parked.unclaimed()
            else:
                e = self.parked.files.get(key)
                claimed = e is not None and e.owner is not None
                others = [self.parked.take(key)] if e is not None else []
                if e is None:                   # moving already: away (and its entry no longer used) once it ends
                    self.wait_key_locked(key)
            self.begin_locked(len(others))
        if others:                              # a claimed one is deleted: its reservation makes a file
            self.move(None, "", others, delete=claimed)


__all__ = ["Frees", "Parked", "ParkedFiles", "move_files"]
