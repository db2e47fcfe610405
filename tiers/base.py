"""The one interface every storage medium implements.

The tier manager (:mod:`kvstore.manager`) only talks to this interface; it never
knows whether a tier is GPU memory, a host arena, files on NVMe or the byte-less
accounting tier that the simulator uses.

Writes are two-phase, as in vLLM's offloading ``prepare_store``/``complete_store``::

    tier.reserve(key, nbytes)       # space allocated, block invisible
    tier.write(key, 0, chunk0)      # any number of in-order chunks
    tier.write(key, len(chunk0), chunk1)
    tier.commit(key)                # now readable (NVMe: checksummed and indexed)
    # or tier.abort(key) to drop the reservation

A tier never evicts on its own: when :meth:`Tier.reserve` cannot find room it raises
:class:`kvstore.errors.TierFull` and the manager decides what to move away.

Thread safety: the manager serialises calls that change allocation state
(``reserve``, ``commit``, ``abort``, ``free``) under its lock; ``write`` and
``read`` of a block the manager has pinned may run concurrently from other threads.
"""

from __future__ import annotations

import abc
import enum
from typing import Iterable, Sequence


class TierKind(enum.IntEnum):
    """Tier media, numbered as in ``proto/kvstore.proto``'s ``Tier`` enum."""

    HBM = 1
    HOST = 2
    NVME = 3


ByteRanges = Sequence[tuple[int, int]]
"""``(offset, length)`` pairs inside one block payload, in bytes."""


def check_ranges(ranges: ByteRanges | None, size: int) -> int:
    """Validate byte ranges against a payload of ``size`` bytes; return their total length.

    Raises ValueError for a negative or out-of-bounds range.
    """
    if not ranges:
        return size
    total = 0
    for off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(f"byte range ({off}, {length}) is outside a {size}-byte block")
        total += length
    return total


def check_chunk(offset: int, nbytes: int, written: int, size: int) -> None:
    """Validate one in-order chunk of a two-phase write (all in bytes).

    Raises ValueError when ``offset`` is not the number of bytes ``written`` so far or
    the chunk runs past the block's ``size``.
    """
    if offset != written:
        raise ValueError(f"chunk at offset {offset} but {written} bytes written so far")
    if offset + nbytes > size:
        raise ValueError(f"chunk [{offset}, {offset + nbytes}) overruns the block's {size} bytes")


class Tier(abc.ABC):
    """A medium holding whole blocks by key, with byte capacity accounting."""

    kind: TierKind
    name: str

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes this tier may hold; :attr:`used_bytes` never exceeds it."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes held by committed blocks and open reservations (allocator units)."""

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
    def reserve(self, key: bytes, nbytes: int) -> None:
        """Allocate room for a block of ``nbytes`` bytes; the block stays invisible.

        Raises:
            TierFull: not enough (contiguous) free space.
            ValueError: ``key`` is already reserved or committed here.
        """

    @abc.abstractmethod
    def write(self, key: bytes, offset: int, data: memoryview | bytes) -> None:
        """Copy ``data`` into a reserved block at byte ``offset``.

        Chunks must arrive in order (``offset`` equal to the bytes written so far).
        Raises ValueError for an out-of-order or oversize chunk, TierIOError on I/O failure.
        """

    @abc.abstractmethod
    def commit(self, key: bytes) -> None:
        """Make a fully written reservation readable.

        Raises ValueError if fewer bytes than reserved were written; TierIOError on I/O failure
        (the reservation is then aborted).
        """

    @abc.abstractmethod
    def abort(self, key: bytes) -> None:
        """Drop a reservation and its space. No-op for an unknown key."""

    @abc.abstractmethod
    def read(self, key: bytes, ranges: ByteRanges | None = None) -> bytes:
        """Return a committed block's bytes (or the concatenation of ``ranges`` of it).

        Raises:
            KeyError: not stored here.
            CorruptBlock: checksum mismatch or truncated data (never returns wrong bytes).
            TierIOError: the medium failed.
        """

    def view(self, key: bytes) -> memoryview:
        """Zero-copy view of a committed block, for tiers in addressable memory.

        Valid only while the manager holds the block pinned. Tiers that cannot give one
        (NVMe) return a fresh buffer from :meth:`read`.
        """
        return memoryview(self.read(key))

    @abc.abstractmethod
    def size_of(self, key: bytes) -> int:
        """Payload bytes of a committed block. Raises KeyError if not stored here."""

    @abc.abstractmethod
    def free(self, key: bytes) -> None:
        """Delete a committed block and return its space. Raises KeyError if absent."""

    def recover(self) -> Iterable[tuple[bytes, int]]:
        """Blocks that survived a restart, as ``(key, nbytes)``. Volatile tiers: none."""
        return ()

    def close(self) -> None:
        """Release resources (files, index, memory). The tier is unusable afterwards."""

    def describe(self) -> str:
        return f"{self.name}({self.kind.name.lower()}, {self.capacity_bytes} bytes)"
