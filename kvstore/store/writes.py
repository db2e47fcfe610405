"""Puts: the two-phase write protocol of the store (claim, reserve, write, commit).

A put claims its key in the catalogue before room is made (a second put of the same key
waits for the first instead of reserving), reserves room in the fastest tier whose
admission policy takes the block (:meth:`kvstore.store.room.Room.reserve_locked`
evicts or demotes as needed), copies the bytes in without the lock, and commits: the
block becomes visible. With ``write_through`` the commit returns only once every lower
local tier holds a copy, and a put call (:class:`PutBatch`) ends once the cluster holds
its blocks too. The first writer of a key wins (:class:`~kvstore.common.errors.SizeConflict`
for another size). Zero-copy reservations (the shared arena) carry an owner and a
deadline; :meth:`kvstore.store.leases.Leases.maintain` aborts expired ones.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvstore.common.errors import (
    BlockNotFound,
    InvalidRequest,
    SizeConflict,
    TierFull,
    TierIOError,
    WriteConflict,
)
from kvstore.common.types import KEY_BYTES
from kvstore.policy import EvictionPolicy, NoVictim
from kvstore.store.catalogue import Catalogue, Claim
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter
from kvstore.store.moves import Moves
from kvstore.store.placement import Placement
from kvstore.store.room import Room

log = logging.getLogger("kvstore.store.writes")

WRITE_BACK = "write_back"
WRITE_THROUGH = "write_through"

MAX_SIZE_CONFLICTS_LOGGED = 4096
"""Keys remembered so that each size conflict is logged once (oldest forgotten first)."""


@dataclass
class PutOutcome:
    """What :meth:`Writes.begin_put` decided: the block is stored already, no tier's
    admission policy wants it (``not_admitted``: a normal outcome, nothing stored), or
    room was reserved (``pending``, a :class:`~kvstore.store.catalogue.Claim`)."""

    key: bytes
    already_present: bool
    pending: Claim | None = None
    not_admitted: bool = False


class _NotAdmitted(Exception):
    """No tier's admission policy accepted the block (internal)."""


def check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise InvalidRequest(f"block keys are {KEY_BYTES} bytes, got {len(key)}")


