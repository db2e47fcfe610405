"""The one interface every storage medium implements (:class:`Tier`), with its medium kinds.

The store core (:mod:`kvstore.store.manager`, :mod:`kvstore.store.mover`) talks to media only
through :class:`Tier`; it never knows whether a tier is GPU memory, a host arena,
files on NVMe, a cluster store or the byte-less tier of the simulator.

Writes are two-phase, as in vLLM's offloading ``prepare_store``/``complete_store``::

    tier.reserve(key, nbytes)       # space allocated, block invisible
    tier.write(key, 0, chunk0)      # any number of in-order chunks
    tier.write(key, len(chunk0), chunk1)
    tier.commit(key)                # now readable (NVMe: checksummed and indexed)
    # or tier.abort(key) to drop the reservation

Reads have one path, :meth:`Tier.read_into`: the caller's buffer receives the block,
or only the byte ranges it asks for (a tensor-parallel rank reads its KV heads), and the
medium reads no more than it needs to verify them.

A tier never evicts on its own: when :meth:`Tier.reserve` finds no room it raises
:class:`tiers.errors.NoRoom` and the manager decides what to move away.

What a medium can do beyond this interface is declared, typed, in
:attr:`Tier.capabilities` (:mod:`tiers.capabilities`); the byte ranges and buffers tiers
take, and the checks on them, are in :mod:`tiers.buffers`. Both are importable from here.

Thread safety: the manager serialises calls that change allocation state
(``reserve``, ``commit``, ``abort``, ``free``); ``write`` and ``read_into`` of a block
the manager has pinned or reserved may run concurrently from other threads.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, Iterable

# re-exported: the store, the clients and the tests import these names from here
from tiers.buffers import ByteRanges, byte_view, check_chunk, check_ranges, output_view
from tiers.capabilities import (
    NO_CAPABILITIES,
    Capabilities,
    DeviceFileIO,
    DeviceResident,
    HostAddressable,
    IpcHandle,
    RemoteStore,
    SegmentInfo,
    SharedSegment,
)


class TierKind(enum.IntEnum):
    """Tier media, numbered as in ``proto/kvstore.proto``'s ``Tier`` enum."""

    HBM = 1
    HOST = 2
    NVME = 3
    REMOTE = 4


class Tier(abc.ABC):
    """A medium holding whole blocks by key, with byte capacity accounting.

    Class attributes:
        kind: the medium.
        volatile: True when blocks do not survive a restart (memory tiers); the manager
            copies such blocks to a persistent tier on a graceful stop.
    """

    kind: TierKind
    name: str
    volatile: bool = True

    @property
    def capabilities(self) -> Capabilities:
        """Typed capabilities of this tier (none by default)."""
        return NO_CAPABILITIES

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes this tier may hold; :attr:`used_bytes` never exceeds it."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes held by committed blocks and open reservations (allocator units)."""

    @property
    def max_block_bytes(self) -> int:
        """Largest payload that can ever fit (bytes): the capacity unless a medium caps it."""
        return self.capacity_bytes

    @abc.abstractmethod
    def __contains__(self, key: bytes) -> bool:
        """True when ``key`` is committed here."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of committed blocks."""

    @abc.abstractmethod
    def fits(self, nbytes: int) -> bool:
        """True when :meth:`reserve` of ``nbytes`` would succeed now."""

    @abc.abstractmethod
    def size_of(self, key: bytes) -> int:
        """Payload bytes of a committed block. Raises BlockNotStored."""

    @abc.abstractmethod
    def reserve(self, key: bytes, nbytes: int) -> None:
        """Allocate room for a block of ``nbytes`` bytes; the block stays invisible.

        Raises:
            NoRoom: not enough (contiguous) free space, or larger than :attr:`max_block_bytes`.
            BlockExists: ``key`` is already reserved or committed here.
            MediaIOError: the medium failed.
        """

    @abc.abstractmethod
    def write(self, key: bytes, offset: int, data: Any) -> None:
        """Copy ``data`` (any C-contiguous buffer) into a reserved block at byte ``offset``.

        Chunks must arrive in order (``offset`` equal to the bytes written so far).
        Raises BlockNotStored (not reserved), InvalidAccess (out of order, oversize),
        MediaIOError (and DiskFull) on I/O failure.
        """

    @abc.abstractmethod
    def commit(self, key: bytes) -> None:
        """Make a fully written reservation readable.

        Raises BlockNotStored (not reserved), InvalidAccess (fewer bytes than reserved were
        written), MediaIOError (the reservation is then dropped).
        """

    @abc.abstractmethod
    def abort(self, key: bytes) -> None:
        """Drop a reservation and its space. No-op for an unknown key."""

    @abc.abstractmethod
    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Copy a committed block, or the concatenation of ``ranges`` of it, into the start
        of writable buffer ``out``; return the bytes copied.

        The medium reads only what the ranges need (plus what verifying them needs).

        Raises:
            BlockNotStored: not committed here.
            InvalidAccess: a range outside the block, or ``out`` too small or read-only.
            BlockCorrupt: only on proof that the stored bytes are bad: a checksum
                mismatch, a malformed header, truncated data (``out`` may then hold
                garbage, never reported as the block). The caller drops the copy.
            MediaIOError: the medium failed for this call (EMFILE, ENFILE, EIO, ENOSPC,
                EAGAIN, a timeout): no proof against the block, which stays stored.
        """

    @abc.abstractmethod
    def free(self, key: bytes) -> None:
        """Delete a committed block and return its space. Raises BlockNotStored."""

    def evict(self, key: bytes) -> None:
        """Free a committed block to make room (the store's eviction): as :meth:`free`,
        except that a persistent tier may keep its file for the next write to reuse, so a
        crash may bring the block back until then (see :meth:`forget_evicted`). Raises
        BlockNotStored."""
        self.free(key)

    def forget_evicted(self, key: bytes) -> None:
        """Make sure no file :meth:`evict` kept of ``key`` remains (the block is deleted):
        no crash brings it back. Nothing to do for most tiers."""

    def problem(self) -> str | None:
        """What keeps this tier from storing blocks now (e.g. its folder is gone), or None.
        Cheap: the daemon's health check calls it every second."""
        return None

    def recover(self) -> Iterable[tuple[bytes, int]]:
        """Blocks that survived a restart, as ``(key, nbytes)``, oldest first. Volatile
        tiers: none."""
        return ()

    def close(self) -> None:
        """Release resources (files, index, memory). The tier is unusable afterwards."""

    def describe(self) -> str:
        return f"{self.name}({self.kind.name.lower()}, {self.capacity_bytes} bytes)"


def read_bytes(tier: Tier, key: bytes, ranges: ByteRanges | None = None) -> bytes:
    """A committed block (or ``ranges`` of it) as new bytes: :meth:`Tier.read_into` into a
    fresh buffer. For tests and tools; the data path reads into buffers it owns."""
    total = check_ranges(ranges, tier.size_of(key))
    out = bytearray(total)
    tier.read_into(key, out, ranges)
    return bytes(out)


__all__ = ["ByteRanges", "Capabilities", "DeviceFileIO", "DeviceResident", "HostAddressable", "IpcHandle",
           "NO_CAPABILITIES", "RemoteStore", "SegmentInfo", "SharedSegment", "Tier", "TierKind", "byte_view", "check_chunk",
           "check_ranges", "output_view", "read_bytes"]
