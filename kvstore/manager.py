"""The tier manager: placement of content-addressed blocks across an ordered list of tiers.

Tiers are ordered fastest first (HBM, host, NVMe). The manager owns the block
catalogue (key -> which tiers hold a complete copy, size, pins) and one eviction
policy per tier; it moves bytes only through the :class:`tiers.base.Tier` interface,
so the same code runs the daemon (real media) and ``kvstore simulate``
(:class:`tiers.null.NullTier`, virtual time).

Data flow:

- **Put** reserves room in the first tier that admits the block, evicting there as
  needed; chunks are copied in without the lock; the block becomes visible at commit.
  With ``write_through`` the committed block is also copied to every lower tier.
- **Evict / demote**: a victim chosen by the tier's policy moves to the next tier
  (or is just dropped there if a lower tier already has a copy); the last tier's
  victims are deleted.
- **Get** pins the block, reads it from the fastest tier holding it, unpins, and
  promotes it to the first tier when it came from a lower one (the lower copy stays,
  so demoting it again later is free).
- Pinned blocks are never evicted; a delete of a pinned block hides it at once and
  frees its space when the last reader unpins.

A block that fails its checksum is dropped from that tier and counted in
``corrupt_blocks``; it is served from another tier's copy or reported as a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from tiers.base import ByteRanges, Tier, TierKind, check_chunk, check_ranges

from .errors import CorruptBlock, InvalidRequest, KVStoreError, TierFull, TierIOError
from .keys import KEY_BYTES
from .policy import EvictionPolicy, NoVictim
from .transfer import Transfer, TransferQueues

log = logging.getLogger("kvstore.manager")

WRITE_BACK = "write_back"
WRITE_THROUGH = "write_through"


@dataclass
class Entry:
    """Catalogue record of one visible block."""

    size: int
    tiers: list[int]              # indices of tiers holding a committed copy, ascending
    pins: int = 0
    deleted: bool = False         # hidden; freed when the last reader unpins


@dataclass
class PendingWrite:
    """An open two-phase put: room reserved in ``tier``; invisible until commit."""

    key: bytes
    tier: int
    size: int
    written: int = 0


@dataclass(frozen=True)
class LookupResult:
    """Longest stored prefix of a key list.

    Attributes:
        hit_blocks: number of leading keys that are stored.
        tiers: the fastest tier holding each of those blocks (``hit_blocks`` entries).
    """

    hit_blocks: int
    tiers: tuple[TierKind, ...]


@dataclass(frozen=True)
class GetResult:
    """One block's outcome of a get: ``found`` False is a normal miss."""

    key: bytes
    found: bool
    tier: TierKind | None = None
    data: bytes = b""


@dataclass
class PutOutcome:
    """What :meth:`TierManager.begin_put` decided: the block is already stored, no tier's
    admission policy wants it (``not_admitted``: a normal outcome, nothing stored), or
    room was reserved (``pending``)."""

    key: bytes
    already_present: bool
    pending: PendingWrite | None = None
    not_admitted: bool = False


