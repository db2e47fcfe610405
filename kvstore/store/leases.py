"""Leases and zero-copy reservations: the same-node data plane of the store.

A **lease** pins blocks (the catalogue's one pin mechanism, with a TTL and an owner) so
that a client on the same node reads them in place: in the shared host arena, or in HBM
through CUDA IPC. A block only in a lower tier is promoted into the arena first. A
**reservation** is a put whose room is in the shared arena: the client writes the bytes
there itself and commits. Both belong to the tenant that made them and end by their TTL
when the client goes away (:meth:`Leases.maintain`: an expired lease is released, an
expired reservation aborted). Those of a same-node client *session* (the client keeps
its arena hand-out connection open: :mod:`kvstore.service.liveness`) end as soon as that
connection closes (:meth:`Leases.end_session`), so a killed client's hold on the arena
does not outlive it; a lease or reservation naming a session that ended is refused. A
reservation belongs to its session: only that session commits or aborts it, and while
the session is open it is held :data:`~kvstore.store.catalogue.OVERDUE_TTLS` TTLs past its
deadline (a client stalled mid-copy still writes there; a lease's reader checks its own
deadline after copying). A session the daemon closes (a client that broke the protocol)
leaves its leases and reservations to their TTLs, not released at once.

A lease is released here (:meth:`Leases.release`, which ends its pins in
:meth:`kvstore.store.catalogue.Catalogue.release`); a reservation is never released, it
is committed or aborted (:class:`kvstore.store.writes.Writes`).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

from kvstore.common.errors import (
    BlockNotFound,
    FeatureDisabled,
    InvalidRequest,
    KVStoreError,
    SizeConflict,
    TierFull,
    TierIOError,
    WriteConflict,
)
from kvstore.common.arena import ARENA_CHANGED
from kvstore.common.types import KEY_BYTES, ReserveStatus
from kvstore.store.catalogue import Catalogue, Claim, Entry
from kvstore.store.counters import Counters
from kvstore.store.lease_grant import _MISS, LeaseGrant
from kvstore.store.media import TierAdapter
from kvstore.store.moves import Moves
from kvstore.store.placement import Placement
from kvstore.store.transfers import Transfer
from kvstore.store.writes import PutOutcome, check_key

log = logging.getLogger("kvstore.store.leases")

MAX_LEASE_TTL_S = 600.0
"""Longest lease or reservation a client may ask for (seconds)."""

MAX_LEASES = 65536
"""Most leases alive at once; past it a Lease grants nothing (``resume_at`` 0: the client
reads by gRPC instead), counted in ``leases_refused``. Never ends a lease early."""

_NO_ROOM = object()


def _session_ended(session: str) -> FeatureDisabled:
    return FeatureDisabled(f"{ARENA_CHANGED}: client session {session[:8]} is not open (its arena "
                           "connection closed); map the arena again")


class Leases:
    """Leases and shared-arena reservations of the store.

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`).
        catalogue: pins, leases and claims; placement: touches leased blocks.
        moves: promotes a block into the arena before it is leased.
        counters: ``leases_*``, ``leased_*``, ``reservations_expired``.
        shared_tier: index of the tier same-node clients map (the host arena), or None.
        begin_put: phase one of a put (:meth:`kvstore.store.writes.Writes.begin_put`).
        page_in: pages blocks held only in the cluster into the arena
            (:meth:`kvstore.store.reads.Reads.page_in`).
    """

    def __init__(self, tiers: Sequence[TierAdapter], catalogue: Catalogue, placement: Placement, moves: Moves,
                 counters: Counters, shared_tier: int | None, begin_put: Callable[..., PutOutcome],
                 page_in: Callable[..., object] = lambda keys, prefix=False: set()):
        self.catalogue = catalogue
        self.tiers = list(tiers)
        self.counters = counters
        self._placement = placement
        self._moves = moves
        self._shared = shared_tier
        self._begin_put = begin_put
        self._page_in = page_in
        # Local tiers a put may land in when the arena's own tier does not admit a block.
        self._below_shared = any(i != shared_tier and t.remote is None for i, t in enumerate(self.tiers))
        self._device = next((i for i, t in enumerate(self.tiers) if t.on_device), None)

    def lease(self, keys: Sequence[bytes], ttl_s: float, owner: str = "", *, prefix: bool = True,
              device: bool = False, max_bytes: int | None = None, session: str = "",
              defer: list | None = None) -> LeaseGrant:
        """Pin blocks for a client that reads them in place, for ``ttl_s`` seconds.

        A block in HBM is located by its IPC handle when ``device`` (the client is on the
        GPU), else in the shared host arena; a block only in a lower tier (or only in the
        cluster) is brought into the arena first. With ``prefix`` the grant ends at the
        first miss. The grant also ends early (``LeaseGrant.resume_at``) once
        ``max_bytes`` (default a quarter of the arena) are leased or a promotion finds no
        room: the client releases, then asks for the rest. The blocks it promotes are read
        together, and a grant that ends on ``max_bytes`` has the blocks of the next one
        read while the client copies (:meth:`_read_ahead`). A grant that holds no block creates
        no lease (``lease_id`` empty); with :data:`MAX_LEASES` alive it grants nothing
        (``resume_at`` 0). ``session``: the client's open session (:meth:`end_session`
        ends the lease with it; "": the TTL only). ``defer``: a list to which the
        bookkeeping the grant does not need (the policies' touches of blocks that were in place
        already, the counters) is appended as one callable, for a caller that answers its
        client first (the blocks are pinned, so nothing evicts them meanwhile); None: done
        before returning. Raises InvalidRequest (bad key, TTL), FeatureDisabled when no tier
        can be mapped by clients or ``session`` is not open.
        """
        if not 0.0 < ttl_s <= MAX_LEASE_TTL_S:   # also rejects NaN
            raise InvalidRequest(f"lease ttl must be in (0, {MAX_LEASE_TTL_S}] seconds, got {ttl_s}")
        if keys and set(map(len, keys)) != {KEY_BYTES}:     # one C-level pass; the loop names the culprit
            for k in keys:
                check_key(k)
        if self._shared is None and not (device and self._device is not None):
            raise FeatureDisabled("no tier can be read in place by clients (no shared host arena or HBM tier)")
        cat = self.catalogue
        if cat.num_leases >= MAX_LEASES:
            self.counters.inc("leases_refused")
            return LeaseGrant("", (), ttl_s, resume_at=0)
        self._page_in(keys, prefix=prefix)    # blocks only in the cluster: one batch
        if max_bytes is None:
            max_bytes = self.tiers[self._shared].capacity_bytes // 4 if self._shared is not None else 1 << 62
        blocks: list[tuple] = []       # LeasedBlock rows
        held: list[Entry] = []
        state = {"leased": 0, "resume_at": None, "touch": []}
        ahead: list[tuple[Entry, Transfer | None]] | None = None   # paged back together, pinned
        moving: dict[bytes, Transfer | None] = {}
        try:
            n = 0
            while n < len(keys):
                n = self._grant_run(keys, n, device, prefix, max_bytes, blocks, held, state)
                if n >= len(keys) or state["resume_at"] is not None or (prefix and blocks and not blocks[-1][1]):
                    break
                if ahead is None and self._shared is not None:
                    ahead = self._read_ahead(keys[n:], max_bytes - state["leased"], max_bytes)
                    moving = {e.key: t for e, t in ahead}
                t = moving.get(keys[n])
                if t is not None and t.done.is_set() and not t.ok:
                    got = None                    # its read failed in this call already: a miss, not a retry
                else:
                    got = self._lease_promoted(keys[n], state, max_bytes, bool(held))   # a promotion first
                if got is _NO_ROOM:
                    state["resume_at"] = n
                    break
                if got is None:
                    blocks.append((keys[n], *_MISS))
                    self.counters.inc("get_misses")
                    if prefix:
                        break
                else:
                    held.append(got[0])
                    blocks.append(got[1])
                    state["leased"] += got[1][4]
                n += 1
            if ahead is None and state.get("full") and self._shared is not None:
                # the grant is full: the next one's blocks are read while the client copies
                ahead = self._read_ahead(keys[state["resume_at"]:], 0, max_bytes)
            if not held:                 # misses only (or no room yet): nothing to hold
                return LeaseGrant("", tuple(blocks), ttl_s, state["resume_at"])
            with cat.lock:
                if session and not cat.session_open(session):
                    raise _session_ended(session)
                lease = cat.lease(held, ttl_s, owner, session)
        except BaseException:
            for e in held:
                cat.unpin(e)
            raise
        finally:
            for e, _ in ahead or ():
                cat.unpin(e)
        account = functools.partial(self._account, state["touch"], len(held), state["leased"])
        if defer is None:
            account()
        else:
            defer.append(account)
        return LeaseGrant(lease.lease_id, tuple(blocks), ttl_s, state["resume_at"])

    def note_table_reads(self, keys: Sequence[bytes]) -> None:
        """A same-node client read ``keys`` from the shared block table (no lease): the
        policies see a hit on each block still stored, counted in ``table_read_blocks``."""
        cat = self.catalogue
        with cat.lock:
            entries = [e for e in map(cat.get, keys) if e is not None]
            if entries:
                self._placement.touch_all(entries)
        self.counters.inc("table_read_blocks", len(entries))

    def _account(self, touch: list[Entry], n_held: int, nbytes: int) -> None:
        """A grant's bookkeeping: the policies see a hit on each block leased in place (its
        current tiers: one that left meanwhile is not touched), and the counters."""
        if touch:
            with self.catalogue.lock:
                self._placement.touch_all(touch)
        self.counters.inc("leases_granted")
        self.counters.inc("leased_blocks", n_held)
        self.counters.inc("leased_bytes", nbytes)

    def _read_ahead(self, keys: Sequence[bytes], left: int, max_bytes: int) -> list[tuple[Entry, Transfer | None]]:
        """Start the promotions of ``keys`` this grant still needs (``left`` bytes) and of
        one more grant, together: a quarter of the arena at most ahead, half of it in all
        (:meth:`kvstore.store.moves.Moves.promote_ahead`). Returns their entries, pinned
        so that the promotions of this call do not evict each other (the caller unpins),
        with their transfers."""
        cap = self.tiers[self._shared].capacity_bytes
        budget = min(max(0, left) + min(max_bytes, cap // 4), cap // 2)
        return self._moves.promote_ahead(keys, self._shared, budget)

    def _grant_run(self, keys, n, device, prefix, max_bytes, blocks, held, state) -> int:
        """Grant keys from index ``n`` on while they are already where the client reads them
        (one catalogue lock for the run; their touches are left in ``state["touch"]``);
        returns the index of the first key that needs a promotion (or ``len(keys)``, or
        where the grant stopped)."""
        cat = self.catalogue
        shared, dev = self._shared, self._device if device else None
        extent = self.tiers[shared].extent if shared is not None else None
        kind = self.tiers[shared].kind if shared is not None else None
        touch, add_block, hold, get = state["touch"].append, blocks.append, held.append, cat.get
        leased, end = state["leased"], len(keys)
        try:
            with cat.lock:
                while n < end:
                    key = keys[n]
                    e = get(key)
                    if e is None:
                        add_block((key, *_MISS))
                        self.counters.inc("get_misses")
                        n += 1
                        if prefix:
                            return n
                        continue
                    if held and leased + e.size > max_bytes:
                        state["resume_at"], state["full"] = n, True
                        return n
                    if dev is not None and dev in e.tiers:
                        tier = self.tiers[dev]
                        block = (key, True, tier.kind, 0, e.size, tier.ipc_handle(key))
                    elif shared in e.tiers:
                        offset, size = extent(key)
                        block = (key, True, kind, offset, size, None)
                    else:
                        return n
                    e.pins += 1
                    touch(e)
                    hold(e)
                    add_block(block)
                    leased += e.size
                    n += 1
            return n
        finally:
            state["leased"] = leased

    def _lease_promoted(self, key: bytes, state: dict, max_bytes: int, holding: bool):
        """Promote ``key`` into the shared arena and pin it: ``(entry, LeasedBlock row)``, None
        (a miss) or ``_NO_ROOM`` (no room without evicting pinned blocks, or over budget)."""
        cat = self.catalogue
        entry = cat.pin(key)
        if entry is None:
            return None
        try:
            if holding and state["leased"] + entry.size > max_bytes:
                cat.unpin(entry)
                state["full"] = True
                return _NO_ROOM
            s = self._shared
            if s is None:
                raise BlockNotFound("no shared arena")
            with cat.lock:
                self._placement.touch(entry)
            t = self._moves.promote(entry, s, wait=True)
            if t is None:                   # no room without evicting pinned blocks
                cat.unpin(entry)
                return _NO_ROOM
            if not t.ok or s not in entry.tiers:
                raise BlockNotFound("promotion into the shared arena failed")
            offset, size = self.tiers[s].extent(key)
            return entry, (key, True, self.tiers[s].kind, offset, size, None)
        except KVStoreError as e:            # a miss: the block is not where the client reads
            log.debug("lease of %s: %s", key.hex()[:16], e)
            cat.unpin(entry)
            return None
        except BaseException:
            cat.unpin(entry)
            raise

    def release(self, lease_id: str, owner: str = "") -> bool:
        """Release lease ``lease_id`` of ``owner`` early: its blocks are unpinned. False
        when unknown, expired or another owner's."""
        return self.catalogue.release(lease_id, owner)

    def maintain(self) -> None:
        """Release leases and abort zero-copy reservations whose TTL passed (the daemon's
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
                    log.info("reservation of block %s expired uncommitted%s; its room is reclaimed",
                             claim.key.hex()[:16], " (its client still connected)" if claim.session else "")


    def open_session(self, session: str) -> None:
        """Accept leases and reservations naming same-node client ``session``."""
        self.catalogue.open_session(session)

    def end_session(self, session: str, client_gone: bool = True) -> tuple[int, int]:
        """``session`` ended. Its client is gone: release its leases and abort its
        reservations now. The daemon closed it (``client_gone`` False: a client that broke
        the protocol, perhaps still copying): they keep their TTLs. Returns ``(leases
        released, reservations aborted)``."""
        cat = self.catalogue
        aborted = 0
        with cat.lock:
            released, claims = cat.end_session(session, client_gone)
            for claim in claims:
                if cat.end_claim(claim):
                    if claim.tier >= 0:
                        self.tiers[claim.tier].abort(claim.key)
                    aborted += 1
        self.counters.inc("leases_reclaimed", released)
        self.counters.inc("reservations_reclaimed", aborted)
        if released or aborted:
            log.info("client session %s ended: released %d leases and aborted %d reservations",
                     session[:8], released, aborted)
        return released, aborted

    def reserve_shared(self, key: bytes, nbytes: int, owner: str, ttl_s: float,
                       meta=None, session: str = "") -> tuple[int, ReserveStatus, str]:
        """A zero-copy put's reservation in the shared arena: ``(offset, status, detail)``.

        The client writes ``nbytes`` at ``offset`` of its mapping, then commits
        (:meth:`find_claim` + :meth:`commit_put` with ``in_place``). Refusals are
        statuses, not errors, so one batch can mix them; a key another client is writing
        is BUSY at once (no wait). ``session``: as for :meth:`lease` (FeatureDisabled when
        it is not open).
        """
        if self._shared is None:
            return 0, ReserveStatus.NO_ROOM, "no shared arena"
        with self.catalogue.lock:
            if self.catalogue.claim(key) is not None:
                return 0, ReserveStatus.BUSY, "another client is writing it"
        try:
            outcome = self._begin_put(key, nbytes, owner=owner, ttl_s=ttl_s, tier=self._shared, meta=meta,
                                      wait_s=0.0,     # a block a reader still holds: BUSY at once too
                                      last_try=not self._below_shared)
        except SizeConflict as e:
            return 0, ReserveStatus.SIZE_CONFLICT, str(e)
        except (TierFull, TierIOError) as e:
            return 0, ReserveStatus.NO_ROOM, str(e)
        except WriteConflict as e:
            return 0, ReserveStatus.BUSY, str(e)
        if outcome.already_present:
            return 0, ReserveStatus.ALREADY_PRESENT, ""
        if outcome.not_admitted:
            if self._below_shared:      # a put into every tier decides (the client's gRPC put)
                return 0, ReserveStatus.NO_ROOM, f"the {self.tiers[self._shared].name} tier does not admit it"
            return 0, ReserveStatus.NOT_ADMITTED, ""
        if session:
            with self.catalogue.lock:
                if not self.catalogue.session_open(session):    # it ended while room was made
                    if self.catalogue.end_claim(outcome.pending) and outcome.pending.tier >= 0:
                        self.tiers[outcome.pending.tier].abort(key)
                    raise _session_ended(session)
                outcome.pending.session = session
        offset, _ = self.tiers[self._shared].extent(key)
        return offset, ReserveStatus.RESERVED, ""

    def find_claim(self, key: bytes, owner: str, session: str = "") -> Claim:
        """The open zero-copy reservation of ``key`` made by ``owner`` in same-node client
        ``session`` ("": one made with no session): a client commits or aborts only its own.
        Raises BlockNotFound (none, expired, or another owner's or session's)."""
        with self.catalogue.lock:
            claim = self.catalogue.claim(key)
            if claim is None or claim.owner != owner or claim.deadline is None or claim.session != session:
                raise BlockNotFound(f"no open reservation of block {key.hex()[:16]} by this client "
                                    f"(expired, never made, or another client's)")
            return claim

