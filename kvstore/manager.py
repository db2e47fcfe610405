"""The tier manager: the store core's public face (put, read, lookup, lease, delete).

Tiers are ordered fastest first (HBM, host, NVMe). The manager composes the
:class:`~kvstore.catalogue.Catalogue` (entries, claims, pins, leases, events), the
:class:`~kvstore.placement.Placement` (eviction, demotion, promotion, background
cleaning) and the :class:`~kvstore.mover.Mover` (bytes between tiers). It talks to
media only through :class:`tiers.base.Tier` and their declared capabilities, so the
same code runs the daemon (real media) and ``kvstore simulate`` (byte-less tiers,
virtual time). Media errors (:mod:`tiers.errors`) become store errors
(:mod:`kvstore.errors`) here.

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

A copy that fails its checksum is dropped from that tier and counted in
``corrupt_blocks``; the block is served from another tier's copy or is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from tiers import errors as terr
from tiers.base import ByteRanges, IpcHandle, Tier, TierKind, check_ranges

from .catalogue import Catalogue, Claim, Entry
from .counters import Counters
from .errors import (BlockNotFound, CorruptBlock, InvalidRequest, KVStoreError, SizeConflict, TierFull, TierIOError,
                     WriteConflict)
from .mover import Mover
from .placement import Cleaner, Placement
from .policy import AcceptsNextUse, EvictionPolicy, NoVictim, PredictsDistance, UsesReuseModel
from .types import KEY_BYTES, GetResult, LookupResult, ReserveStatus

log = logging.getLogger("kvstore.manager")

WRITE_BACK = "write_back"
WRITE_THROUGH = "write_through"
MAX_LEASE_TTL_S = 600.0
"""Longest lease or reservation a client may ask for (seconds)."""

MAX_LEASES = 65536
"""Most leases alive at once; past it a Lease grants nothing (``resume_at`` 0: the client
reads by gRPC instead), counted in ``leases_refused``. Never ends a lease early."""

MAX_SIZE_CONFLICTS_LOGGED = 4096
"""Keys remembered so that each size conflict is logged once (oldest forgotten first)."""


@dataclass
class PutOutcome:
    """What :meth:`TierManager.begin_put` decided: the block is stored already, no tier's
    admission policy wants it (``not_admitted``: a normal outcome, nothing stored), or
    room was reserved (``pending``, a :class:`~kvstore.catalogue.Claim`)."""

    key: bytes
    already_present: bool
    pending: Claim | None = None
    not_admitted: bool = False


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


_NO_ROOM = object()


@dataclass
class TierUsage:
    kind: TierKind
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    policy: str


class _NotAdmitted(Exception):
    """No tier's admission policy accepted the block (internal)."""


