"""The one interface every storage medium implements, and the typed capabilities some add.

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

**Capabilities.** What a medium can do beyond this interface is declared, typed, in
:attr:`Tier.capabilities` (a :class:`Capabilities` record of :class:`typing.Protocol`
implementations, usually the tier itself), so the core dispatches on declared
capabilities, never by probing attributes:

====================  ================================================================
capability            who has it, what it gives
====================  ================================================================
``host``              host arena, HBM stand-in: zero-copy views of blocks in host memory
                      (:class:`HostAddressable`)
``shared``            host arena: the blocks live in one shared-memory segment that
                      same-node clients map (:class:`SharedSegment`)
``device``            HBM on a GPU: CUDA arrays over blocks, CUDA IPC handles
                      (:class:`DeviceResident`)
``device_files``      NVMe with GPUDirect Storage: file <-> device memory without a host
                      copy (:class:`DeviceFileIO`)
``remote``            a cluster store (Mooncake): batched existence checks, gets and puts
                      of blocks other nodes may hold (:class:`RemoteStore`)
====================  ================================================================

Thread safety: the manager serialises calls that change allocation state
(``reserve``, ``commit``, ``abort``, ``free``); ``write`` and ``read_into`` of a block
the manager has pinned or reserved may run concurrently from other threads.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from tiers.errors import InvalidAccess


class TierKind(enum.IntEnum):
    """Tier media, numbered as in ``proto/kvstore.proto``'s ``Tier`` enum."""

    HBM = 1
    HOST = 2
    NVME = 3
    REMOTE = 4


ByteRanges = Sequence[tuple[int, int]]
"""``(offset, length)`` pairs inside one block payload, in bytes."""


def check_ranges(ranges: ByteRanges | None, size: int) -> int:
    """Validate byte ranges against a payload of ``size`` bytes; return their total length
    (``size`` when ``ranges`` is empty or None).

    Raises InvalidAccess for a negative or out-of-bounds range.
    """
    if not ranges:
        return size
    total = 0
    for off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise InvalidAccess(f"byte range ({off}, {length}) is outside a {size}-byte block")
        total += length
    return total


def check_chunk(offset: int, nbytes: int, written: int, size: int) -> None:
    """Validate one in-order chunk of a two-phase write (all in bytes).

    Raises InvalidAccess when ``offset`` is not the number of bytes ``written`` so far or
    the chunk runs past the block's ``size``.
    """
    if offset != written:
        raise InvalidAccess(f"chunk at offset {offset} but {written} bytes written so far")
    if offset + nbytes > size:
        raise InvalidAccess(f"chunk [{offset}, {offset + nbytes}) overruns the block's {size} bytes")


def byte_view(data: Any, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, memoryview,
    numpy array, mmap). Raises InvalidAccess for a read-only buffer when ``writable``."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise InvalidAccess("the output buffer is read-only")
    return view


