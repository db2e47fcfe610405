"""Group commit of the NVMe tier: with ``fsync``, the blocks committing at the same time
share their index transaction, and their flushes are issued together.

A commit with ``fsync`` must make the block durable before it returns: its file's data,
its name in its folder, and its index entry. One block at a time that is three device
flushes in a row (``fdatasync`` of the file, ``fsync`` of the folder, LMDB's synchronous
commit): 14-20 ms per block on this team's VMs whatever its size. So each commit
(the mover's disk workers, several Put streams, on their own threads)

1. calls ``fdatasync`` on its temp file (payload, header, size): the bytes are on the device;
2. closes and renames ``<hex>.tmp`` to ``<hex>``, calls ``fsync`` on the folder: the
   name is;
3. joins a :class:`GroupCommit`: the first commit to arrive leads, takes every commit
   waiting and indexes them all in ONE synchronous LMDB transaction; commits that
   arrive meanwhile wait and form the next batch (the leader-follower group commit of
   database logs, without a delay: a batch is whatever arrived during the last one).

Steps 1-2 of commits in flight together overlap, and the kernel merges flushes issued
at the same time (jbd2 batches the journal commits, the block layer the cache flushes):
``fdatasync`` of 8 files from 8 threads took 0.7-2.6 ms in all here, one after the
other about 4 ms each. No commit returns before its index transaction is durable, and
no block is indexed before its bytes and name are, so a crash at any point leaves no
block indexed whose bytes are not on the device: a block renamed but not indexed is
adopted from its header at the next start (:mod:`tiers.nvme.recover`), a temp file is
deleted. A step that fails for one block fails that commit alone; a failed index
transaction fails the commits it carried.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

Flush = Callable[[Sequence[T]], Sequence["BaseException | None"]]
"""``flush(items) -> errors``: commit ``items`` together; one error (or None) per item."""


class _Member:
    __slots__ = ("item", "done", "error")

    def __init__(self, item) -> None:
        self.item = item
        self.done = False
        self.error: BaseException | None = None


class GroupCommit:
    """Commits that share one :data:`Flush` (see the module docstring). Thread-safe.

    ``batches`` and ``items`` count the flushes run and the commits they carried.
    """

    def __init__(self, flush: Flush):
        self._flush = flush
        self._cond = threading.Condition()
        self._queue: list[_Member] = []
        self._leading = False
        self.batches = 0
        self.items = 0

    @property
    def waiting(self) -> int:
        """Commits waiting for the next batch (the one being flushed excluded)."""
        with self._cond:
            return len(self._queue)

    def commit(self, item) -> BaseException | None:
        """Flush ``item`` with the commits in flight; returns once a flush that carried it
        has finished: None, or the error that failed it (the caller raises its own)."""
        me = _Member(item)
        with self._cond:
            self._queue.append(me)
            while self._leading and not me.done:
                self._cond.wait()
            if me.done:
                return me.error
            self._leading = True
            batch, self._queue = self._queue, []
        errors: Sequence[BaseException | None] = ()
        try:
            errors = self._flush([m.item for m in batch])
        except BaseException as e:  # noqa: BLE001 - the flush reports per item; this is a bug or an interrupt
            errors = [e] * len(batch)
            raise
        finally:
            with self._cond:
                for m, err in zip(batch, errors or [RuntimeError("the group flush did not finish")] * len(batch)):
                    m.error, m.done = err, True
                self._leading = False
                self.batches += 1
                self.items += len(batch)
                self._cond.notify_all()
        return me.error


def fdatasync(fd: int) -> None:
    """Flush a file's data and the metadata needed to read it (``fsync`` where the system
    has no ``fdatasync``). Raises OSError."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def fsync_folder(folder: str) -> None:
    """Flush a folder's entries (the names renamed into it). Raises OSError."""
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Flush", "GroupCommit", "fdatasync", "fsync_folder"]