class Writes:
    """The put protocol of the store.

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`); policies: one per tier.
        catalogue: claims and entries; placement: records the committed copy.
        room: makes room for a reservation; moves: the write-through copies.
        counters: ``puts_*``, ``blocks_put``; clock: the policies' time (seconds).
        write_policy: :data:`WRITE_BACK` or :data:`WRITE_THROUGH`.
        writer_wait_s: how long a put of a key another client is writing waits (seconds).

    Attributes:
        put_failure: ``(monotonic time, why)`` of the last put that found no room or
            whose medium failed, cleared by the next successful commit (health). A block
            too large for every tier is refused without it (:meth:`_reserve_somewhere`).
        on_refused: called with the key of a put no tier admitted (explain-miss), or None.
    Raises ValueError for an unknown ``write_policy``.
    """

    def __init__(self, tiers: Sequence[TierAdapter], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 placement: Placement, room: Room, moves: Moves, counters: Counters, clock: Callable[[], float],
                 write_policy: str, writer_wait_s: float):
        if write_policy not in (WRITE_BACK, WRITE_THROUGH):
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.catalogue = catalogue
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.counters = counters
        self.clock = clock
        self._placement = placement
        self._room = room
        self._moves = moves
        self.write_policy = write_policy
        self.writer_wait_s = writer_wait_s
        self.put_failure: tuple[float, str] | None = None
        self.on_refused: Callable[[bytes], None] | None = None
        self._size_conflicts_logged: OrderedDict[bytes, None] = OrderedDict()

    def begin_put(self, key: bytes, nbytes: int, *, owner: str = "", ttl_s: float | None = None,
                  tier: int | None = None, meta=None, wait_s: float | None = None,
                  last_try: bool = True) -> PutOutcome:
        """Phase one of a put: claim ``key`` and reserve room for ``nbytes`` bytes.

        Args:
            key: 32-byte block key; nbytes: payload bytes (> 0).
            owner: the tenant allowed to finish the put.
            ttl_s: a zero-copy reservation's lifetime (the client writes into the shared
                arena); it is reclaimed after this many seconds if not committed.
            tier: reserve in this tier only (the shared arena for zero-copy puts).
            meta: what routers index the block by (:class:`kvstore.common.types.BlockMeta`),
                published with its KV events.
            wait_s: the longest wait for another writer (seconds; None: ``writer_wait_s``,
                never more): a call's deadline, so that WriteConflict, not the deadline, ends it.
            last_try: False when a refusal by ``tier``'s admission policy is not the put's
                end (a zero-copy reservation that falls back to a put into every tier): it is
                then neither counted in ``puts_not_admitted`` nor reported to ``on_refused``.
        Returns already_present (and touches the block) when it is stored with the same
        size; waits for another client's in-flight write of the same key.
        Raises:
            InvalidRequest: bad key length or size.
            SizeConflict: the key is stored with another size (first writer wins).
            TierFull: no tier has or can make room, or the block is larger than the
                largest block any tier can hold.
            WriteConflict: another client's write of the key did not finish in time.
        """
        check_key(key)
        if nbytes <= 0:
            raise InvalidRequest(f"block size must be > 0 bytes, got {nbytes}")
        cat = self.catalogue
        deadline = time.monotonic() + (self.writer_wait_s if wait_s is None else min(wait_s, self.writer_wait_s))
        with cat.lock:
            while True:
                e = cat.get(key)
                if e is not None:
                    if e.size != nbytes:
                        self._size_conflict(key, e.size, nbytes)
                    self._placement.touch(e)
                    self.counters.inc("puts_already_present")
                    return PutOutcome(key, already_present=True)
                if cat.claim(key) is None and cat.raw(key) is None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WriteConflict(f"block {key.hex()[:16]} is still being written or read by another client")
                cat.changed.wait(remaining)
            # Claim the key before making room: making room may drop the lock while it
            # waits on a demotion, and a second put of the same key must wait, not reserve.
            claim = Claim(key, nbytes, owner=owner, deadline=None if ttl_s is None else cat.clock() + ttl_s,
                          meta=meta, ttl_s=ttl_s or 0.0)
            cat.add_claim(claim)
            try:
                claim.tier = self._reserve_somewhere(key, nbytes, tier)
            except _NotAdmitted:
                cat.end_claim(claim)
                if last_try:
                    self.note_refused(key)
                return PutOutcome(key, already_present=False, not_admitted=True)
            except BaseException:
                cat.end_claim(claim)
                raise
            if cat.claim(key) is not claim:
                # A zero-copy reservation whose TTL passed while room was made (the lock is
                # dropped while a demotion runs): its expiry found nothing reserved to free,
                # so the room reserved since is this call's to give back.
                self.tiers[claim.tier].abort(key)
                raise TierFull(f"the reservation of block {key.hex()[:16]} expired (its TTL of {ttl_s} s "
                               "passed) while room was made for it")
            return PutOutcome(key, already_present=False, pending=claim)

    def note_refused(self, key: bytes) -> None:
        """No tier's admission policy took ``key``: count it, and tell :attr:`on_refused`."""
        self.counters.inc("puts_not_admitted")
        if self.on_refused is not None:
            self.on_refused(key)

    def _size_conflict(self, key: bytes, stored: int, asked: int) -> None:
        self.counters.inc("puts_size_conflict")
        if key not in self._size_conflicts_logged:
            self._size_conflicts_logged[key] = None
            if len(self._size_conflicts_logged) > MAX_SIZE_CONFLICTS_LOGGED:
                self._size_conflicts_logged.popitem(last=False)
            log.warning("put of block %s with %d bytes refused: it is stored with %d bytes (first writer wins)",
                        key.hex()[:16], asked, stored)
        raise SizeConflict(f"block {key.hex()[:16]} is stored with {stored} bytes; a put of {asked} bytes "
                           "under the same key is refused (first writer wins)")

    def _reserve_somewhere(self, key: bytes, nbytes: int, only: int | None) -> int:
        """Reserve ``nbytes`` in the fastest tier that admits the block (lock held).

        A failure that says something about the tiers (a medium failing, no room even
        after evicting: pinned or leased blocks fill them) marks :attr:`put_failure`
        (health). A block larger than the largest block any admitting tier can hold says
        nothing about them: only that put is refused (TierFull naming the size and each
        tier's largest block, counted in ``puts_too_large``). A put limited to ``only``
        one tier (a zero-copy reservation, which falls back to a normal put) never marks it."""
        errors: list[str] = []
        tried: list[TierAdapter] = []
        now = self.clock()
        admitted = False
        for i, tier in enumerate(self.tiers):
            if only is not None and i != only:
                continue
            if tier.remote is not None:
                continue    # the cluster gets blocks by demotion or publishing, never a put's first copy
            if not self.policies[i].admit(key, nbytes, now):
                continue
            admitted = True
            try:
                self._room.reserve_locked(i, key, nbytes, incoming=key)
                return i
            except TierIOError as err:
                if only is None:
                    self.put_failure = (time.monotonic(), f"{tier.name}: {err}")
                raise
            except (TierFull, NoVictim) as err:
                errors.append(f"{tier.name}: {err}")
                tried.append(tier)
        if not admitted:
            raise _NotAdmitted()
        largest = [(t.name, t.max_block_bytes) for t in tried]
        if all(nbytes > most for _, most in largest):
            if only is None:
                self.counters.inc("puts_too_large")
            raise TierFull(f"a {nbytes}-byte block is larger than the largest block a tier can hold ("
                           + ", ".join(f"{name}: {most} bytes" for name, most in largest) + ")")
        if only is None:
            self.counters.inc("puts_rejected_full")
        message = f"no tier can hold a {nbytes}-byte block: " + "; ".join(errors[-3:])
        if only is None:
            self.put_failure = (time.monotonic(), message)
        raise TierFull(message)

    def write_chunk(self, pending: Claim, offset: int, data: Any) -> None:
        """Copy one chunk of an open put (in order). Runs without the lock.

        Raises InvalidRequest for an out-of-order or oversize chunk, TierIOError (and
        TierFull for a full disk) when the medium fails.
        """
        n = memoryview(data).nbytes
        self.tiers[pending.tier].write(pending.key, offset, data)     # TierFull: a full disk (DiskFull)
        pending.written = offset + n

    def commit_put(self, pending: Claim, *, in_place: bool = False) -> None:
        """Phase two: make a fully written block visible (and write it through).

        ``in_place``: the client filled the reservation through the shared arena; its
        bytes are taken as written. Raises InvalidRequest when fewer bytes than declared
        were written (the put is aborted), TierIOError when the medium fails (aborted too).
        """
        tier = self.tiers[pending.tier]
        if in_place:
            if not tier.host_addressable:
                self.abort_put(pending)
                raise InvalidRequest(f"{tier.name} cannot be written in place")
            tier.mark_written(pending.key, pending.size)
            pending.written = pending.size
        if pending.written != pending.size:
            self.abort_put(pending)
            raise InvalidRequest(f"block {pending.key.hex()[:16]}: {pending.written} of {pending.size} "
                                 "declared bytes received")
        cat = self.catalogue
        with cat.lock:
            if cat.claim(pending.key) is not pending:
                raise BlockNotFound(f"the put of block {pending.key.hex()[:16]} expired or was aborted")
            try:
                tier.commit(pending.key)
            except BaseException as e:
                tier.abort(pending.key)
                cat.end_claim(pending)
                if isinstance(e, (TierFull, TierIOError)):     # the medium: full (a full disk), or failed
                    raise type(e)(f"{tier.name}: committing block {pending.key.hex()[:16]} failed: {e}") from None
                raise
            cat.end_claim(pending)
            self.put_failure = None
            entry = self._placement.new_entry(pending.key, pending.size, pending.tier, "put", pending.meta)
            self.policies[pending.tier].insert(pending.key, pending.size, self.clock())
            self.counters.inc("blocks_put")
            self.counters.inc("bytes_put", pending.size)
            self._room.kick_if_full(pending.tier, pending.size)
            if self.write_policy == WRITE_THROUGH:
                for j in range(pending.tier + 1, len(self.tiers)):
                    if self.tiers[j].remote is not None:
                        continue    # the cluster: batched at the end of the put call (PutBatch.end)
                    try:    # acknowledged only once every lower copy exists (crash-safe)
                        self._moves.copy_locked(entry, pending.tier, j, "write_through")
                        self.counters.inc("write_through_copies")
                    except (TierFull, NoVictim, TierIOError) as e:
                        log.warning("write-through of %s to %s failed: %s",
                                    pending.key.hex()[:16], self.tiers[j].name, e)
                        self.counters.inc("write_through_failed")

    def abort_put(self, pending: Claim) -> None:
        """Drop an open put and its reserved room. Safe to call twice."""
        with self.catalogue.lock:
            if self.catalogue.end_claim(pending):
                if pending.tier >= 0:
                    self.tiers[pending.tier].abort(pending.key)
                self.counters.inc("puts_aborted")

    def put(self, key: bytes, data: Any) -> bool:
        """Store a whole block in one call (no cluster write-through: :class:`PutBatch`).
        Returns False when it was already stored or no tier admitted it. Raises as
        :meth:`begin_put` and :meth:`write_chunk`."""
        outcome = self.begin_put(key, memoryview(data).nbytes)
        if outcome.already_present or outcome.not_admitted:
            return False
        assert outcome.pending is not None
        try:
            self.write_chunk(outcome.pending, 0, data)
        except BaseException:
            self.abort_put(outcome.pending)
            raise
        self.commit_put(outcome.pending)
        return True


class PutBatch:
    """The puts of one call (a Put stream, a Commit of zero-copy reservations).

    Each block is committed as it completes (:meth:`commit`); :meth:`end` ends the call:
    with write-through to a cluster it returns once the cluster holds every block the
    call committed (one batched copy, :meth:`kvstore.cluster.cluster.Cluster.put_done`).

    Args:
        writes: the put protocol; cluster: the cluster level, or None.
    """

    def __init__(self, writes: Writes, cluster=None):
        self._writes = writes
        self._cluster = cluster
        self.keys: list[bytes] = []
        """Store keys committed by this call, in order."""

    def commit(self, pending: Claim, *, in_place: bool = False) -> None:
        """:meth:`Writes.commit_put` ``pending`` and remember it. Raises as that does."""
        self._writes.commit_put(pending, in_place=in_place)
        self.keys.append(pending.key)

    def end(self) -> None:
        """The call ends: write the committed blocks through to the cluster (when the
        write policy says so; bounded by the cluster tier's deadlines, never raises for
        a cluster failure)."""
        if self._cluster is not None:
            self._cluster.put_done(self.keys)