def _check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise InvalidRequest(f"block keys are {KEY_BYTES} bytes, got {len(key)}")


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
    Raises ValueError for inconsistent arguments.
    """

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy],
                 write_policy: str = WRITE_BACK, clock: Callable[[], float] = time.monotonic,
                 promote_on_get: bool = True, writer_wait_s: float = 30.0,
                 async_moves: bool = False, transfer_timeout_s: float = 30.0,
                 watermarks: tuple[float, float] = (0.85, 0.95)):
        if not tiers:
            raise ValueError("the manager needs at least one tier")
        if len(tiers) != len(policies):
            raise ValueError("one eviction policy per tier is needed")
        if write_policy not in (WRITE_BACK, WRITE_THROUGH):
            raise ValueError(f"unknown write policy {write_policy!r}")
        low, high = watermarks
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got {watermarks}")
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.write_policy = write_policy
        self.clock = clock
        self.promote_on_get = promote_on_get
        self.writer_wait_s = writer_wait_s
        self.counters = Counters()
        self.catalogue = Catalogue(on_unpinned=lambda e: self._placement.free_entry(e, "deleted"))
        self.events = self.catalogue.events
        self.mover = Mover(self.tiers, async_moves)
        self._placement = Placement(self.tiers, self.policies, self.catalogue, self.mover, self.counters,
                                    clock, transfer_timeout_s, watermarks)
        self._shared = next((i for i, t in enumerate(self.tiers) if t.capabilities.shared is not None), None)
        self._device = next((i for i, t in enumerate(self.tiers) if t.capabilities.device is not None), None)
        self._size_conflicts_logged: OrderedDict[bytes, None] = OrderedDict()
        self.put_failure: tuple[float, str] | None = None   # (monotonic time, why) of the last failed put
        self._recover()
        self._cleaner = None
        if async_moves:
            self._cleaner = Cleaner(self._placement, on_tick=self.maintain).start()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        now = self.clock()
        p = self._placement
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

    @property
    def shared_tier(self) -> int | None:
        """Index of the tier whose memory same-node clients map (the host arena), if any."""
        return self._shared

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

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(payload bytes, index of the fastest tier holding it)``, or None."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            return None if e is None else (e.size, e.tiers[0])

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of ``keys`` that is stored, and the fastest tier of each hit.

        Does not count as an access for the eviction policies (the read that follows does).
        """
        hits = self.catalogue.prefix(keys)
        kinds = [int(t.kind) for t in self.tiers]
        self.counters.inc("lookups")
        self.counters.inc("lookup_blocks", len(keys))
        self.counters.inc("lookup_hit_blocks", len(hits))
        return LookupResult(len(hits), bytes(kinds[i] for i in hits))

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
        return self._placement.resident_bytes(tier)

    def usage(self) -> list[TierUsage]:
        return [TierUsage(t.kind, t.name, t.capacity_bytes, t.used_bytes, len(t), p.name)
                for t, p in zip(self.tiers, self.policies)]

    # ------------------------------------------------------------------ put

    def begin_put(self, key: bytes, nbytes: int, *, owner: str = "", ttl_s: float | None = None,
                  tier: int | None = None) -> PutOutcome:
        """Phase one of a put: claim ``key`` and reserve room for ``nbytes`` bytes.

        Args:
            key: 32-byte block key; nbytes: payload bytes (> 0).
            owner: the tenant allowed to finish the put.
            ttl_s: a zero-copy reservation's lifetime (the client writes into the shared
                arena); it is reclaimed after this many seconds if not committed.
            tier: reserve in this tier only (the shared arena for zero-copy puts).
        Returns already_present (and touches the block) when it is stored with the same
        size; waits for another client's in-flight write of the same key.
        Raises:
            InvalidRequest: bad key length or size.
            SizeConflict: the key is stored with another size (first writer wins).
            TierFull: no tier has or can make room.
            WriteConflict: another client's write of the key did not finish in time.
        """
        _check_key(key)
        if nbytes <= 0:
            raise InvalidRequest(f"block size must be > 0 bytes, got {nbytes}")
        cat = self.catalogue
        deadline = time.monotonic() + self.writer_wait_s
        with cat.lock:
            while True:
                e = cat.get(key)
                if e is not None:
                    if e.size != nbytes:
                        self._size_conflict(key, e.size, nbytes)
                    self._touch(e)
                    self.counters.inc("puts_already_present")
                    return PutOutcome(key, already_present=True)
                if cat.claim(key) is None and cat.raw(key) is None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WriteConflict(f"block {key.hex()[:16]} is still being written or read by another client")
                cat.changed.wait(remaining)
            # Claim the key before making room: making room may release the lock while it
            # waits on a demotion, and a second put of the same key must wait, not reserve.
            claim = Claim(key, nbytes, owner=owner,
                          deadline=None if ttl_s is None else cat.clock() + ttl_s)
            cat.add_claim(claim)
            try:
                claim.tier = self._reserve_somewhere(key, nbytes, tier)
            except _NotAdmitted:
                cat.end_claim(claim)
                self.counters.inc("puts_not_admitted")
                return PutOutcome(key, already_present=False, not_admitted=True)
            except BaseException:
                cat.end_claim(claim)
                raise
            return PutOutcome(key, already_present=False, pending=claim)

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
        """Reserve ``nbytes`` in the fastest tier that admits the block (lock held). A
        failure marks :attr:`put_failure` (health) unless the put was limited to ``only``
        one tier (a zero-copy reservation, which falls back to a normal put)."""
        errors: list[str] = []
        now = self.clock()
        admitted = False
        for i, tier in enumerate(self.tiers):
            if only is not None and i != only:
                continue
            if not self.policies[i].admit(key, nbytes, now):
                continue
            admitted = True
            try:
                self._placement.reserve_locked(i, key, nbytes, incoming=key)
                return i
            except TierIOError as err:
                if only is None:
                    self.put_failure = (time.monotonic(), f"{tier.name}: {err}")
                raise
            except (TierFull, NoVictim) as err:
                errors.append(f"{tier.name}: {err}")
        if not admitted:
            raise _NotAdmitted()
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
        try:
            self.tiers[pending.tier].write(pending.key, offset, data)
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        except terr.TierFull as e:             # a full disk (DiskFull)
            raise TierFull(f"{self.tiers[pending.tier].name}: {e}") from None
        except terr.TierError as e:
            raise TierIOError(f"{self.tiers[pending.tier].name}: {e}") from None
        pending.written = offset + n

    def commit_put(self, pending: Claim, *, in_place: bool = False) -> None:
        """Phase two: make a fully written block visible (and write it through).

        ``in_place``: the client filled the reservation through the shared arena; its
        bytes are taken as written. Raises InvalidRequest when fewer bytes than declared
        were written (the put is aborted), TierIOError when the medium fails (aborted too).
        """
        tier = self.tiers[pending.tier]
        if in_place:
            host = tier.capabilities.host
            if host is None:
                self.abort_put(pending)
                raise InvalidRequest(f"{tier.name} cannot be written in place")
            host.mark_written(pending.key, pending.size)
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
                if isinstance(e, terr.TierFull):
                    raise TierFull(f"{tier.name}: committing block {pending.key.hex()[:16]} failed: {e}") from None
                if isinstance(e, terr.TierError):
                    raise TierIOError(f"{tier.name}: committing block {pending.key.hex()[:16]} failed: {e}") from None
                raise
            cat.end_claim(pending)
            self.put_failure = None
            entry = self._placement.new_entry(pending.key, pending.size, pending.tier, "put")
            self.policies[pending.tier].insert(pending.key, pending.size, self.clock())
            self.counters.inc("blocks_put")
            self.counters.inc("bytes_put", pending.size)
            if self._cleaner is not None and tier.used_bytes > self._placement.high * tier.capacity_bytes:
                self._cleaner.kick()
            if self.write_policy == WRITE_THROUGH:
                for j in range(pending.tier + 1, len(self.tiers)):
                    try:    # acknowledged only once every lower copy exists (crash-safe)
                        self._placement.copy_locked(entry, pending.tier, j, "write_through")
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
        """Store a whole block in one call. Returns False when it was already stored or no
        tier admitted it. Raises as :meth:`begin_put` and :meth:`write_chunk`."""
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
            outcome = self.begin_put(key, nbytes, owner=owner, ttl_s=ttl_s, tier=self._shared)
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

    # ------------------------------------------------------------------ reads

    def _touch(self, entry: Entry) -> None:
        now = self.clock()
        for i in entry.tiers:
            self.policies[i].access(entry.key, now)

    def reader(self, key: bytes) -> "BlockReader | None":
        """Open block ``key`` for reading (pinned until :meth:`BlockReader.close`); None on
        a miss. For reads in several pieces (a large block streamed in chunks)."""
        _check_key(key)
        entry = self.catalogue.pin(key)
        if entry is None:
            self.counters.inc("get_misses")
            return None
        with self.catalogue.lock:
            self._touch(entry)
        return BlockReader(self, entry)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> TierKind | None:
        """Read one block (or ``ranges`` of it, concatenated) into writable buffer ``out``.

        Returns the tier it was read from, or None on a miss (also when every stored
        copy failed its checksum: those copies are dropped and counted in
        ``corrupt_blocks``). Raises InvalidRequest for a bad key length, ranges outside
        the block, or an ``out`` that is too small.
        """
        r = self.reader(key)
        if r is None:
            return None
        try:
            return r.read_into(out, ranges)
        except CorruptBlock:
            self.counters.inc("get_misses")
            return None
        finally:
            r.close()

    def get(self, key: bytes, ranges: ByteRanges | None = None) -> GetResult:
        """:meth:`read_into` a new buffer: ``GetResult.data`` is a memoryview of it (compares
        equal to bytes of the same content)."""
        loc = self.locate(key) if len(key) == KEY_BYTES else None
        if loc is None:
            _check_key(key)
            self.counters.inc("get_misses")
            return GetResult(key, False)
        try:
            total = check_ranges(ranges, loc[0])
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        out = np.empty(total, dtype=np.uint8)
        tier = self.read_into(key, out, ranges)
        return GetResult(key, True, tier, memoryview(out)) if tier is not None else GetResult(key, False)

    def get_many(self, keys: Iterable[bytes], ranges: ByteRanges | None = None,
                 stop_at_miss: bool = False) -> Iterator[GetResult]:
        """Yield :meth:`get` for each key; with ``stop_at_miss`` stop after the first miss."""
        for key in keys:
            result = self.get(key, ranges)
            yield result
            if stop_at_miss and not result.found:
                return

    # ------------------------------------------------------------------ leases

    def lease(self, keys: Sequence[bytes], ttl_s: float, owner: str = "", *, prefix: bool = True,
              device: bool = False, max_bytes: int | None = None) -> LeaseGrant:
        """Pin blocks for a client that reads them in place, for ``ttl_s`` seconds.

        A block in HBM is located by its IPC handle when ``device`` (the client is on the
        GPU), else in the shared host arena; a block only in a lower tier is promoted into
        the arena first. With ``prefix`` the grant ends at the first miss. The grant also
        ends early (``LeaseGrant.resume_at``) once ``max_bytes`` (default a quarter of the
        arena) are leased or a promotion finds no room: the client releases, then asks
        for the rest. A grant that holds no block creates no lease (``lease_id`` empty);
        with :data:`MAX_LEASES` alive it grants nothing (``resume_at`` 0). Raises
        InvalidRequest (bad key, TTL), KVStoreError when no tier can be mapped by clients.
        """
        if not 0.0 < ttl_s <= MAX_LEASE_TTL_S:   # also rejects NaN
            raise InvalidRequest(f"lease ttl must be in (0, {MAX_LEASE_TTL_S}] seconds, got {ttl_s}")
        for k in keys:
            _check_key(k)
        if self._shared is None and not (device and self._device is not None):
            raise KVStoreError("no tier can be read in place by clients (no shared host arena or HBM tier)")
        cat = self.catalogue
        if cat.num_leases >= MAX_LEASES:
            self.counters.inc("leases_refused")
            return LeaseGrant("", (), ttl_s, resume_at=0)
        if max_bytes is None:
            max_bytes = self.tiers[self._shared].capacity_bytes // 4 if self._shared is not None else 1 << 62
        blocks: list[LeasedBlock] = []
        held: list[Entry] = []
        leased = 0
        resume_at = None
        try:
            for n, key in enumerate(keys):
                size = self.locate(key)
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
            if not held:                 # misses only (or no room yet): nothing to hold
                return LeaseGrant("", tuple(blocks), ttl_s, resume_at)
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
                self._touch(entry)
            if device and self._device is not None and self._device in entry.tiers:
                tier = self.tiers[self._device]
                ipc = tier.capabilities.device.ipc_handle(key)
                self._count_read(tier, entry.size)
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
            self._count_read(tier, size)
            return entry, LeasedBlock(key, True, tier.kind, offset, size)
        except terr.TierError as e:
            log.debug("lease of %s: %s", key.hex()[:16], e)
            cat.unpin(entry)
            return None
        except BaseException:
            cat.unpin(entry)
            raise

    def _count_read(self, tier: Tier, nbytes: int, block: bool = True) -> None:
        """Count ``nbytes`` served from ``tier``; ``block``: and one block read (False for
        the further pieces of a block read in several)."""
        if block:
            self.counters.inc("reads")
            self.counters.inc(f"reads_{tier.name}")
        self.counters.inc("read_bytes", nbytes)
        self.counters.inc(f"read_bytes_{tier.name}", nbytes)

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

    # ------------------------------------------------------------------ moves

    def promote(self, key: bytes, to: int = 0, wait: bool = True) -> bool:
        """Copy a stored block up into tier ``to`` (prefetch). True when it is there now
        (or, with ``wait=False``, on its way). Never evicts pinned blocks."""
        entry = self.catalogue.pin(key)
        if entry is None:
            return False
        try:
            t = self._placement.promote(entry, to, wait)
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
                self._placement.evict_locked(frm, key, reason="evicted")
            except KVStoreError as err:
                log.warning("demotion of %s failed: %s", key.hex()[:16], err)
                return False
            return frm not in e.tiers

    def make_room(self, tier: int, nbytes: int, *, protect: Callable[[bytes], bool] = lambda k: False,
                  candidates: Iterable[bytes] = (), give_up: Callable[[bytes], bool] | None = None) -> bool:
        """Free room for ``nbytes`` in tier ``tier`` by demoting blocks (prefetch).

        ``candidates`` are demoted first, in order; then the tier policy's victims. Blocks
        for which ``protect`` is True, pinned and leased blocks are never moved; when the
        policy's next victim makes ``give_up`` True, nothing more is moved. Returns True
        when the room is there.
        """
        t = self.tiers[tier]
        if tier == len(self.tiers) - 1:
            return t.fits(nbytes)        # demoting from the last tier would drop blocks
        p = self._placement
        with self.catalogue.lock:
            try:
                for key in candidates:
                    if t.fits(nbytes):
                        return True
                    if key in t and not protect(key) and p.evictable(key):
                        p.evict_locked(tier, key)
                while not t.fits(nbytes):
                    victim = self.policies[tier].victim(lambda k: p.evictable(k) and not protect(k),
                                                        incoming=None, now=self.clock())
                    if give_up is not None and give_up(victim):
                        return False
                    p.evict_locked(tier, victim)
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
                    self._placement.free_entry(e, "deleted")
        self.counters.inc("blocks_deleted", deleted)
        return deleted

    def persist(self, timeout: float = 60.0) -> int:
        """Copy every block held only in volatile tiers down to the last tier when it is
        persistent (NVMe), so a graceful stop keeps them. Bounded by ``timeout`` seconds;
        returns blocks copied."""
        last = len(self.tiers) - 1
        if last == 0 or self.tiers[last].volatile:
            return 0
        deadline = time.monotonic() + timeout
        copied = 0
        with self.catalogue.lock:
            todo = [e for e in self.catalogue.entries() if last not in e.tiers]
            for entry in todo:
                if time.monotonic() > deadline:
                    log.warning("persist: time is up; %d blocks stay only in memory", len(todo) - copied)
                    break
                if entry.deleted or last in entry.tiers or not entry.tiers:
                    continue
                try:
                    self._placement.copy_locked(entry, entry.tiers[0], last, "demoted")
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
        if self._cleaner is not None:
            self._cleaner.stop()
        self.mover.stop(timeout=self._placement.transfer_timeout_s)
        for tier in self.tiers:
            tier.close()



