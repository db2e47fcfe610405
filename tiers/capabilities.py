"""What a medium can do beyond :class:`tiers.base.Tier`, declared and typed.

A tier declares its extra abilities in :attr:`tiers.base.Tier.capabilities`: a
:class:`Capabilities` record of :class:`typing.Protocol` implementations (usually the
tier itself), so the store core dispatches on declared capabilities, never by probing
attributes:

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

The records a capability hands out (:class:`SegmentInfo`, :class:`IpcHandle`) live here
too. Errors named in the docstrings are those of :mod:`tiers.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

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

    def unpublish(self, key: bytes) -> None:
        """Stop offering ``key`` to clients that read the segment's block table, while it
        stays stored (deleted while pinned). No-op when the segment keeps no table."""

    def retired_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit once the freed space that waits for clients still
        reading is reused (within a bounded time; False without a block table)."""


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
    """What a tier can do beyond :class:`tiers.base.Tier`; None where it cannot."""

    host: HostAddressable | None = None
    shared: SharedSegment | None = None
    device: DeviceResident | None = None
    device_files: DeviceFileIO | None = None
    remote: RemoteStore | None = None


NO_CAPABILITIES = Capabilities()


__all__ = ["Capabilities", "DeviceFileIO", "DeviceResident", "HostAddressable", "IpcHandle", "NO_CAPABILITIES",
           "RemoteStore", "SegmentInfo", "SharedSegment"]
