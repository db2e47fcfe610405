"""Capacity accounting of the NVMe tier, and what happens when the disk fills up first.

Each block costs its whole file (header, payload and padding: :func:`tiers.nvme.format.
file_bytes`) from :meth:`Space.take` at reservation until :meth:`Space.give` at free.

Disk full (ENOSPC/EDQUOT while writing, e.g. a capacity larger than the free space):
:meth:`Space.disk_full` builds the :class:`~tiers.errors.DiskFull` to raise and from then
on :attr:`Space.capacity` is what the disk can take (the tier's blocks, its spare files
and the free space) until the disk has room for the configured capacity again, so the
manager evicts from the tier instead of failing every later write.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Callable

from tiers.errors import DiskFull, NoRoom

log = logging.getLogger("kvstore.tiers.nvme")

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class Space:
    """Bytes used against a configured capacity on the filesystem of ``folder``.

    Args:
        folder: a folder on the tier's filesystem (for ``statvfs``).
        capacity: configured capacity in bytes.
        spare_bytes: returns the bytes held in spare files (reused for new blocks).
        name: tier name in messages.

    Not thread-safe: the tier calls it under its lock.
    """

    def __init__(self, folder: str, capacity: int, spare_bytes: Callable[[], int], name: str):
        self.folder = folder
        self.configured = capacity
        self.used = 0
        self.name = name
        self._spare_bytes = spare_bytes
        self._disk_limited = False

    @property
    def capacity(self) -> int:
        """The configured capacity; after :meth:`disk_full`, what the disk can take."""
        return self._disk_room() if self._disk_limited else self.configured

    def take(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more. Raises NoRoom (nothing counted) when they do not fit."""
        capacity = self.capacity
        if self.used + nbytes > capacity:
            raise NoRoom(f"{self.name}: {what} ({nbytes} bytes on disk) does not fit "
                           f"({self.used}/{capacity} bytes used)")
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used -= nbytes

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def disk_full(self, what: str) -> DiskFull:
        """The filesystem is full: hold the capacity to the room on the disk from now on.
        Returns the error to raise."""
        self._disk_limited = True
        room = self._disk_room()
        log.warning("%s: %s; capacity held to the %d bytes the disk can take (configured %d) "
                    "until it has room again", self.name, what, room, self.configured)
        return DiskFull(f"{self.name}: {what} (capacity now {room} bytes)")

    def disk_short(self, nbytes: int) -> int:
        """After :meth:`disk_full`: how many bytes the filesystem lacks for ``nbytes`` more
        (0 when they fit, or when the disk has not filled up)."""
        return max(0, nbytes - self._free()) if self._disk_limited else 0

    def _free(self) -> int:
        try:
            st = os.statvfs(self.folder)
            return st.f_bavail * st.f_frsize
        except OSError:
            return 0

    def _disk_room(self) -> int:
        free = self._free()
        room = self.used + self._spare_bytes() + free
        if room >= self.configured:
            if self._disk_limited:
                log.info("%s: the disk has room again; capacity back to %d bytes", self.name, self.configured)
            self._disk_limited = False
            return self.configured
        return room


__all__ = ["DISK_FULL_ERRNOS", "Space"]
