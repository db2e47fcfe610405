"""What a lease grants: one row per block looked at, and the grant that holds them
(:class:`kvstore.store.leases.Leases` makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tiers.base import IpcHandle, TierKind


class LeasedBlock(NamedTuple):
    """Where one leased block is (``found`` False: a miss; nothing else is set).

    ``tier`` is the tier the client reads from; ``offset``/``size`` are bytes in the
    shared host arena, or ``ipc`` locates it in HBM (CUDA IPC).
    """

    key: bytes
    found: bool
    tier: TierKind | None = None
    offset: int = 0
    size: int = 0
    ipc: IpcHandle | None = None


_MISS = (False, None, 0, 0, None)


@dataclass(frozen=True)
class LeaseGrant:
    """A granted lease: its id, one :class:`LeasedBlock` per key looked at (:attr:`blocks`,
    in order; with ``prefix`` the list ends at the first miss, which is included), its TTL,
    and ``resume_at``: the index of the first key not looked at when the grant stopped early
    for lack of room or budget (None: every key was looked at). ``rows`` holds the same as
    plain tuples in :class:`LeasedBlock`'s field order (what a grant of many blocks is made
    of: a plain tuple costs a twentieth of a named one)."""

    lease_id: str
    rows: tuple[tuple, ...]
    ttl_s: float
    resume_at: int | None = None

    @property
    def blocks(self) -> tuple[LeasedBlock, ...]:
        make = LeasedBlock._make
        return tuple(make(r) for r in self.rows)
