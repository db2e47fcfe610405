"""The tier manager: the store core's public face. It declares the core's verbs (put,
read, lookup, lease, promote, delete, ...), each a method with its contract that
delegates to the part doing the work, in the shape of vLLM's ``OffloadingManager``.

Tiers are ordered fastest first (HBM, host, NVMe; a remote tier last). The parts, each
given what it needs when it is made (none holds the manager): ``catalogue`` (entries,
claims, pins, leases, events; one lock), ``placement`` (the per-tier bookkeeping of
copies), ``room`` (which blocks leave a tier: the one caller of ``policy.victim``),
``transfers`` (two-phase copies in flight; ``mover`` moves the bytes), ``moves``
(promotion up, write-through and persist down), ``writes`` (the put protocol),
``reads``, ``leases`` (the same-node path), and ``cluster`` (:mod:`kvstore.cluster`,
with a remote tier). Media are called only through
:class:`kvstore.store.media.TierAdapter`, where media errors (:mod:`tiers.errors`)
become store errors (:mod:`kvstore.common.errors`), and through their declared
capabilities, so the same code runs the daemon and ``kvstore simulate`` (byte-less
tiers, virtual time). A block's way is drawn in ``docs/architecture.md``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from tiers.base import ByteRanges, Tier, TierKind

from kvstore.cluster.cluster import Cluster, ClusterOptions
from kvstore.common.types import GetResult, LookupResult, ReserveStatus
from kvstore.policy import AcceptsNextUse, EvictionPolicy, PredictsDistance, UsesReuseModel
from kvstore.store.catalogue import Catalogue, Claim, Entry
from kvstore.store.cleaner import Cleaner, CleanerSignal
from kvstore.store.cluster_port import ClusterPort
from kvstore.store.counters import Counters
from kvstore.store.lease_grant import LeasedBlock, LeaseGrant
from kvstore.store.leases import MAX_LEASE_TTL_S, MAX_LEASES, Leases
from kvstore.store.media import TierAdapter
from kvstore.store.mover import Mover
from kvstore.store.moves import Moves
from kvstore.store.placement import Placement
from kvstore.store.reads import BlockReader, Reads
from kvstore.store.room import Room
from kvstore.store.transfers import Transfers
from kvstore.store.writes import (
    MAX_SIZE_CONFLICTS_LOGGED,
    WRITE_BACK,
    WRITE_THROUGH,
    PutBatch,
    PutOutcome,
    Writes,
)


@dataclass
class TierUsage:
    kind: TierKind
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    policy: str


class TierManager:
    """Places blocks across ``tiers`` (fastest first) under per-tier eviction policies.

    Args:
        tiers: the media, fastest first. Each must be empty or hold recovered blocks.
        policies: one eviction policy per tier, same order.
        write_policy: ``"write_back"`` (lower tiers get a copy on demotion) or
            ``"write_through"`` (every committed block is copied to all lower tiers).
        clock: time source in seconds for the policies (virtual in the simulator).
        promote_on_get: copy blocks read from a lower tier into the first tier.
        writer_wait_s: how long a put of a key another client is writing waits (seconds).
        async_moves: the daemon: tier-to-tier copies on background queues with the lock
            dropped, and a background thread keeping the watermarks, releasing expired
            leases and aborting expired reservations. False (the simulator): copies
            inline, deterministic.
        transfer_timeout_s: a copy waited on longer than this is abandoned (seconds).
        watermarks: ``(low, high)`` fractions of capacity for background cleaning.
        cluster: how to use a remote tier (the last tier), when there is one.
    Raises ValueError for inconsistent arguments; store errors when a tier's recovery fails.
    """

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy],
                 write_policy: str = WRITE_BACK, clock: Callable[[], float] = time.monotonic,
                 promote_on_get: bool = True, writer_wait_s: float = 30.0,
                 async_moves: bool = False, transfer_timeout_s: float = 30.0,
                 watermarks: tuple[float, float] = (0.85, 0.95), cluster: ClusterOptions | None = None):
        if not tiers:
            raise ValueError("the manager needs at least one tier")
        if len(tiers) != len(policies):
            raise ValueError("one eviction policy per tier is needed")
        low, high = watermarks
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got {watermarks}")
        self.tiers = list(tiers)
        """The media themselves, fastest first (the parts call them through adapters)."""
        self.policies = list(policies)
        self.clock = clock
        self.counters = Counters()
        self.catalogue = Catalogue(on_unpinned=self._free_deleted)
        self.events = self.catalogue.events
        media = [TierAdapter(t) for t in self.tiers]
        self.shared_tier = next((i for i, t in enumerate(media) if t.shared), None)
        """Index of the tier whose memory same-node clients map (the host arena), if any."""
        cat, pol, counters = self.catalogue, self.policies, self.counters
        self.mover = Mover(self.tiers, async_moves)
        self.placement = Placement(media, pol, cat, counters, clock)
        self.transfers = Transfers(media, pol, cat, self.placement, self.mover, counters, clock, transfer_timeout_s)
        signal = CleanerSignal() if async_moves else None
        self.room = Room(media, pol, cat, self.placement, self.transfers, counters, clock, watermarks, signal)
        self.moves = Moves(media, cat, self.room, self.transfers, counters)
        self.writes = Writes(media, pol, cat, self.placement, self.room, self.moves, counters, clock,
                             write_policy, writer_wait_s)
        self.cluster: Cluster | None = None
        """The cluster level (:mod:`kvstore.cluster.cluster`) when a remote tier is configured."""
        if any(t.remote is not None for t in media):
            port = ClusterPort(media, pol, cat, self.placement, self.room, self.moves, self.writes, clock)
            self.cluster = Cluster(port, media, counters, cluster, shared_tier=self.shared_tier,
                                   write_through=write_policy == WRITE_THROUGH)
        self.reads = Reads(media, cat, self.placement, self.moves, counters, self.cluster, promote_on_get)
        self.leases = Leases(media, cat, self.placement, self.moves, counters, self.shared_tier,
                             self.writes.begin_put, self.reads.page_in)
        self.placement.recover()
        self._cleaner = None
        if signal is not None:
            self._cleaner = Cleaner(signal, self.room, self.placement, self.transfers, cat, counters,
                                    disk_workers=self.mover.disk_workers, on_tick=self.leases.maintain).start()

    def _free_deleted(self, entry: Entry) -> None:
        self.placement.free_entry(entry, "deleted")       # a deleted block's last pin went

    # ------------------------------------------------------------------ queries

    @property
    def write_policy(self) -> str:
        return self.writes.write_policy

    @property
    def put_failure(self) -> tuple[float, str] | None:
        """``(monotonic time, why)`` of the last failed put since the last success."""
        return self.writes.put_failure

    @property
    def lock(self) -> threading.RLock:
        """The catalogue lock (tests and tools; the store's own components use the API)."""
        return self.catalogue.lock

    def __contains__(self, key: bytes) -> bool:
        return key in self.catalogue

    def __len__(self) -> int:
        return len(self.catalogue)

    def tier_of(self, key: bytes) -> TierKind | None:
        """Fastest tier holding ``key``, or None when not stored."""
        loc = self.locate(key)
        return None if loc is None else self.tiers[loc[1]].kind

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(payload bytes, index of the fastest tier holding it)``, or None when not stored."""
        return self.reads.locate(key)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of ``keys`` that is stored, and the fastest tier of each hit.

        With a cluster, blocks after a local miss may be hits of tier ``REMOTE`` (held by
        other nodes; one existence check with a short deadline, a failure is a miss).
        Does not count as an access for the eviction policies (the read that follows does).
        """
        return self.reads.lookup(keys)

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    def tier_kind(self, tier: int) -> TierKind:
        return self.tiers[tier].kind

    def tier_name(self, tier: int) -> str:
        return self.tiers[tier].name

    def fits(self, tier: int, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in tier ``tier`` now without evicting."""
        return self.tiers[tier].fits(nbytes)

    def capacity_bytes(self, tier: int) -> int:
        return self.tiers[tier].capacity_bytes

    def used_bytes(self, tier: int) -> int:
        return self.tiers[tier].used_bytes

    def payload_bytes(self, tier: int) -> int:
        """Payload bytes of the committed blocks in tier ``tier`` (``used_bytes`` counts
        allocator units, which round blocks up)."""
        return self.placement.resident_bytes(tier)

    def usage(self) -> list[TierUsage]:
        return [TierUsage(t.kind, t.name, t.capacity_bytes, t.used_bytes, len(t), p.name)
                for t, p in zip(self.tiers, self.policies)]

    # ------------------------------------------------------------------ put

    def begin_put(self, key: bytes, nbytes: int, *, owner: str = "", ttl_s: float | None = None,
                  tier: int | None = None, meta=None, wait_s: float | None = None) -> PutOutcome:
        """Phase one of a put: claim the 32-byte ``key`` and reserve ``nbytes`` (> 0) bytes
        in the fastest tier that admits it (``tier``: only there). ``owner``/``ttl_s``
        (seconds): a zero-copy reservation's tenant and lifetime; ``meta``: its
        :class:`~kvstore.common.types.BlockMeta`; ``wait_s``: the longest wait for another
        writer. Returns a :class:`PutOutcome`. Raises InvalidRequest, SizeConflict,
        TierFull, TierIOError, WriteConflict (:meth:`kvstore.store.writes.Writes.begin_put`)."""
        return self.writes.begin_put(key, nbytes, owner=owner, ttl_s=ttl_s, tier=tier, meta=meta, wait_s=wait_s)

    def write_chunk(self, pending: Claim, offset: int, data: Any) -> None:
        """Copy one in-order chunk (any buffer) at byte ``offset`` of an open put, without
        the lock. Raises InvalidRequest (out of order, oversize), TierFull, TierIOError."""
        self.writes.write_chunk(pending, offset, data)

    def commit_put(self, pending: Claim, *, in_place: bool = False) -> None:
        """Phase two: make the fully written block visible (``in_place``: written through
        the shared arena). Local write-through copies are made before it returns; the
        cluster's at the end of the put call (:meth:`put_batch`). Raises InvalidRequest
        (bytes missing: aborted), BlockNotFound (expired or aborted), TierFull, TierIOError."""
        self.writes.commit_put(pending, in_place=in_place)

    def abort_put(self, pending: Claim) -> None:
        """Drop an open put (or zero-copy reservation) and its room. Safe to call twice."""
        self.writes.abort_put(pending)

    def put(self, key: bytes, data: Any) -> bool:
        """Store block ``key`` (32 bytes) with payload ``data`` (any buffer) in one call,
        written through to the cluster when the policy says so. Returns False when it
        was stored already or no tier admitted it. Raises as :meth:`begin_put` and
        :meth:`write_chunk`."""
        stored = self.writes.put(key, data)
        if stored and self.cluster is not None:
            self.cluster.put_done([key])
        return stored

    def put_batch(self) -> PutBatch:
        """A put call of many blocks: ``batch.commit(pending)`` per block, ``batch.end()``
        when the call ends (the cluster's write-through, batched)."""
        return PutBatch(self.writes, self.cluster)

    def commit_puts(self, pending: Sequence[Claim], *, in_place: bool = False) -> None:
        """:meth:`commit_put` each of ``pending`` as one put call (then the cluster's
        write-through, batched). Raises as :meth:`commit_put` (the rest stay open)."""
        batch = self.put_batch()
        for p in pending:
            batch.commit(p, in_place=in_place)
        batch.end()

    # ------------------------------------------------------------------ read

    def reader(self, key: bytes, *, remote: bool = True) -> BlockReader | None:
        """Open block ``key`` for a read in several pieces (pinned until ``close``); None
        on a miss. ``remote``: page it in from the cluster first when only it holds it.
        Raises InvalidRequest for a bad key."""
        return self.reads.reader(key, remote=remote)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> TierKind | None:
        """Read block ``key`` (or byte ``ranges`` of it, concatenated) into writable buffer
        ``out``. Returns the tier read from, or None on a miss (a copy failing its checksum
        is dropped; none left is a miss). Raises InvalidRequest (key, ranges, ``out`` too small)."""
        return self.reads.read_into(key, out, ranges)

    def get(self, key: bytes, ranges: ByteRanges | None = None) -> GetResult:
        """:meth:`read_into` a new buffer: ``GetResult.data`` is a memoryview of uint8."""
        return self.reads.get(key, ranges)

    def get_many(self, keys: Iterable[bytes], ranges: ByteRanges | None = None,
                 stop_at_miss: bool = False) -> Iterator[GetResult]:
        """Yield :meth:`get` for each key (the cluster asked once); with ``stop_at_miss``
        stop after the first miss."""
        return self.reads.get_many(keys, ranges, stop_at_miss)

    # ------------------------------------------------------------------ same-node path

    def lease(self, keys: Sequence[bytes], ttl_s: float, owner: str = "", *, prefix: bool = True,
              device: bool = False, max_bytes: int | None = None, session: str = "",
              defer: list | None = None) -> LeaseGrant:
        """Pin ``keys`` for ``ttl_s`` seconds for a client of tenant ``owner`` that reads
        them in place (the shared arena, or HBM by CUDA IPC with ``device``); at most
        ``max_bytes`` per grant; ended early with the client's open ``session``; ``defer``:
        a list the bookkeeping the answer does not need is appended to, for the caller to run
        after answering (:meth:`kvstore.store.leases.Leases.lease`). Returns a
        :class:`LeaseGrant`. Raises InvalidRequest, FeatureDisabled (no tier clients can map)."""
        return self.leases.lease(keys, ttl_s, owner, prefix=prefix, device=device, max_bytes=max_bytes,
                                 session=session, defer=defer)

    def open_session(self, session: str) -> None:
        """Accept leases and reservations of same-node client ``session`` until it ends."""
        self.leases.open_session(session)

    def end_session(self, session: str, client_gone: bool = True) -> tuple[int, int]:
        """``session`` ended (:meth:`kvstore.store.leases.Leases.end_session`): ``(released, aborted)``."""
        return self.leases.end_session(session, client_gone)

    def release(self, lease_id: str, owner: str = "") -> bool:
        """Release lease ``lease_id`` of tenant ``owner`` (its blocks are unpinned).
        Returns False when it is unknown, expired or another tenant's; never raises."""
        return self.leases.release(lease_id, owner)

    def maintain(self) -> None:
        """Release leases and abort zero-copy reservations whose TTL passed (the daemon's
        cleaner thread calls this every tick)."""
        self.leases.maintain()

    def reserve_shared(self, key: bytes, nbytes: int, owner: str, ttl_s: float,
                       meta=None, session: str = "") -> tuple[int, ReserveStatus, str]:
        """Reserve ``nbytes`` for ``key`` in the shared arena for a zero-copy put of tenant
        ``owner``, for ``ttl_s`` seconds or until ``session`` ends: ``(arena offset in bytes,
        status, detail)``; refusals are statuses (FeatureDisabled: ``session`` not open)."""
        return self.leases.reserve_shared(key, nbytes, owner, ttl_s, meta, session)

    def find_claim(self, key: bytes, owner: str, session: str = "") -> Claim:
        """The open zero-copy reservation of ``key`` by ``owner`` in ``session`` (to commit or
        abort). Raises BlockNotFound (none, expired, another tenant's or session's)."""
        return self.leases.find_claim(key, owner, session)

    # ------------------------------------------------------------------ moves

    def promote(self, key: bytes, to: int = 0, wait: bool = True) -> bool:
        """Copy stored block ``key`` up into tier ``to`` (prefetch). True when it is there
        now (or, with ``wait=False``, on its way). Never evicts pinned blocks."""
        return self.moves.promote_key(key, to, wait)

    def demote(self, key: bytes, frm: int = 0) -> bool:
        """Move block ``key`` out of tier ``frm`` (to the next tier). False if absent
        there, pinned or leased, or when the demotion failed (logged); never raises."""
        return self.room.demote(key, frm)

    def make_room(self, tier: int, nbytes: int, *, protect: Callable[[bytes], bool] = lambda k: False,
                  candidates: Iterable[bytes] = (), give_up: Callable[[bytes], bool] | None = None,
                  on_moved: Callable[[bytes], None] | None = None) -> bool:
        """Free room for ``nbytes`` in tier ``tier`` by demoting blocks (prefetch):
        ``candidates`` first, then the tier policy's victims, never a ``protect``-ed,
        pinned or leased block; stops when ``give_up(victim)``. ``on_moved(key)`` per
        block moved. Returns True when the room is there; never raises."""
        return self.room.make_room(tier, nbytes, protect=protect, candidates=candidates, give_up=give_up,
                                   on_moved=on_moved)

    # ------------------------------------------------------------------ the policies

    def hint_next_use(self, keys: Sequence[bytes], times: float | Sequence[float], now: float) -> None:
        """Pass predicted next-use times (seconds, the manager's clock) to every policy
        that takes them (``next_use``, ``opt``)."""
        with self.catalogue.lock:
            for p in self.policies:
                if isinstance(p, AcceptsNextUse):
                    p.set_next_use(keys, times, now)

    def attach_reuse_model(self, model) -> bool:
        """Give the learned reuse model to every policy that uses one; True if any does."""
        used = False
        for p in self.policies:
            if isinstance(p, UsesReuseModel):
                p.attach(model)
                used = True
        return used

    def distance(self, tier: int, key: bytes, now: float) -> float | None:
        """The tier policy's predicted time to ``key``'s next use (seconds), when it has one."""
        policy = self.policies[tier]
        return policy.distance(key, now) if isinstance(policy, PredictsDistance) else None

    # ------------------------------------------------------------------ delete, persist, close

    def delete(self, keys: Iterable[bytes]) -> int:
        """Delete blocks from every tier. Returns how many were stored. A block being read
        (pinned or leased) is hidden at once and freed when its last reader finishes."""
        return self.placement.delete(keys)

    def persist(self, timeout: float = 60.0, cancelled: Callable[[], bool] | None = None) -> int:
        """Copy every block held only in volatile tiers down to the last local tier when it
        is persistent (NVMe), so a graceful stop keeps them. Bounded by ``timeout``
        seconds, and stopped between blocks once ``cancelled()`` is true; returns blocks copied."""
        last = len(self.tiers) - 1 - (self.cluster is not None)    # the last local tier
        if last <= 0 or self.tiers[last].volatile:
            return 0
        return self.moves.persist(last, timeout, cancelled)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued transfer has finished (tests, shutdown; seconds)."""
        self.mover.drain(timeout)

    def close(self) -> None:
        """Stop background work, finish queued transfers and close every tier."""
        if self.cluster is not None:
            self.cluster.close()
        if self._cleaner is not None:
            self._cleaner.stop()
        self.mover.stop(timeout=self.transfers.transfer_timeout_s)
        for tier in self.tiers:
            tier.close()


__all__ = ["BlockReader", "LeaseGrant", "LeasedBlock", "PutBatch", "PutOutcome", "TierManager", "TierUsage",
           "WRITE_BACK", "WRITE_THROUGH", "MAX_LEASE_TTL_S", "MAX_LEASES", "MAX_SIZE_CONFLICTS_LOGGED"]
