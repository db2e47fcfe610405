"""The store's one door to its media: tier calls that raise store errors.

Media report what happened to them in their own terms (:mod:`tiers.errors`); clients see
the store's errors (:mod:`kvstore.common.errors`). This module is the one place where the
first become the second: every part of the store (and the cluster level, which gets
these objects from the store) calls a tier through a :class:`TierAdapter`, and the copy
plans of :mod:`kvstore.store.mover` run through :func:`translating`. Nothing else in
:mod:`kvstore.store` or :mod:`kvstore.cluster` names a media error.

==================  ==================  ==================================================
media error         store error         where it shows
==================  ==================  ==================================================
NoRoom, DiskFull    TierFull            no room in a tier (the store evicts and retries)
InvalidAccess       InvalidRequest      a byte range outside the block, a buffer too small
BlockCorrupt        CorruptBlock        proof that a copy is bad: a failed checksum, a
                                        malformed header, truncated data (it is dropped)
BlockNotStored      BlockNotFound       the tier does not hold (or has not reserved) it
BlockExists         WriteConflict       the tier holds or is writing the key already
MediaIOError, ...   TierIOError         the medium failed for this call (EMFILE, EIO, a
                                        timeout): no proof, the copy is kept; a retry
                                        may succeed
==================  ==================  ==================================================

The message of the store error is the medium's, prefixed with the tier's name where a
client sees it (a put that found no room, a failed write).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from tiers import errors as terr
from tiers.base import ByteRanges, IpcHandle, Tier, TierKind
from tiers.base import check_ranges as _check_ranges

from kvstore.common.errors import (
    BlockNotFound,
    CopyMissing,
    CorruptBlock,
    InvalidRequest,
    KVStoreError,
    TierFull,
    TierIOError,
    WriteConflict,
)

_TABLE: tuple[tuple[type[terr.MediaError], type[KVStoreError]], ...] = (
    (terr.NoRoom, TierFull),                 # first: DiskFull is a NoRoom and a MediaIOError
    (terr.InvalidAccess, InvalidRequest),
    (terr.BlockMissing, CopyMissing),        # before its parent, BlockCorrupt
    (terr.BlockCorrupt, CorruptBlock),
    (terr.BlockNotStored, BlockNotFound),
    (terr.BlockExists, WriteConflict),
    (terr.MediaError, TierIOError),
)


def store_error(e: terr.MediaError, prefix: str = "") -> KVStoreError:
    """The store error for media error ``e`` (the table above), its message ``prefix + str(e)``."""
    for media_cls, store_cls in _TABLE:
        if isinstance(e, media_cls):
            return store_cls(f"{prefix}{e}")
    return TierIOError(f"{prefix}{e}")      # pragma: no cover - every MediaError matches the last row


def translating(copy: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``copy(key)`` raising store errors instead of media errors (the mover's copy plans)."""
    def run(key: bytes) -> None:
        try:
            copy(key)
        except terr.MediaError as e:
            raise store_error(e) from None
    return run


def check_ranges(ranges: ByteRanges | None, size: int) -> int:
    """Total bytes of ``ranges`` (``(offset, length)`` pairs, bytes) inside a ``size``-byte
    block; ``size`` when ``ranges`` is empty. Raises InvalidRequest for a range outside it."""
    try:
        return _check_ranges(ranges, size)
    except terr.InvalidAccess as e:
        raise InvalidRequest(str(e)) from None


class RemoteAdapter:
    """The cluster's batch calls (:class:`tiers.base.RemoteStore`), raising store errors
    (TierIOError for a cluster that fails or is too slow)."""

    __slots__ = ("store",)

    def __init__(self, store):
        self.store = store

    def exists_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        try:
            return self.store.exists_many(keys, deadline_s=deadline_s)
        except terr.MediaError as e:
            raise store_error(e) from None

    def sizes_many(self, keys: Sequence[bytes]) -> list[int | None]:
        try:
            return self.store.sizes_many(keys)
        except terr.MediaError as e:
            raise store_error(e) from None

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        try:
            return self.store.get_many_into(keys, outs)
        except terr.MediaError as e:
            raise store_error(e) from None

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        try:
            return self.store.put_many(items)
        except terr.MediaError as e:
            raise store_error(e) from None

    def call_counters(self) -> dict[str, int]:
        return self.store.call_counters()


