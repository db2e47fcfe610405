"""What the cluster level asks of this node's store: :class:`LocalStore`.

The cluster level sits below the store core (the store composes it; it never imports
the store). Everything it needs from the node it asks through this one port, which
the store implements (:class:`kvstore.store.cluster_port.ClusterPort`). Tiers are named
by their index in the store's tier list, fastest first; every method raises store
errors (:mod:`kvstore.common.errors`) only. A *held* block is an opaque handle with
``key`` (bytes) and ``size`` (payload bytes) that the port pinned for the caller.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence


class Held(Protocol):
    """A block pinned for the cluster level (it stays until :meth:`LocalStore.unpin`)."""

    key: bytes
    size: int


class LocalStore(Protocol):
    """This node's store, as the cluster level sees it (see the module docstring)."""

    def fastest(self, keys: Sequence[bytes]) -> list[int | None]:
        """The index of the fastest tier holding each of ``keys`` (None: not stored), in
        one look under the catalogue lock."""

    def writing(self, key: bytes) -> bool:
        """Whether a put of ``key`` is in progress (claimed, not yet committed)."""

    def size_of(self, key: bytes) -> int | None:
        """Payload bytes of stored ``key``; None when it is not stored."""

    def begin_put(self, key: bytes, nbytes: int, *, tier: int | None = None) -> Any:
        """Phase one of a put (``.pending``: the open put, None when the block is stored
        already or not admitted). Raises TierFull, TierIOError, WriteConflict, SizeConflict."""

    def commit_put(self, pending: Any, *, in_place: bool = False) -> None:
        """Make the open put visible (``in_place``: its bytes were written into the
        reservation directly). Raises InvalidRequest, TierFull, TierIOError."""

    def abort_put(self, pending: Any) -> None:
        """Drop the open put and its room (safe twice)."""

    def put(self, key: bytes, data: Any) -> bool:
        """Store a whole block; False when it was stored already or not admitted."""

    def promote(self, key: bytes, to: int) -> bool:
        """Copy stored ``key`` up into tier ``to`` and wait; True when it is there."""

    def pin_missing(self, keys: Sequence[bytes], tier: int, skip: Callable[[bytes], bool]) -> list[Held]:
        """Pin the stored blocks of ``keys`` that tier ``tier`` does not hold and for which
        ``skip`` is False."""

    def unpin(self, held: Held) -> None:
        """Drop the pin :meth:`pin_missing` took."""

    def make_room(self, tier: int, nbytes: int) -> None:
        """Evict from tier ``tier`` until ``nbytes`` fit. Raises TierFull, NoVictim, TierIOError."""

    def payload(self, held: Held, prefer: int | None, skip: int) -> Any | None:
        """The bytes of ``held``: a zero-copy view of its copy in tier ``prefer`` when
        there is one, else read from its fastest copy outside tier ``skip``; None when no
        copy can be read."""

    def record_copies(self, held: Sequence[Held], stored: Sequence[bool], tier: int) -> int:
        """Tier ``tier`` now holds the blocks of ``held`` whose ``stored`` is True: record
        each as a copy there (its policy, placement, a ``write_through`` event) unless the
        block was deleted meanwhile, whose copy there is freed. Returns copies recorded."""

    def watch_puts(self, listener: Callable[[bytes], None]) -> Callable[[], None]:
        """Call ``listener(key)`` (catalogue lock held: quick, no calls back) for every
        block a put commits; returns the function that stops it."""


__all__ = ["Held", "LocalStore"]