class _NotAdmitted(Exception):
    """No tier's admission policy accepted the block (internal to the manager)."""


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
        promote_on_get: copy blocks served from a lower tier into the first tier.
        writer_wait_s: how long a put of a key that another client is writing waits
            for that write to finish (seconds).
        async_moves: run tier-to-tier copies on background transfer queues, one per
            (source, destination) pair, with the manager lock released during the I/O
            (the daemon). False: copies run inline in the calling thread, which keeps
            the simulator deterministic.
        transfer_timeout_s: a demotion that the evicting thread waits on longer than
            this is marked failed: its source pin is released and the eviction fails
            with TierIOError (seconds).
    """

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy],
                 write_policy: str = WRITE_BACK, clock: Callable[[], float] = time.monotonic,
                 promote_on_get: bool = True, writer_wait_s: float = 30.0,
                 async_moves: bool = False, transfer_timeout_s: float = 30.0):
        if not tiers:
            raise ValueError("the manager needs at least one tier")
        if len(tiers) != len(policies):
            raise ValueError("one eviction policy per tier is needed")
        if write_policy not in (WRITE_BACK, WRITE_THROUGH):
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.write_policy = write_policy
        self.clock = clock
        self.promote_on_get = promote_on_get
        self.writer_wait_s = writer_wait_s
        self.counters: Counter[str] = Counter()
        self._entries: dict[bytes, Entry] = {}
        self._pending: dict[bytes, PendingWrite] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._moving: dict[tuple[bytes, int], Transfer] = {}
        self.transfer_timeout_s = transfer_timeout_s
        self._queues = TransferQueues() if async_moves else None
        self._recover()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        now = self.clock()
        for i, tier in enumerate(self.tiers):
            for key, nbytes in tier.recover():
                entry = self._entries.get(key)
                if entry is None:
                    self._entries[key] = Entry(size=nbytes, tiers=[i])
                elif entry.size == nbytes:
                    entry.tiers.append(i)
                else:
                    log.warning("block %s has %d bytes in %s but %d elsewhere; dropping the %s copy",
                                key.hex()[:16], nbytes, tier.name, entry.size, tier.name)
                    tier.free(key)
                    continue
                self.policies[i].insert(key, nbytes, now)
                self.counters["blocks_recovered"] += 1

    @property
    def lock(self) -> threading.RLock:
        """The catalogue lock: hold it to see (and change) a consistent placement."""
        return self._lock

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            e = self._entries.get(key)
            return e is not None and not e.deleted

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.deleted)

    def tier_of(self, key: bytes) -> TierKind | None:
        """Fastest tier holding ``key``, or None when not stored."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.deleted:
                return None
            return self.tiers[e.tiers[0]].kind

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of ``keys`` that is stored, and the fastest tier of each hit.

        Does not count as an access for the eviction policies (the Get that follows does).
        """
        tiers: list[TierKind] = []
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.deleted:
                    break
                tiers.append(self.tiers[e.tiers[0]].kind)
        self.counters["lookups"] += 1
        return LookupResult(len(tiers), tuple(tiers))

    def usage(self) -> list[TierUsage]:
        with self._lock:
            return [TierUsage(t.kind, t.name, t.capacity_bytes, t.used_bytes, len(t), p.name)
                    for t, p in zip(self.tiers, self.policies)]

    # ------------------------------------------------------------------ eviction

    def _evictable(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and e.pins == 0

    def _make_room(self, i: int, nbytes: int, incoming: bytes | None) -> None:
        """Evict from tier ``i`` until ``nbytes`` fit. Raises TierFull / NoVictim."""
        tier, policy = self.tiers[i], self.policies[i]
        limit = getattr(tier, "max_block_bytes", tier.capacity_bytes)
        if nbytes > limit:
            raise TierFull(f"{tier.name}: a {nbytes}-byte block exceeds the largest block the tier "
                           f"can hold ({limit} bytes)")
        if tier.fits(nbytes):
            return
        leased = getattr(tier, "is_leased", None)   # HBM: blocks lent to workers by CUDA IPC
        evictable = self._evictable if leased is None else (lambda k: self._evictable(k) and not leased(k))
        now = self.clock()
        while not tier.fits(nbytes):
            victim = policy.victim(evictable, incoming=incoming, now=now)
            self._evict(i, victim)

    def _evict(self, i: int, key: bytes) -> None:
        """Move ``key`` out of tier ``i``: demote it to the next tier, or drop it.

        Called with the lock held. With async moves the copy runs on the (i, i+1)
        transfer queue while this thread waits with the lock released; the block stays
        pinned meanwhile. If a reader pinned it during the copy, its tier-``i`` copy is
        kept (now clean) and the caller simply picks another victim.

        Raises TierIOError when the demotion fails or times out (the block is kept).
        """
        entry = self._entries[key]
        lower = [j for j in entry.tiers if j > i]
        if not lower and i + 1 < len(self.tiers):
            for attempt in (1, 2):
                try:
                    t = self._start_transfer(key, entry, i, i + 1)
                except TierIOError:
                    raise
                except (TierFull, NoVictim) as e:
                    # The next tier cannot take it (full of pinned blocks, or the block is
                    # larger than it): the block is dropped from the store, and counted.
                    log.warning("demotion of block %s to %s impossible (%s); dropping it",
                                key.hex()[:16], self.tiers[i + 1].name, e)
                    self.counters["demotions_failed"] += 1
                    break
                self._run_transfer(t, wait=True)
                if t.ok:
                    self.counters["demotions"] += 1
                    if self._entries.get(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read again while it was copied: keep the clean copy
                    break
                self.counters["demotions_failed"] += 1
                if isinstance(t.error, TierFull) and attempt == 1:
                    continue   # the disk filled up: the tier now evicts to fit, so retry once
                cls = TierFull if isinstance(t.error, TierFull) else TierIOError
                raise cls(f"demotion of block {key.hex()[:16]} from {self.tiers[i].name} to "
                          f"{self.tiers[i + 1].name} failed: {t.error}")
        self.tiers[i].free(key)
        self.policies[i].evicted(key)
        entry.tiers.remove(i)
        self.counters[f"evictions_{self.tiers[i].name}"] += 1
        if not entry.tiers:
            del self._entries[key]
            self.counters["blocks_dropped"] += 1

    # ------------------------------------------------------------------ transfers

    def _start_transfer(self, key: bytes, entry: Entry, src: int, dst: int,
                        data: bytes | None = None) -> Transfer:
        """Reserve room in ``dst`` and pin the block: phase one of a copy. Lock held.

        Returns the transfer already in flight for ``(key, dst)`` if there is one.
        Raises TierFull / NoVictim when ``dst`` cannot make room.
        """
        existing = self._moving.get((key, dst))
        if existing is not None:
            if existing.abandoned:
                raise TierIOError(f"an earlier copy of block {key.hex()[:16]} to {self.tiers[dst].name} "
                                  "is stuck (timed out); not retrying until it returns")
            return existing
        if dst in entry.tiers:
            return Transfer.finished(key, src, dst)
        entry.pins += 1  # the source copy must stay while room is made below and bytes move
        try:
            self._make_room(dst, entry.size, incoming=key)
            self.tiers[dst].reserve(key, entry.size)
        except BaseException:
            self._unpin_locked(key, entry)
            raise
        t = Transfer(key, src, dst, entry, data=data)
        self._moving[(key, dst)] = t
        return t

    def _run_transfer(self, t: Transfer, wait: bool) -> None:
        """Phase two: copy the bytes, then commit. Lock held on entry.

        Inline mode copies in this thread. Async mode hands the copy to the
        ``(src, dst)`` queue; with ``wait`` the lock is released until it finishes or
        ``transfer_timeout_s`` passes (then it is abandoned: marked failed, unpinned).
        """
        if t.done.is_set():
            return
        if self._queues is None:
            self._copy_bytes(t)
            return
        if not t.submitted:
            t.submitted = True
            self._queues.submit(t.src, t.dst, lambda: self._copy_bytes(t))
        if not wait:
            return
        deadline = time.monotonic() + self.transfer_timeout_s
        while not t.done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon(t)
                return
            self._changed.wait(remaining)

    def _copy_bytes(self, t: Transfer) -> None:
        """Copy a pinned block's bytes from ``t.src`` to the reservation in ``t.dst``.

        Runs without the lock in async mode (the source is pinned, the destination
        reserved), then commits under it.
        """
        err: BaseException | None = None
        try:
            _move_bytes(self.tiers[t.src], self.tiers[t.dst], t.key, t.data)
        except BaseException as e:  # noqa: BLE001 - reported through the transfer
            err = e
        with self._lock:
            self._finish_transfer(t, err)

    def _finish_transfer(self, t: Transfer, err: BaseException | None) -> None:
        self._moving.pop((t.key, t.dst), None)
        dst = self.tiers[t.dst]
        if err is None and not t.abandoned:
            try:
                dst.commit(t.key)
            except BaseException as e:  # noqa: BLE001
                err = e
        if err is not None or t.abandoned:
            dst.abort(t.key)
            t.error = err or TimeoutError(f"transfer exceeded {self.transfer_timeout_s}s")
            self.counters["transfers_failed"] += 1
            log.warning("copy of block %s from %s to %s failed: %s", t.key.hex()[:16],
                        self.tiers[t.src].name, dst.name, t.error)
        else:
            self.policies[t.dst].insert(t.key, t.entry.size, self.clock())
            t.entry.tiers.append(t.dst)
            t.entry.tiers.sort()
            t.ok = True
        if not t.abandoned:
            self._unpin_locked(t.key, t.entry)
        t.done.set()
        self._changed.notify_all()

    def _abandon(self, t: Transfer) -> None:
        """A transfer outlived its timeout: release its source pin now (lock held).

        The destination reservation is dropped when the stuck I/O returns.
        """
        if t.abandoned or t.done.is_set():
            return
        t.abandoned = True
        t.error = TimeoutError(f"transfer did not finish in {self.transfer_timeout_s}s")
        self.counters["transfers_timed_out"] += 1
        self._unpin_locked(t.key, t.entry)

    def _copy(self, key: bytes, entry: Entry, src: int, dst: int,
              data: memoryview | bytes | None = None) -> None:
        """Copy a committed block from tier ``src`` (or ``data``) into tier ``dst`` and
        wait for it. Lock held. Raises TierFull / NoVictim / TierIOError."""
        t = self._start_transfer(key, entry, src, dst, data=data)
        self._run_transfer(t, wait=True)
        if not t.ok:
            raise TierIOError(f"copy of block {key.hex()[:16]} to {self.tiers[dst].name} failed: {t.error}")

    def _promote_later(self, key: bytes, src: int, data: bytes) -> None:
        """Copy bytes just read from tier ``src`` into tier 0 on the ``(src, 0)`` queue.

        The Get that read them returns at once; room in tier 0 is made by the queue worker.
        """
        def job() -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is None or entry.deleted or 0 in entry.tiers or (key, 0) in self._moving:
                    return
                try:
                    t = self._start_transfer(key, entry, src, 0, data=data)
                except (KVStoreError, NoVictim) as e:
                    self.counters["promotions_skipped"] += 1
                    log.debug("promotion of %s skipped: %s", key.hex()[:16], e)
                    return
            self._copy_bytes(t)
            if t.ok:
                self.counters["promotions"] += 1

        try:
            self._queues.submit(src, 0, job)
        except RuntimeError:   # queues stopped: the manager is closing
            log.debug("promotion of %s skipped: transfer queues are stopped", key.hex()[:16])

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued transfer has finished (tests, shutdown)."""
        if self._queues is not None:
            self._queues.drain(timeout)

    # ------------------------------------------------------------------ put

    def begin_put(self, key: bytes, nbytes: int) -> PutOutcome:
        """Phase one of a put: reserve room for a ``nbytes``-byte block.

        Returns ``already_present=True`` (and touches the block) when it is stored
        already; waits for another client's in-flight write of the same key.
        Raises:
            InvalidRequest: bad key length or size.
            TierFull: no tier has or can make room.
            TimeoutError: another client's write of the key did not finish in time.
        """
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
        if nbytes <= 0:
            raise InvalidRequest(f"block size must be > 0 bytes, got {nbytes}")
        deadline = time.monotonic() + self.writer_wait_s
        with self._lock:
            while True:
                e = self._entries.get(key)
                if e is not None and not e.deleted:
                    self._touch(key, e)
                    self.counters["puts_already_present"] += 1
                    return PutOutcome(key, already_present=True)
                if key not in self._pending and e is None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"block {key.hex()[:16]} is still being written or read by another client")
                self._changed.wait(remaining)
            # Claim the key before making room: _make_room may release the lock while it
            # waits on a demotion, and a second put of the same key must wait, not reserve.
            pending = PendingWrite(key, -1, nbytes)
            self._pending[key] = pending
            try:
                pending.tier = self._reserve_somewhere(key, nbytes)
            except _NotAdmitted:
                del self._pending[key]
                self._changed.notify_all()
                self.counters["puts_not_admitted"] += 1
                return PutOutcome(key, already_present=False, not_admitted=True)
            except BaseException:
                del self._pending[key]
                self._changed.notify_all()
                raise
            return PutOutcome(key, already_present=False, pending=pending)

    def _reserve_somewhere(self, key: bytes, nbytes: int) -> int:
        """Reserve ``nbytes`` for ``key`` in the fastest tier that admits it. Lock held.

        Returns the tier index. Raises TierFull when no tier has or can make room,
        _NotAdmitted when no tier's policy admits the block.
        """
        errors = []
        now = self.clock()
        admitted = False
        for i, tier in enumerate(self.tiers):
            if not self.policies[i].admit(key, nbytes, now):
                continue
            admitted = True
            for _attempt in range(3):   # room made while the lock was released may be taken
                try:
                    self._make_room(i, nbytes, incoming=key)
                    tier.reserve(key, nbytes)
                    return i
                except TierIOError as err:
                    if not isinstance(err, TierFull):
                        raise
                    errors.append(f"{tier.name}: {err}")
                except (TierFull, NoVictim) as err:
                    errors.append(f"{tier.name}: {err}")
                    if nbytes > getattr(tier, "max_block_bytes", tier.capacity_bytes) or isinstance(err, NoVictim):
                        break
        if not admitted:
            raise _NotAdmitted()
        self.counters["puts_rejected_full"] += 1
        raise TierFull(f"no tier can hold a {nbytes}-byte block: " + "; ".join(errors[-3:]))

    def write_chunk(self, pending: PendingWrite, offset: int, data: memoryview | bytes) -> None:
        """Copy one chunk of an open put (in order). Runs without the manager lock.

        Raises InvalidRequest for an out-of-order or oversize chunk.
        """
        n = len(data)
        try:
            check_chunk(offset, n, pending.written, pending.size)
            self.tiers[pending.tier].write(pending.key, offset, data)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        pending.written += n

    def commit_put(self, pending: PendingWrite) -> None:
        """Phase two: make a fully written block visible (and write it through).

        Raises InvalidRequest when fewer bytes than declared were written (the put is
        aborted); TierIOError when the medium fails (aborted too).
        """
        if pending.written != pending.size:
            self.abort_put(pending)
            raise InvalidRequest(f"block {pending.key.hex()[:16]}: {pending.written} of {pending.size} "
                                 "declared bytes received")
        with self._lock:
            tier = self.tiers[pending.tier]
            try:
                tier.commit(pending.key)
            except BaseException:
                self._pending.pop(pending.key, None)
                tier.abort(pending.key)
                self._changed.notify_all()
                raise
            self._pending.pop(pending.key, None)
            entry = Entry(size=pending.size, tiers=[pending.tier])
            self._entries[pending.key] = entry
            self.policies[pending.tier].insert(pending.key, pending.size, self.clock())
            self.counters["blocks_put"] += 1
            self.counters["bytes_put"] += pending.size
            self._changed.notify_all()
            if self.write_policy == WRITE_THROUGH:
                for j in range(pending.tier + 1, len(self.tiers)):
                    # acknowledged only once every lower copy exists (crash-safe)
                    try:
                        self._copy(pending.key, entry, pending.tier, j)
                        self.counters["write_through_copies"] += 1
                    except (TierFull, NoVictim, TierIOError) as e:
                        log.warning("write-through of %s to %s failed: %s",
                                    pending.key.hex()[:16], self.tiers[j].name, e)
                        self.counters["write_through_failed"] += 1

    def abort_put(self, pending: PendingWrite) -> None:
        """Drop an open put and its reserved room. Safe to call twice."""
        with self._lock:
            if self._pending.get(pending.key) is pending:
                del self._pending[pending.key]
                self.tiers[pending.tier].abort(pending.key)
                self.counters["puts_aborted"] += 1
                self._changed.notify_all()

    def put(self, key: bytes, data: bytes | memoryview) -> bool:
        """Store a whole block in one call. Returns False when it was already stored or no
        tier admitted it."""
        outcome = self.begin_put(key, len(data))
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

    # ------------------------------------------------------------------ get

    def _touch(self, key: bytes, entry: Entry) -> None:
        now = self.clock()
        for i in entry.tiers:
            self.policies[i].access(key, now)

    def _pin(self, key: bytes) -> Entry | None:
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.deleted:
                return None
            e.pins += 1
            self._touch(key, e)
            return e

    def _unpin(self, key: bytes, entry: Entry) -> None:
        with self._lock:
            self._unpin_locked(key, entry)

    def _unpin_locked(self, key: bytes, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            if entry.deleted:
                self._free_entry(key, entry)
            self._changed.notify_all()

    def get(self, key: bytes, ranges: ByteRanges | None = None) -> GetResult:
        """Read one block (or ``ranges`` of it).

        Returns a ``found=False`` result on a miss, including when every stored copy
        failed its checksum (those copies are dropped and counted in ``corrupt_blocks``).
        Raises InvalidRequest for a bad key length or out-of-bounds ranges.
        """
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
        entry = self._pin(key)
        if entry is None:
            self.counters["get_misses"] += 1
            return GetResult(key, False)
        try:
            try:
                check_ranges(ranges, entry.size)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            while entry.tiers:
                i = entry.tiers[0]
                tier = self.tiers[i]
                try:
                    whole = tier.read(key)
                except (CorruptBlock, TierIOError) as e:
                    log.warning("dropping %s copy of block %s: %s", tier.name, key.hex()[:16], e)
                    self.counters["corrupt_blocks" if isinstance(e, CorruptBlock) else "read_errors"] += 1
                    self._drop_copy(key, entry, i)
                    continue
                self.counters[f"hits_{tier.name}"] += 1
                if i > 0 and self.promote_on_get:
                    self._promote_after_read(key, entry, whole)
                data = whole if not ranges else b"".join(whole[o:o + n] for o, n in ranges)
                return GetResult(key, True, tier.kind, data)
            self.counters["get_misses"] += 1
            return GetResult(key, False)
        finally:
            self._unpin(key, entry)

    def get_many(self, keys: Iterable[bytes], ranges: ByteRanges | None = None,
                 stop_at_miss: bool = False) -> Iterable[GetResult]:
        """Yield :meth:`get` for each key; with ``stop_at_miss`` stop after the first miss."""
        for key in keys:
            result = self.get(key, ranges)
            yield result
            if stop_at_miss and not result.found:
                return

    def _drop_copy(self, key: bytes, entry: Entry, i: int) -> None:
        with self._lock:
            if i in entry.tiers:
                entry.tiers.remove(i)
                self.policies[i].remove(key)
                try:
                    self.tiers[i].free(key)
                except KeyError:
                    pass
            if not entry.tiers and self._entries.get(key) is entry:
                del self._entries[key]

    def _promote_after_read(self, key: bytes, entry: Entry, data: bytes) -> None:
        if self._queues is not None:
            # the Get returns now; the (src, 0) queue makes room and copies the bytes read
            self._promote_later(key, entry.tiers[0], data)
            return
        with self._lock:
            if entry.deleted or 0 in entry.tiers:
                return
            try:
                self._copy(key, entry, entry.tiers[0], 0, data=data)
                self.counters["promotions"] += 1
            except (KVStoreError, NoVictim) as e:
                log.debug("promotion of %s skipped: %s", key.hex()[:16], e)
                self.counters["promotions_skipped"] += 1

    def promote(self, key: bytes, to: int = 0) -> bool:
        """Copy a stored block up into tier ``to`` (prefetch). Returns True when it is there now.

        Never evicts pinned blocks; returns False when the block is unknown or no room
        can be made.
        """
        entry = self._pin(key)
        if entry is None:
            return False
        try:
            with self._lock:
                if to in entry.tiers:
                    return True
                src = entry.tiers[0]
                try:
                    self._copy(key, entry, src, to)
                except (KVStoreError, NoVictim):
                    return False
                self.counters["promotions"] += 1
                return True
        finally:
            self._unpin(key, entry)

    def demote(self, key: bytes, frm: int = 0) -> bool:
        """Move a block out of tier ``frm`` (to the next tier). False if absent there or pinned."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.deleted or frm not in e.tiers or e.pins:
                return False
            leased = getattr(self.tiers[frm], "is_leased", None)
            if leased is not None and leased(key):
                return False
            self._evict(frm, key)
            return True

    # ------------------------------------------------------------------ delete

    def _free_entry(self, key: bytes, entry: Entry) -> None:
        for i in entry.tiers:
            self.tiers[i].free(key)
            self.policies[i].remove(key)
        entry.tiers.clear()
        if self._entries.get(key) is entry:
            del self._entries[key]
        self._changed.notify_all()

    def delete(self, keys: Iterable[bytes]) -> int:
        """Delete blocks from every tier. Returns how many were stored.

        A block being read is hidden at once and freed when its last reader finishes.
        """
        deleted = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.deleted:
                    continue
                deleted += 1
                if e.pins:
                    e.deleted = True
                else:
                    self._free_entry(key, e)
        self.counters["blocks_deleted"] += deleted
        return deleted

    def persist(self, timeout: float = 60.0) -> int:
        """Copy every block held only in volatile tiers down to the last tier (NVMe), so a
        graceful stop keeps them. Bounded by ``timeout`` seconds; returns blocks copied.

        Does nothing when the last tier is not NVMe. Blocks that do not fit are left (the
        last tier's own policy decides what it keeps while room is made).
        """
        last = len(self.tiers) - 1
        if last == 0 or self.tiers[last].kind != TierKind.NVME:
            return 0
        deadline = time.monotonic() + timeout
        copied = 0
        with self._lock:
            todo = [k for k, e in self._entries.items() if not e.deleted and last not in e.tiers]
            for key in todo:
                if time.monotonic() > deadline:
                    log.warning("persist: time is up; %d blocks stay only in memory", len(todo) - copied)
                    break
                entry = self._entries.get(key)
                if entry is None or entry.deleted or last in entry.tiers:
                    continue
                try:
                    self._copy(key, entry, entry.tiers[0], last)
                    copied += 1
                except (KVStoreError, NoVictim) as e:
                    log.debug("persist of %s skipped: %s", key.hex()[:16], e)
        self.counters["blocks_persisted"] += copied
        return copied

    def close(self) -> None:
        """Finish queued transfers, stop the queues and close every tier."""
        if self._queues is not None:
            self._queues.stop(timeout=self.transfer_timeout_s)
        for tier in self.tiers:
            tier.close()


def _device_array(tier: Tier, key: bytes):
    """``tier``'s bytes of block ``key`` as a CUDA array (``__cuda_array_interface__``), or
    None when the tier has no device memory (host, NVMe, the HBM tier's CPU stand-in)."""
    get = getattr(tier, "device_array", None)
    buf = get(key) if get is not None else None
    return buf if hasattr(buf, "__cuda_array_interface__") else None


def _move_bytes(src: Tier, dst: Tier, key: bytes, data: memoryview | bytes | None) -> None:
    """Fill ``dst``'s reservation of block ``key`` from ``src`` (or from ``data``, bytes
    already read); the caller commits.

    Device path, chosen by capability: when one side holds the block in device memory
    (``device_array`` gives a CUDA array) and the other moves files to and from device
    memory (``device_io``: the NVMe tier with kvikio), HBM -> NVMe is
    ``dst.write_device(key, src.device_array(key))`` and NVMe -> HBM is
    ``src.read_into_device(key, dst.device_array(key))`` then ``dst.mark_written``.
    Otherwise (every pair on a CPU machine) the host path: ``dst.write(key, 0, src.view(key))``.
    """
    if data is None:
        if getattr(dst, "device_io", False):
            buf = _device_array(src, key)
            if buf is not None:
                dst.write_device(key, buf)
                return
        if getattr(src, "device_io", False) and hasattr(dst, "mark_written"):
            buf = _device_array(dst, key)
            if buf is not None:
                dst.mark_written(key, src.read_into_device(key, buf))
                return
        data = src.view(key)
    dst.write(key, 0, data)