class TierAdapter:
    """One tier as the store calls it: the :class:`tiers.base.Tier` verbs, raising store
    errors (see the module docstring). ``tier`` is the medium itself (its capabilities are
    read by the mover's copy plans); ``remote`` its cluster calls when it is the remote tier.
    """

    __slots__ = ("tier", "name", "kind", "volatile", "remote", "fits", "_host", "_shared", "_device")

    def __init__(self, tier: Tier):
        self.tier = tier
        self.name: str = tier.name
        self.kind: TierKind = tier.kind
        self.volatile: bool = tier.volatile
        self.fits: Callable[[int], bool] = tier.fits
        """``fits(nbytes)``: whether ``nbytes`` fit now without evicting."""
        caps = tier.capabilities
        self._host, self._shared, self._device = caps.host, caps.shared, caps.device
        self.remote = RemoteAdapter(caps.remote) if caps.remote is not None else None

    # ------------------------------------------------------------------ what it is

    @property
    def host_addressable(self) -> bool:
        """Its blocks are host memory this process addresses (zero-copy views)."""
        return self._host is not None

    @property
    def shared(self) -> bool:
        """Same-node clients map its memory (the shared host arena)."""
        return self._shared is not None

    @property
    def on_device(self) -> bool:
        """Its blocks are device (HBM) arrays that clients open by CUDA IPC."""
        return self._device is not None

    @property
    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.tier.used_bytes

    @property
    def max_block_bytes(self) -> int:
        return self.tier.max_block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.tier

    def __len__(self) -> int:
        return len(self.tier)

    # ------------------------------------------------------------------ the two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        """Reserve ``nbytes`` for ``key``. Raises TierFull (no room), TierIOError."""
        try:
            self.tier.reserve(key, nbytes)
        except terr.NoRoom as e:
            raise TierFull(f"{self.name}: {e}") from None
        except terr.MediaIOError as e:
            raise TierIOError(f"{self.name}: reserving {nbytes} bytes failed: {e}") from None
        except terr.MediaError as e:
            raise store_error(e) from None

    def write(self, key: bytes, offset: int, data: Any) -> None:
        """Write one in-order chunk at ``offset`` (bytes) of the reservation. Raises
        InvalidRequest (out of order, oversize), TierFull (a full disk), TierIOError."""
        try:
            self.tier.write(key, offset, data)
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        except terr.NoRoom as e:
            raise TierFull(f"{self.name}: {e}") from None
        except terr.MediaError as e:
            raise TierIOError(f"{self.name}: {e}") from None

    def commit(self, key: bytes) -> None:
        """Make the fully written reservation a stored block. Raises TierFull (a full
        disk), TierIOError (any other failure)."""
        try:
            self.tier.commit(key)
        except terr.NoRoom as e:
            raise TierFull(str(e)) from None
        except terr.MediaError as e:
            raise TierIOError(str(e)) from None

    def abort(self, key: bytes) -> None:
        """Drop the reservation of ``key`` (no-op when there is none)."""
        try:
            self.tier.abort(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    # ------------------------------------------------------------------ stored blocks

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Read the block (or ``ranges`` of it) into ``out``; returns bytes read. Raises
        InvalidRequest, CorruptBlock (proof the copy is bad), BlockNotFound, TierIOError
        (the medium failed for this call; also for an OSError a medium let through)."""
        try:
            return self.tier.read_into(key, out, ranges)
        except terr.MediaError as e:
            raise store_error(e) from None
        except OSError as e:                  # never proof against the block
            raise TierIOError(f"{self.name}: reading block {key.hex()[:16]} failed: {e}") from None

    def size_of(self, key: bytes) -> int:
        try:
            return self.tier.size_of(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def free(self, key: bytes) -> None:
        """Free the stored block. Raises BlockNotFound (not stored here), TierIOError."""
        try:
            self.tier.free(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def evict(self, key: bytes) -> None:
        """Free the stored block to make room (:meth:`tiers.base.Tier.evict`). Raises
        BlockNotFound (not stored here), TierIOError."""
        try:
            self.tier.evict(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def forget_evicted(self, key: bytes) -> None:
        """A deleted block: no file an eviction kept of it remains (:meth:`tiers.base.Tier.forget_evicted`)."""
        try:
            self.tier.forget_evicted(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def recover(self) -> Iterable[tuple[bytes, int]]:
        """``(key, payload bytes)`` of the blocks a persistent tier holds at start."""
        try:
            return list(self.tier.recover())
        except terr.MediaError as e:
            raise store_error(e) from None

    def close(self) -> None:
        self.tier.close()

    # ------------------------------------------------------------------ capabilities

    def view(self, key: bytes) -> memoryview:
        """A zero-copy view of the stored block (host-addressable tiers)."""
        try:
            return self._host.view(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def write_view(self, key: bytes) -> memoryview:
        """The writable bytes of ``key``'s reservation (host-addressable tiers)."""
        try:
            return self._host.write_view(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def mark_written(self, key: bytes, nbytes: int) -> None:
        """``nbytes`` of ``key``'s reservation were filled in place (host-addressable tiers)."""
        try:
            self._host.mark_written(key, nbytes)
        except terr.MediaError as e:
            raise store_error(e) from None

    def extent(self, key: bytes) -> tuple[int, int]:
        """``(offset, size)`` in bytes of ``key`` in the shared arena's mapping."""
        try:
            return self._shared.extent(key)
        except terr.MediaError as e:
            raise store_error(e) from None

    def unpublish(self, key: bytes) -> None:
        """Take ``key`` out of the shared arena's block table now (deleted while pinned)."""
        if self._shared is not None:
            self._shared.unpublish(key)

    def retired_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit once the shared arena's space waiting for its table's
        readers is reused (False for other tiers)."""
        return self._shared is not None and self._shared.retired_fit(nbytes)

    def ipc_handle(self, key: bytes) -> IpcHandle:
        """Where a client on the GPU opens ``key`` (CUDA IPC)."""
        try:
            return self._device.ipc_handle(key)
        except terr.MediaError as e:
            raise store_error(e) from None


__all__ = ["RemoteAdapter", "TierAdapter", "check_ranges", "store_error", "translating"]
