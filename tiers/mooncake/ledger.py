"""What the remote tier knows without asking the cluster: the blocks this node put, its
two-phase writes being staged, and the object bytes both take against the tier's capacity.

The cluster may drop a block without telling us; whoever finds one gone calls
:meth:`Ledger.forget`. Sizes are object bytes (header included,
:func:`tiers.mooncake.object_format.object_bytes`) for the capacity, payload bytes per block.
"""

from __future__ import annotations

import threading
from typing import Callable

import xxhash

from tiers.buffers import check_chunk
from tiers.errors import BlockExists, BlockNotStored, InvalidAccess, NoRoom
from tiers.mooncake.object_format import HEADER_BYTES, object_bytes
from tiers.mooncake.staging import Lease


class StagedWrite:
    """A two-phase write of ``nbytes`` payload bytes, staged in ``lease`` after room for
    the header, hashed as it arrives.

    Attributes:
        sent: stored in the cluster by ``send``; the commit only records it.
        abandoned: a put passed its deadline; the call releases the lease when it ends.
    """

    __slots__ = ("lease", "nbytes", "written", "hasher", "sent", "abandoned")

    def __init__(self, lease: Lease, nbytes: int):
        self.lease = lease
        self.nbytes = nbytes
        self.written = 0
        self.hasher = xxhash.xxh3_64()
        self.sent = False
        self.abandoned = False

    def write(self, offset: int, view: memoryview) -> None:
        """Copy the next in-order chunk in. Raises InvalidAccess (out of order, oversize)."""
        check_chunk(offset, view.nbytes, self.written, self.nbytes)
        start = HEADER_BYTES + offset
        self.lease.view[start:start + view.nbytes] = view
        self.hasher.update(view)
        self.written += view.nbytes

    def release(self) -> None:
        """Give the staging back, unless an abandoned call still owns it."""
        if not self.abandoned:
            self.lease.release()


class Ledger:
    """The blocks this node put (key -> payload bytes), its open writes, and the object
    bytes they take out of ``capacity_bytes``. Thread-safe: one lock, held only for
    bookkeeping (never across a network call).

    Args:
        capacity_bytes: object bytes this node may hold in the cluster.
        name: the tier's name, in error messages.
    """

    def __init__(self, capacity_bytes: int, name: str):
        self.capacity_bytes = capacity_bytes
        self.name = name
        self._lock = threading.Lock()
        self._own: dict[bytes, int] = {}
        self._writes: dict[bytes, StagedWrite] = {}
        self._used = 0

    # ------------------------------------------------------------------ blocks put

    @property
    def used_bytes(self) -> int:
        """Object bytes of the blocks put and of the open writes."""
        return self._used

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._own

    def __len__(self) -> int:
        return len(self._own)

    def size(self, key: bytes) -> int | None:
        """Payload bytes of a block this node put, or None."""
        return self._own.get(key)

    def keys(self) -> list[bytes]:
        """The keys of the blocks this node put (a copy)."""
        with self._lock:
            return list(self._own)

    def forget(self, key: bytes) -> None:
        """Drop a block from the ledger (freed, or found gone); no-op for an unknown key."""
        with self._lock:
            n = self._own.pop(key, None)
            if n is not None:
                self._used -= object_bytes(n)

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` object bytes about to be put. Raises NoRoom (nothing counted)."""
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:
                raise NoRoom(f"{self.name}: {nbytes} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            self._used += nbytes

    def refund(self, nbytes: int) -> None:
        """Give back object bytes counted by :meth:`charge` that were not stored."""
        with self._lock:
            self._used -= nbytes

    def settle(self, outcomes: list[tuple[bytes, int, bool]]) -> None:
        """Record charged puts, each ``(key, payload bytes, stored)``: a stored block is
        this node's, the object bytes of one not stored are given back."""
        with self._lock:
            for key, nbytes, stored in outcomes:
                if stored:
                    self._own[key] = nbytes
                else:
                    self._used -= object_bytes(nbytes)

    # ------------------------------------------------------------------ two-phase writes

    def open_write(self, key: bytes, nbytes: int, lease: Callable[[int], Lease]) -> StagedWrite:
        """Start a write of ``nbytes`` payload bytes staged in ``lease(object bytes)``.
        Raises BlockExists, NoRoom (beyond the capacity), StagingBusy (from ``lease``)."""
        obj = object_bytes(nbytes)
        with self._lock:
            if key in self._own or key in self._writes:
                raise BlockExists(f"{self.name}: block {key.hex()[:16]} already stored or being written")
            if self._used + obj > self.capacity_bytes:
                raise NoRoom(f"{self.name}: {obj} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            w = self._writes[key] = StagedWrite(lease(obj), nbytes)
            self._used += obj
            return w

    def write_of(self, key: bytes) -> StagedWrite:
        """The open write of ``key``. Raises BlockNotStored."""
        w = self._writes.get(key)
        if w is None:
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not reserved")
        return w

    def written(self, key: bytes) -> StagedWrite:
        """The open write of ``key``, every byte written.
        Raises BlockNotStored, InvalidAccess (not fully written)."""
        with self._lock:
            return self._written(key)

    def close_write(self, key: bytes) -> StagedWrite:
        """Take the fully written write of ``key`` out of the open ones; its bytes stay
        counted until :meth:`finish`. Raises BlockNotStored, InvalidAccess (not fully
        written; it stays open)."""
        with self._lock:
            w = self._written(key)
            del self._writes[key]
            return w

    def _written(self, key: bytes) -> StagedWrite:
        w = self.write_of(key)
        if w.written != w.nbytes:
            raise InvalidAccess(f"{key.hex()[:16]}: {w.written} of {w.nbytes} bytes written")
        return w

    def finish(self, key: bytes, w: StagedWrite, stored: bool) -> None:
        """After a closed write's put: the block is this node's, or its bytes are given back."""
        self.settle([(key, w.nbytes, stored)])

    def drop_write(self, key: bytes) -> StagedWrite | None:
        """Drop an open write and give its bytes back; None when there is none."""
        with self._lock:
            w = self._writes.pop(key, None)
            if w is not None:
                self._used -= object_bytes(w.nbytes)
            return w

    def close_writes(self) -> list[StagedWrite]:
        """Every open write, now no longer open (the tier is closing)."""
        with self._lock:
            writes, self._writes = list(self._writes.values()), {}
            return writes


__all__ = ["Ledger", "StagedWrite"]