def output_view(out: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` bytes of writable buffer ``out`` as a flat byte view.

    Raises InvalidAccess when ``out`` is read-only or smaller than ``nbytes``.
    """
    view = byte_view(out, writable=True)
    if view.nbytes < nbytes:
        raise InvalidAccess(f"output buffer has {view.nbytes} bytes, {nbytes} are read")
    return view[:nbytes]


# ---------------------------------------------------------------------- capabilities

@runtime_checkable
class HostAddressable(Protocol):
    """Blocks in host memory this process addresses directly (zero-copy)."""

    def view(self, key: bytes) -> memoryview:
        """Read-only view of a committed block's payload; valid while the block is pinned.
        Raises BlockNotStored."""

    def write_view(self, key: bytes) -> memoryview:
        """Writable view over a whole reservation (its reserved size), to be filled in
        place and then recorded with :meth:`mark_written`. Raises BlockNotStored."""

    def mark_written(self, key: bytes, nbytes: int) -> None:
        """Record that the first ``nbytes`` of a reservation were filled in place.
        Raises BlockNotStored, InvalidAccess (beyond the reservation)."""


@dataclass(frozen=True)
class SegmentInfo:
    """A shared-memory segment same-node clients may map.

    Attributes:
        fd: file descriptor of the segment (a memfd), to pass by SCM_RIGHTS.
        size: bytes to map.
        name: a label for logs (``memfd:<name>``).
    """

    fd: int
    size: int
    name: str


@runtime_checkable
class SharedSegment(Protocol):
    """Blocks in one shared-memory segment that same-node clients map."""

    def segment(self) -> SegmentInfo:
        """The segment; the same for the tier's life."""

    def extent(self, key: bytes) -> tuple[int, int]:
        """``(offset, size)`` in bytes of a committed block's or a reservation's payload
        in the segment. Raises BlockNotStored."""


@dataclass(frozen=True)
class IpcHandle:
    """Where a block lives in device memory, for a worker on the same GPU.

    Attributes:
        handle: the slab's ``cudaIpcMemHandle_t`` (64 bytes), or for the CPU stand-in the
            shared-memory segment name (UTF-8).
        offset: bytes from the address the handle opens at to the block.
        size: payload bytes.
        device: CUDA device ordinal; -1 for the CPU stand-in.
    """

    handle: bytes
    offset: int
    size: int
    device: int


@runtime_checkable
class DeviceResident(Protocol):
    """Blocks in GPU memory (the HBM tier)."""

    def device_array(self, key: bytes) -> Any:
        """1-D uint8 array over a committed block or a reservation, without copying:
        a CUDA array (``__cuda_array_interface__``) on a GPU. Raises BlockNotStored."""

    def mark_written(self, key: bytes, nbytes: int) -> None:
        """Record that a reservation was filled in place through :meth:`device_array`."""

    def ipc_handle(self, key: bytes) -> IpcHandle:
        """Where a committed block lives, for :func:`kvstore.client.ipc.open_block` in a worker.
        Raises BlockNotStored."""


@runtime_checkable
class DeviceFileIO(Protocol):
    """Moves whole blocks between files and device memory (GPUDirect Storage)."""

    def write_from_device(self, key: bytes, device_buf: Any) -> None:
        """Fill a whole reservation from a C-contiguous device array (commit follows).
        Raises BlockNotStored, MediaIOError."""

    def read_into_device(self, key: bytes, device_buf: Any) -> int:
        """Read a committed block into the start of a device array and verify it; returns
        its size. Raises BlockNotStored, BlockCorrupt, MediaIOError, InvalidAccess."""


@runtime_checkable
class RemoteStore(Protocol):
    """A cluster-wide block store shared by many nodes (the remote tier).

    The tier's own bookkeeping (``in``, ``len``, ``used_bytes``) covers the blocks this
    node put; these calls ask the cluster, one round trip per batch, so a local miss
    costs one call however many blocks it covers. Every call is bounded by the tier's
    deadline; when the cluster cannot be reached it raises MediaIOError quickly (a
    circuit breaker refuses calls for a while after repeated failures), never hangs.
    """

    def exists_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        """For each 32-byte key, whether the cluster holds a block under it now, waiting
        ``deadline_s`` seconds at most (None: the tier's own deadline).
        Raises MediaIOError, InvalidAccess (a malformed key)."""

    def sizes_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[int | None]:
        """For each key, the payload bytes of the block the cluster holds under it, or None
        (absent); one round trip. A hint (it may come from a cache): the get that
        follows verifies. Raises MediaIOError, InvalidAccess."""

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Fetch whole blocks into the start of writable buffers ``outs`` (one per key,
        each at least the block's size) and verify each; per key the payload bytes
        copied, or None for a miss: not in the cluster, a corrupt or truncated copy (then
        dropped from the cluster), a block larger than its buffer, or a peer that did not
        answer. Wrong bytes are never reported as a block.
        Raises MediaIOError (the cluster is unreachable), InvalidAccess."""

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """Store ``(key, payload)`` blocks in the cluster in one batch; per item True
        when the cluster holds it afterwards (already there counts). Raises NoRoom
        (beyond this node's capacity), MediaIOError, InvalidAccess."""

    def send(self, key: bytes) -> None:
        """Store a fully written reservation (``reserve`` + ``write``) in the cluster now,
        so that the ``commit`` that follows does no network I/O (the store core commits
        under its lock). Raises BlockNotStored, InvalidAccess (not fully written),
        MediaIOError (the reservation stays until ``abort``)."""

    def call_counters(self) -> dict[str, int]:
        """Counts since start (no network call): ``calls`` into the cluster library,
        ``call_failures`` (of which failed), ``call_timeouts`` (abandoned at their
        deadline), ``calls_refused`` (circuit open), ``corrupt_copies`` (failed
        verification) and ``peer_errors`` (reads a peer did not serve). A store that
        keeps none returns an empty dict."""


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do beyond :class:`Tier`; None where it cannot."""

    host: HostAddressable | None = None
    shared: SharedSegment | None = None
    device: DeviceResident | None = None
    device_files: DeviceFileIO | None = None
    remote: RemoteStore | None = None


NO_CAPABILITIES = Capabilities()


# ---------------------------------------------------------------------- the interface

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
            BlockCorrupt: checksum mismatch or truncated data (``out`` may then hold
                garbage, never reported as the block).
            MediaIOError: the medium failed.
        """

    @abc.abstractmethod
    def free(self, key: bytes) -> None:
        """Delete a committed block and return its space. Raises BlockNotStored."""

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
