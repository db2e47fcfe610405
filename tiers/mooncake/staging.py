"""A bounded, registered host buffer through which blocks go to and from a cluster store.

Transfer engines (Mooncake's) move bytes only between memory regions registered with
them, so the remote tier owns one host buffer, registered once at start, and lends
pieces of it (:class:`Lease`) to writes being staged and to reads being fetched and
verified. Its size bounds the memory the remote tier ever uses.

Pieces are placed first fit in a free list sorted by address that merges neighbours on
release; every piece starts on a 4096-byte boundary (DMA friendly). A lease whose
remote call was abandoned at its deadline is released only when that call returns, so
a late transfer never writes into memory lent to someone else.
"""

from __future__ import annotations

import bisect
import functools
import threading
import time
from typing import Callable

from tiers.errors import InvalidAccess, MediaIOError
from tiers.memory import allocate_host_buffer

ALIGN = 4096
_LEAKED: list = []          # buffers kept alive because a call may still write into them


class StagingBusy(MediaIOError):
    """No room in the staging buffer now: too many blocks are being moved."""


class Lease:
    """``nbytes`` bytes of the staging buffer lent to one transfer.

    Attributes:
        offset: bytes from the buffer's start.
        nbytes: bytes lent (the size asked for, not rounded).
        address: address of the first byte (for the transfer engine).
        view: writable flat byte view of the piece.
    """

    __slots__ = ("offset", "nbytes", "address", "view", "_give_back")

    def __init__(self, offset: int, nbytes: int, address: int, view: memoryview, give_back: Callable[[], None]):
        self.offset = offset
        self.nbytes = nbytes
        self.address = address
        self.view = view
        self._give_back = give_back

    def release(self) -> None:
        """Return the piece; a second release is a no-op."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            self.view.release()
            give_back()


class StagingArena:
    """One preallocated host buffer of ``nbytes`` bytes lent in pieces.

    Args:
        nbytes: buffer size in bytes (rounded up to 4096).

    Attributes:
        address: address of the buffer's first byte.
        nbytes: its size.
    """

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"staging size must be > 0 bytes, got {nbytes}")
        self.nbytes = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self._buffer = allocate_host_buffer(self.nbytes, alignment=ALIGN)
        self._view = memoryview(self._buffer.array).cast("B")
        self.address = int(self._buffer.array.ctypes.data)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]     # (start, size) by start
        self._used = 0
        self._leases = 0
        self._cond = threading.Condition()

    @property
    def used_bytes(self) -> int:
        """Bytes lent now (in 4096-byte units)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.nbytes - self._used

    def can_lease(self, nbytes: int) -> bool:
        """True when :meth:`lease` of ``nbytes`` would succeed without waiting."""
        size = _round(nbytes)
        with self._cond:
            return any(s >= size for _, s in self._free)

    def lease(self, nbytes: int, wait_s: float = 0.0) -> Lease:
        """Lend ``nbytes`` bytes, waiting up to ``wait_s`` seconds for room.

        Raises:
            InvalidAccess: ``nbytes`` exceeds the whole buffer.
            StagingBusy: no room within ``wait_s``.
        """
        size = _round(nbytes)
        if size > self.nbytes:
            raise InvalidAccess(f"{nbytes} bytes exceed the {self.nbytes}-byte staging buffer")
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                for i, (start, free) in enumerate(self._free):
                    if free >= size:
                        if free == size:
                            del self._free[i]
                        else:
                            self._free[i] = (start + size, free - size)
                        self._used += size
                        self._leases += 1
                        return Lease(start, nbytes, self.address + start, self._view[start:start + nbytes],
                                     functools.partial(self._release, start, size))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingBusy(f"staging buffer busy: {self._used} of {self.nbytes} bytes lent, "
                                      f"{nbytes} more wanted")
                self._cond.wait(left)

    def _release(self, start: int, size: int) -> None:
        with self._cond:
            self._used -= size
            i = bisect.bisect_left(self._free, (start, 0))
            end = start + size
            if i < len(self._free) and self._free[i][0] == end:         # merge with the next
                size += self._free[i][1]
                del self._free[i]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:   # and the previous
                start, prev = self._free[i - 1]
                size += prev
                i -= 1
                del self._free[i]
            self._free.insert(i, (start, size))
            self._leases -= 1
            self._cond.notify_all()

    def close(self, keep: bool = False) -> None:
        """Drop the buffer. While pieces are still lent (a call abandoned at its deadline
        may write into them), or with ``keep`` (a library may still use the registered
        memory), it is kept alive for the process's life instead."""
        with self._cond:
            if self._leases or keep:
                _LEAKED.append(self._buffer)
            self._view = memoryview(b"")
            self._buffer = None


def _round(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


__all__ = ["ALIGN", "Lease", "StagingArena", "StagingBusy"]