class BlockReader:
    """A pinned block being read, possibly in several pieces (:meth:`TierManager.reader`).

    Each :meth:`read_into` reads from the fastest tier holding a good copy; a copy that
    fails its checksum or its medium is dropped (counted) and the next one is tried, so
    pieces of one block may come from different tiers (the copies are identical). A
    lower-tier read asks for a promotion when the reader closes.
    """

    def __init__(self, manager: TierManager, entry: Entry):
        self._m = manager
        self.entry = entry
        self.size = entry.size
        self._promote_from: int | None = None
        self._closed = False
        self._counted = False

    def read_into(self, out: Any, ranges: ByteRanges | None = None) -> TierKind:
        """Copy the block (or ``ranges``) into ``out``; returns the tier read from.

        Raises InvalidRequest (bad ranges, ``out`` too small), CorruptBlock when no good
        copy is left (the block is gone from the store).
        """
        m, entry = self._m, self.entry
        try:
            total = check_ranges(ranges, entry.size)
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        while entry.tiers:
            i = entry.tiers[0]
            tier = m.tiers[i]
            try:
                tier.read_into(entry.key, out, ranges)
            except terr.InvalidAccess as e:
                raise InvalidRequest(str(e)) from None
            except (terr.BlockCorrupt, terr.TierIOError, terr.BlockNotStored) as e:
                corrupt = isinstance(e, terr.BlockCorrupt)
                log.warning("dropping %s copy of block %s: %s", tier.name, entry.key.hex()[:16], e)
                m.counters.inc("corrupt_blocks" if corrupt else "read_errors")
                with m.catalogue.lock:
                    if i in entry.tiers:
                        m._placement.drop_copy(entry, i, "corrupt" if corrupt else "failed")
                continue
            m._count_read(tier, total, block=not self._counted)   # one read per block, bytes per piece
            self._counted = True
            if i > 0 and m.promote_on_get:
                self._promote_from = i
            return tier.kind
        raise CorruptBlock(f"block {entry.key.hex()[:16]}: no readable copy is left")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._promote_from is not None and self.entry.tiers:
                self._m._placement.promote(self.entry, 0, wait=False)
        finally:
            self._m.catalogue.unpin(self.entry)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BlockReader", "LeaseGrant", "LeasedBlock", "PutOutcome", "TierManager", "TierUsage", "WRITE_BACK",
           "WRITE_THROUGH", "MAX_LEASE_TTL_S", "MAX_LEASES"]
