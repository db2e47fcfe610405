"""The tier manager: the store core's public face (put, read, lookup, lease, delete).

Tiers are ordered fastest first (HBM, host, NVMe). The manager composes the
:class:`~kvstore.store.catalogue.Catalogue` (entries, claims, pins, leases, events), the
:class:`~kvstore.store.placement.Placement` (eviction, demotion, promotion, background
cleaning), the :class:`~kvstore.store.mover.Mover` (bytes between tiers) and the three parts of
the data path: :class:`~kvstore.store.writes.Writes` (the put protocol),
:class:`~kvstore.store.reads.Reads` and :class:`~kvstore.store.leases.Leases` (the same-node path),
whose public methods it exposes as its own. It talks to
media only through :class:`tiers.base.Tier` and their declared capabilities, so the
same code runs the daemon (real media) and ``kvstore simulate`` (byte-less tiers,
virtual time). Media errors (:mod:`tiers.errors`) become store errors
(:mod:`kvstore.common.errors`) here.

A block's way (see ``docs/architecture.md``):

- **Put** claims the key, makes room in the fastest tier whose admission policy takes
  the block (evicting a clean block, or demoting a dirty one), reserves it there; the
  bytes are copied in without the lock; :meth:`TierManager.commit_put` makes the block
  visible, and with ``write_through`` acknowledges only once every lower tier holds a
  copy. The first writer of a key wins: a put of a stored key with the same size is a
  no-op (``already_present``), with another size it is refused (:class:`SizeConflict`).
- **Read** (:meth:`TierManager.read_into`) pins the block, reads it (or byte ranges of
  it) from the fastest tier holding it straight into the caller's buffer, unpins, and
  asks for a promotion when the copy came from a lower tier (async in the daemon).
- **Lease** pins blocks with a TTL for a client that reads them in place (the shared
  host arena, or HBM by CUDA IPC); blocks only in a lower tier are promoted first.
- Pinned and leased blocks are never evicted; a delete of one hides it at once and
  frees it when the last pin goes.
- **Cluster** (a remote tier, last): Lookup also asks the cluster, reads page blocks in
  from it, and it receives demotions; :mod:`kvstore.cluster.cluster` (:attr:`TierManager.cluster`).

A copy that fails its checksum is dropped from that tier and counted in
``corrupt_blocks``; the block is served from another tier's copy or is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from tiers.base import Tier, TierKind

from kvstore.store.catalogue import Catalogue
from kvstore.store.cleaner import Cleaner
from kvstore.store.counters import Counters
from kvstore.common.errors import KVStoreError
from kvstore.store.leases import MAX_LEASE_TTL_S, MAX_LEASES, LeasedBlock, LeaseGrant, Leases
from kvstore.store.mover import Mover
from kvstore.store.placement import Placement
from kvstore.policy import AcceptsNextUse, EvictionPolicy, NoVictim, PredictsDistance, UsesReuseModel
from kvstore.store.reads import BlockReader, Reads
from kvstore.cluster.cluster import Cluster, ClusterOptions
from kvstore.common.types import LookupResult
from kvstore.store.writes import MAX_SIZE_CONFLICTS_LOGGED, WRITE_BACK, WRITE_THROUGH, PutOutcome, Writes

log = logging.getLogger("kvstore.store.manager")


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
            released, and a background thread keeping the watermarks and expiring leases
            and reservations. False (the simulator): copies inline, deterministic.
        transfer_timeout_s: a copy waited on longer than this is abandoned (seconds).
        watermarks: ``(low, high)`` fractions of capacity for background cleaning.
        cluster: how to use a remote tier (the last tier), when there is one.
    Raises ValueError for inconsistent arguments.
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
        self.policies = list(policies)
        self.clock = clock
        self.counters = Counters()
        self.catalogue = Catalogue(on_unpinned=lambda e: self.placement.free_entry(e, "deleted"))
        self.events = self.catalogue.events
        self.mover = Mover(self.tiers, async_moves)
        self.placement = Placement(self.tiers, self.policies, self.catalogue, self.mover, self.counters,
                                   clock, transfer_timeout_s, watermarks, promote_on_get=promote_on_get)
        self.shared_tier = next((i for i, t in enumerate(self.tiers) if t.capabilities.shared is not None), None)
        """Index of the tier whose memory same-node clients map (the host arena), if any."""
        self.writes = Writes(self.placement, write_policy, writer_wait_s)
        self.reads = Reads(self.placement)
        self.leases = Leases(self.placement, self.shared_tier, self.writes.begin_put, self.reads.page_in)
        # the parts' public methods, on the manager itself
        self.begin_put, self.write_chunk, self.commit_put = (self.writes.begin_put, self.writes.write_chunk,
                                                             self.writes.commit_put)
        self.abort_put, self.put = self.writes.abort_put, self.writes.put
        self.reader, self.read_into, self.get, self.get_many, self.locate = (
            self.reads.reader, self.reads.read_into, self.reads.get, self.reads.get_many, self.reads.locate)
        self.lease, self.release, self.maintain = self.leases.lease, self.leases.release, self.leases.maintain
        self.reserve_shared, self.find_claim = self.leases.reserve_shared, self.leases.find_claim
        self.cluster = (Cluster(self, cluster) if any(t.capabilities.remote is not None for t in self.tiers)
                        else None)
        """The cluster level (:mod:`kvstore.cluster.cluster`) when a remote tier is configured."""
        self.reads.cluster = self.writes.cluster = self.cluster
        self._recover()
        self._cleaner = None
        if async_moves:
            self._cleaner = Cleaner(self.placement, on_tick=self.maintain).start()

    @property
    def write_policy(self) -> str:
        return self.writes.write_policy

    @property
    def put_failure(self) -> tuple[float, str] | None:
        """``(monotonic time, why)`` of the last failed put since the last success."""
        return self.writes.put_failure

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        now = self.clock()
        p = self.placement
        with self.catalogue.lock:
            for i, tier in enumerate(self.tiers):
                for key, nbytes in tier.recover():
                    entry = self.catalogue.raw(key)
                    if entry is None:
                        p.new_entry(key, nbytes, i, "recovered")
                    elif entry.size == nbytes:
                        p.add_copy(entry, i, "recovered")
                    else:
                        log.warning("block %s has %d bytes in %s but %d elsewhere; dropping the %s copy",
                                    key.hex()[:16], nbytes, tier.name, entry.size, tier.name)
                        tier.free(key)
                        continue
                    self.policies[i].insert(key, nbytes, now)
                    self.counters.inc("blocks_recovered")

    @property
    def lock(self) -> threading.RLock:
        """The catalogue lock (tests and tools; the store's own components use the API)."""
        return self.catalogue.lock

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: bytes) -> bool:
        return key in self.catalogue

    def __len__(self) -> int:
        return len(self.catalogue)

    def tier_of(self, key: bytes) -> TierKind | None:
        """Fastest tier holding ``key``, or None when not stored."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            return None if e is None else self.tiers[e.tiers[0]].kind

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of ``keys`` that is stored, and the fastest tier of each hit.

        With a cluster, blocks after a local miss may be hits of tier ``REMOTE`` (held by
        other nodes; one existence check with a short deadline, a failure is a miss).
        Does not count as an access for the eviction policies (the read that follows does).
        """
        hits = self.catalogue.prefix(keys)
        kinds = [int(t.kind) for t in self.tiers]
        codes = bytes(kinds[i] for i in hits)
        if self.cluster is not None and len(hits) < len(keys):
            codes += self.cluster.lookup_rest(keys[len(hits):])    # the cluster, within a deadline
        self.counters.inc("lookups")
        self.counters.inc("lookup_blocks", len(keys))
        self.counters.inc("lookup_hit_blocks", len(codes))
        return LookupResult(len(codes), codes)

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

    # ------------------------------------------------------------------ moves

    def promote(self, key: bytes, to: int = 0, wait: bool = True) -> bool:
        """Copy a stored block up into tier ``to`` (prefetch). True when it is there now
        (or, with ``wait=False``, on its way). Never evicts pinned blocks."""
        entry = self.catalogue.pin(key)
        if entry is None:
            return False
        try:
            t = self.placement.promote(entry, to, wait)
            return t is not None and (t.ok or not wait)
        finally:
            self.catalogue.unpin(entry)

    def demote(self, key: bytes, frm: int = 0) -> bool:
        """Move a block out of tier ``frm`` (to the next tier). False if absent there, pinned
        or leased, or when the demotion failed."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            if e is None or frm not in e.tiers or e.pins or len(self.tiers) < 2:
                return False
            try:
                self.placement.evict_locked(frm, key, reason="evicted")
            except KVStoreError as err:
                log.warning("demotion of %s failed: %s", key.hex()[:16], err)
                return False
            return frm not in e.tiers

    def make_room(self, tier: int, nbytes: int, *, protect: Callable[[bytes], bool] = lambda k: False,
                  candidates: Iterable[bytes] = (), give_up: Callable[[bytes], bool] | None = None,
                  on_moved: Callable[[bytes], None] | None = None) -> bool:
        """Free room for ``nbytes`` in tier ``tier`` by demoting blocks (prefetch).

        ``candidates`` are demoted first, in order; then the tier policy's victims. Blocks
        for which ``protect`` is True, pinned and leased blocks are never moved; when the
        policy's next victim makes ``give_up`` True, nothing more is moved; ``on_moved(key)``
        is called for each block moved out. Returns True when the room is there.
        """
        t = self.tiers[tier]
        if tier == len(self.tiers) - 1:
            return t.fits(nbytes)        # demoting from the last tier would drop blocks
        p = self.placement
        with self.catalogue.lock:
            try:
                for key in candidates:
                    if t.fits(nbytes):
                        return True
                    if key in t and not protect(key) and p.evictable(key):
                        p.evict_locked(tier, key)
                        if on_moved is not None:
                            on_moved(key)
                while not t.fits(nbytes):
                    victim = self.policies[tier].victim(lambda k: p.evictable(k) and not protect(k),
                                                        incoming=None, now=self.clock())
                    if give_up is not None and give_up(victim):
                        return False
                    p.evict_locked(tier, victim)
                    if on_moved is not None:
                        on_moved(victim)
                return True
            except (NoVictim, KVStoreError) as e:
                log.debug("make_room(%s, %d) gave up: %s", t.name, nbytes, e)
                return False

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
        """Delete blocks from every tier. Returns how many were stored.

        A block being read (pinned or leased) is hidden at once and freed when its last
        reader finishes.
        """
        deleted = 0
        with self.catalogue.lock:
            for key in keys:
                e = self.catalogue.get(key)
                if e is None:
                    continue
                deleted += 1
                if e.pins:
                    e.deleted = True
                else:
                    self.placement.free_entry(e, "deleted")
        self.counters.inc("blocks_deleted", deleted)
        return deleted

    def persist(self, timeout: float = 60.0) -> int:
        """Copy every block held only in volatile tiers down to the last tier when it is
        persistent (NVMe), so a graceful stop keeps them. Bounded by ``timeout`` seconds;
        returns blocks copied."""
        last = len(self.tiers) - 1 - (self.cluster is not None)    # the last local tier
        if last <= 0 or self.tiers[last].volatile:
            return 0
        deadline = time.monotonic() + timeout
        copied = 0
        with self.catalogue.lock:
            todo = [e for e in self.catalogue.entries() if last not in e.tiers]
            if todo:
                log.info("persist: copying %d blocks held only in memory to %s (at most %.0f s)",
                         len(todo), self.tiers[last].name, timeout)
            shown = time.monotonic()
            for entry in todo:
                if time.monotonic() - shown > 5.0:
                    shown = time.monotonic()
                    log.info("persist: %d of %d blocks copied", copied, len(todo))
                if time.monotonic() > deadline:
                    log.warning("persist: time is up; %d blocks stay only in memory", len(todo) - copied)
                    break
                if entry.deleted or last in entry.tiers or not entry.tiers:
                    continue
                try:
                    self.placement.copy_locked(entry, entry.tiers[0], last, "demoted")
                    copied += 1
                except (KVStoreError, NoVictim) as e:
                    log.debug("persist of %s skipped: %s", entry.key.hex()[:16], e)
        self.counters.inc("blocks_persisted", copied)
        return copied

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued transfer has finished (tests, shutdown)."""
        self.mover.drain(timeout)

    def close(self) -> None:
        """Stop background work, finish queued transfers and close every tier."""
        if self.cluster is not None:
            self.cluster.close()
        if self._cleaner is not None:
            self._cleaner.stop()
        self.mover.stop(timeout=self.placement.transfer_timeout_s)
        for tier in self.tiers:
            tier.close()



__all__ = ["BlockReader", "LeaseGrant", "LeasedBlock", "PutOutcome", "TierManager", "TierUsage", "WRITE_BACK",
           "WRITE_THROUGH", "MAX_LEASE_TTL_S", "MAX_LEASES",
           "MAX_SIZE_CONFLICTS_LOGGED"]
