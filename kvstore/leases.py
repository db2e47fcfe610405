"""Leases and zero-copy reservations: the same-node data plane of the store.

A **lease** pins blocks (the catalogue's one pin mechanism, with a TTL and an owner) so
that a client on the same node reads them in place: in the shared host arena, or in HBM
through CUDA IPC. A block only in a lower tier is promoted into the arena first. A
**reservation** is a put whose room is in the shared arena: the client writes the bytes
there itself and commits. Both belong to the tenant that made them and end by their TTL
when the client goes away (:meth:`Leases.maintain`), so a killed client costs nothing
but the time until then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tiers import errors as terr
from tiers.base import IpcHandle, TierKind

from .catalogue import Claim, Entry
from .errors import BlockNotFound, InvalidRequest, KVStoreError, SizeConflict, TierFull, TierIOError, WriteConflict
from .types import ReserveStatus
from .writes import check_key

if TYPE_CHECKING:  # pragma: no cover
    from .manager import TierManager

log = logging.getLogger("kvstore.leases")

MAX_LEASE_TTL_S = 600.0
"""Longest lease or reservation a client may ask for (seconds)."""

_NO_ROOM = object()


@dataclass(frozen=True)
class LeasedBlock:
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


@dataclass(frozen=True)
class LeaseGrant:
    """A granted lease: its id, one :class:`LeasedBlock` per key looked at (in order; with
    ``prefix`` the list ends at the first miss, which is included), its TTL, and
    ``resume_at``: the index of the first key not looked at when the grant stopped early
    for lack of room or budget (None: every key was looked at)."""

    lease_id: str
    blocks: tuple[LeasedBlock, ...]
    ttl_s: float
    resume_at: int | None = None





class Leases:
    """Leases and shared-arena reservations of one :class:`~kvstore.manager.TierManager`."""

    def __init__(self, manager: "TierManager"):
        self.manager = manager
        self.catalogue = manager.catalogue
        self.tiers = manager.tiers
        self.counters = manager.counters
        self._placement = manager.placement
        self._shared = manager.shared_tier
        self._device = next((i for i, t in enumerate(self.tiers) if t.capabilities.device is not None), None)

    def lease(self, keys: Sequence[bytes], ttl_s: float, owner: str = "", *, prefix: bool = True,
              device: bool = False, max_bytes: int | None = None) -> LeaseGrant:
        """Pin blocks for a client that reads them in place, for ``ttl_s`` seconds.

        A block in HBM is located by its IPC handle when ``device`` (the client is on the
        GPU), else in the shared host arena; a block only in a lower tier (or only in the
        cluster) is brought into the arena first. With ``prefix`` the grant ends at the
        first miss. The grant also ends early (``LeaseGrant.resume_at``) once
        ``max_bytes`` (default a quarter of the arena) are leased or a promotion finds no
        room: the client releases, then asks for the rest. Raises InvalidRequest (bad key, TTL), KVStoreError when no tier can
        be mapped by clients.
        """
        if not 0.0 < ttl_s <= MAX_LEASE_TTL_S:   # also rejects NaN
            raise InvalidRequest(f"lease ttl must be in (0, {MAX_LEASE_TTL_S}] seconds, got {ttl_s}")
        for k in keys:
            check_key(k)
        if self._shared is None and not (device and self._device is not None):
            raise KVStoreError("no tier can be read in place by clients (no shared host arena or HBM tier)")
        cat = self.catalogue
        self.manager.reads.page_in(keys, prefix=prefix)    # blocks only in the cluster: one batch
        if max_bytes is None:
            max_bytes = self.tiers[self._shared].capacity_bytes // 4 if self._shared is not None else 1 << 62
        blocks: list[LeasedBlock] = []
        held: list[Entry] = []
        leased = 0
        resume_at = None
        try:
            for n, key in enumerate(keys):
                size = self.manager.locate(key)
                if size is not None and held and leased + size[0] > max_bytes:
                    resume_at = n
                    break
                got = self._lease_one(key, device)
                if got is _NO_ROOM:
                    resume_at = n
                    break
                if got is None:
                    blocks.append(LeasedBlock(key, False))
                    self.counters.inc("get_misses")
                    if prefix:
                        break
                    continue
                entry, block = got
                held.append(entry)
                blocks.append(block)
                leased += block.size
            with cat.lock:
                lease = cat.lease(held, ttl_s, owner)
        except BaseException:
            for e in held:
                cat.unpin(e)
            raise
        self.counters.inc("leases_granted")
        self.counters.inc("leased_blocks", len(held))
        return LeaseGrant(lease.lease_id, tuple(blocks), ttl_s, resume_at)

    def _lease_one(self, key: bytes, device: bool):
        """``(entry, LeasedBlock)`` pinned, None (a miss) or ``_NO_ROOM``."""
        cat = self.catalogue
        entry = cat.pin(key)
        if entry is None:
            return None
        try:
            with cat.lock:
                self._placement.touch(entry)
            if device and self._device is not None and self._device in entry.tiers:
                tier = self.tiers[self._device]
                ipc = tier.capabilities.device.ipc_handle(key)
                self._placement.count_read(tier, entry.size)
                return entry, LeasedBlock(key, True, tier.kind, 0, entry.size, ipc)
            s = self._shared
            if s is None:
                raise terr.BlockNotStored("no shared arena")
            if s not in entry.tiers:
                t = self._placement.promote(entry, s, wait=True)
                if t is None:                   # no room without evicting pinned blocks
                    cat.unpin(entry)
                    return _NO_ROOM
                if not t.ok or s not in entry.tiers:
                    raise terr.BlockNotStored("promotion into the shared arena failed")
            tier = self.tiers[s]
            offset, size = tier.capabilities.shared.extent(key)
            self._placement.count_read(tier, size)
            return entry, LeasedBlock(key, True, tier.kind, offset, size)
        except terr.TierError as e:
            log.debug("lease of %s: %s", key.hex()[:16], e)
            cat.unpin(entry)
            return None
        except BaseException:
            cat.unpin(entry)
            raise

    def release(self, lease_id: str, owner: str = "") -> bool:
        """End a lease early. False when unknown, expired or another owner's."""
        return self.catalogue.release(lease_id, owner)

    def maintain(self) -> None:
        """Expire leases and zero-copy reservations whose TTL passed (the daemon's
        background thread calls this; tests may call it directly)."""
        n = self.catalogue.expire()
        if n:
            self.counters.inc("leases_expired", n)
        with self.catalogue.lock:
            stale = self.catalogue.expired_claims(self.catalogue.clock())
        for claim in stale:
            with self.catalogue.lock:
                if self.catalogue.end_claim(claim):
                    if claim.tier >= 0:
                        self.tiers[claim.tier].abort(claim.key)
                    self.counters.inc("reservations_expired")
                    log.info("reservation of block %s expired uncommitted; its room is reclaimed",
                             claim.key.hex()[:16])


    def reserve_shared(self, key: bytes, nbytes: int, owner: str, ttl_s: float) -> tuple[int, ReserveStatus, str]:
        """A zero-copy put's reservation in the shared arena: ``(offset, status, detail)``.

        The client writes ``nbytes`` at ``offset`` of its mapping, then commits
        (:meth:`find_claim` + :meth:`commit_put` with ``in_place``). Refusals are
        statuses, not errors, so one batch can mix them; a key another client is writing
        is BUSY at once (no wait).
        """
        if self._shared is None:
            return 0, ReserveStatus.NO_ROOM, "no shared arena"
        with self.catalogue.lock:
            if self.catalogue.claim(key) is not None:
                return 0, ReserveStatus.BUSY, "another client is writing it"
        try:
            outcome = self.manager.begin_put(key, nbytes, owner=owner, ttl_s=ttl_s, tier=self._shared)
        except SizeConflict as e:
            return 0, ReserveStatus.SIZE_CONFLICT, str(e)
        except (TierFull, TierIOError) as e:
            return 0, ReserveStatus.NO_ROOM, str(e)
        except WriteConflict as e:
            return 0, ReserveStatus.BUSY, str(e)
        if outcome.already_present:
            return 0, ReserveStatus.ALREADY_PRESENT, ""
        if outcome.not_admitted:
            return 0, ReserveStatus.NOT_ADMITTED, ""
        offset, _ = self.tiers[self._shared].capabilities.shared.extent(key)
        return offset, ReserveStatus.RESERVED, ""

    def find_claim(self, key: bytes, owner: str) -> Claim:
        """The open zero-copy reservation of ``key`` made by ``owner``.
        Raises BlockNotFound (none, expired, or another owner's)."""
        with self.catalogue.lock:
            claim = self.catalogue.claim(key)
            if claim is None or claim.owner != owner or claim.deadline is None:
                raise BlockNotFound(f"no open reservation of block {key.hex()[:16]} (expired or never made)")
            return claim

