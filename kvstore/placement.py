"""Block movement between tiers: eviction, demotion, promotion, background cleaning.

Tiers are ordered fastest first. A tier that needs room asks its eviction policy for a
victim; the victim is **demoted** (copied to the next tier, then freed here) or, when
the next tier already holds a copy (the block is *clean*), simply freed; the last
tier's victims leave the store. A block read from a lower tier is **promoted** (copied
up; the lower copy stays, so a later demotion is free). Every copy is one
:class:`kvstore.mover.Transfer`, deduplicated per ``(block, destination)``.

**Off the put path** (``async_moves``, the daemon): a :class:`Cleaner` thread watches
each tier's watermarks. When a tier other than the last holds more than
``high_watermark`` of its capacity, it copies its coldest dirty blocks down until the
free and clean bytes reach ``1 - low_watermark`` of the capacity: in the tier policy's
order while its next dirty block is near the front (:data:`CLEAN_SCAN`), else the least
recently used dirty block (a per-tier list of dirty blocks kept in access order), so a
tier whose coldest blocks are all clean already costs no scan per cleaned block. A put
into a full tier then evicts a clean block, which costs a free and no I/O; it waits
for a demotion only when no clean block is left (a burst faster than the disk),
bounded by ``transfer_timeout_s``. The last tier's victims leave the store, which
costs a free (no copy), so they are evicted when a put needs the room and the last tier
keeps its whole capacity. Without ``async_moves`` (the simulator) every eviction runs
inline, in pure policy order.

All methods whose name has no ``_locked`` suffix take the catalogue lock themselves;
``*_locked`` ones expect it held. Waiting on a transfer releases it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Iterator, Sequence

from tiers import errors as terr
from tiers.base import Tier

from .catalogue import BlockEvent, Catalogue, Entry
from .counters import Counters
from .errors import TierFull, TierIOError
from .mover import Mover, Transfer
from .policy import EvictionPolicy, NoVictim

log = logging.getLogger("kvstore.placement")

CLEAN_SCAN = 256
"""Blocks the cleaner lets a policy look at to find its next dirty victim before it
takes the least recently used dirty block instead."""

CLEAN_WAIT_S = 5.0
"""How long a put that found no clean victim waits for the cleaner's demotions before it
demotes a block itself (seconds)."""


class Placement:
    """Moves blocks between ``tiers`` under their ``policies``.

    Args:
        tiers: fastest first; policies: one per tier.
        catalogue: the block catalogue (its lock guards every decision here).
        mover: copies bytes between tiers.
        counters: the daemon's counters.
        clock: time for the policies (seconds; virtual in the simulator).
        transfer_timeout_s: a copy that an evicting thread waits on longer than this is
            abandoned (its pin released) and the eviction fails with TierIOError.
        watermarks: ``(low, high)`` fractions of each tier's capacity (background cleaning).
        promote_on_get: a read from a lower tier asks for a promotion into tier 0.
    """

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 mover: Mover, counters: Counters, clock: Callable[[], float], transfer_timeout_s: float,
                 watermarks: tuple[float, float] = (0.85, 0.95), promote_on_get: bool = True):
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.cat = catalogue
        self.mover = mover
        self.counters = counters
        self.clock = clock
        self.transfer_timeout_s = transfer_timeout_s
        self.low, self.high = watermarks
        self.promote_on_get = promote_on_get
        self.last = len(self.tiers) - 1
        self.clean_first = mover.async_moves
        self._moving: dict[tuple[bytes, int], Transfer] = {}
        self._resident = [0] * len(self.tiers)      # payload bytes of committed copies per tier
        self._dirty = [0] * len(self.tiers)         # of which held by no lower tier
        self._dirty_keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.tiers]
        """Per tier, its dirty blocks, least recently used first."""
        self.cleaner: Cleaner | None = None

    # ------------------------------------------------------------------ bookkeeping

    def _dirty_tier(self, entry: Entry) -> int:
        top = entry.tiers[-1] if entry.tiers else -1
        return top if 0 <= top < self.last else -1

    def _retier(self, entry: Entry, change: Callable[[], object]) -> object:
        before = self._dirty_tier(entry)
        result = change()
        after = self._dirty_tier(entry)
        if before != after:
            if before >= 0:
                self._dirty[before] -= entry.size
                self._dirty_keys[before].pop(entry.key, None)
            if after >= 0:
                self._dirty[after] += entry.size
                self._dirty_keys[after][entry.key] = None
        return result

    def added(self, entry: Entry, i: int, reason: str, meta=None) -> None:
        """Record a new committed copy of ``entry`` in tier ``i`` (lock held)."""
        self._resident[i] += entry.size
        self.counters.inc(f"stored_bytes_{self.tiers[i].name}", entry.size)
        if self.cat.events.active:
            self.cat.events.emit(BlockEvent("stored", entry.key, self.tiers[i].name, self.tiers[i].kind,
                                            entry.size, reason, meta=meta or entry.meta))

    def new_entry(self, key: bytes, size: int, i: int, reason: str, meta=None) -> Entry:
        """A new block with its first copy in tier ``i`` (lock held). ``meta``: the put's
        :class:`kvstore.types.BlockMeta` (kept without its token ids)."""
        entry = self.cat.add(key, size, i)
        if meta is not None:
            entry.meta = replace(meta, token_ids=()) if meta.token_ids else meta
        if i < self.last:
            self._dirty[i] += size
            self._dirty_keys[i][key] = None
        self.added(entry, i, reason, meta)
        return entry

    def add_copy(self, entry: Entry, i: int, reason: str) -> None:
        self._retier(entry, lambda: self.cat.add_copy(entry, i))
        self.added(entry, i, reason)

    def drop_copy(self, entry: Entry, i: int, reason: str, policy: str = "") -> bool:
        """Free ``entry``'s copy in tier ``i`` and forget it (lock held). True when it was
        the last copy (the block left the store)."""
        try:
            self.tiers[i].free(entry.key)
        except terr.BlockNotStored:
            pass
        except terr.TierError as e:
            log.warning("freeing block %s in %s failed: %s", entry.key.hex()[:16], self.tiers[i].name, e)
        if reason == "evicted":
            self.policies[i].evicted(entry.key)
        else:
            self.policies[i].remove(entry.key)
        self._resident[i] -= entry.size
        last = self._retier(entry, lambda: self.cat.drop_copy(entry, i))
        if self.cat.events.active:
            self.cat.events.emit(BlockEvent("removed", entry.key, self.tiers[i].name, self.tiers[i].kind,
                                            entry.size, reason, policy=policy, last_copy=bool(last),
                                            meta=entry.meta))
        return bool(last)

    def free_entry(self, entry: Entry, reason: str) -> None:
        """Free every copy of ``entry`` (lock held)."""
        for i in list(entry.tiers):
            self.drop_copy(entry, i, reason)
        self.cat.forget(entry)

    def touch(self, entry: Entry) -> None:
        """An access to ``entry`` for the policies of every tier holding it (lock held)."""
        now = self.clock()
        for i in entry.tiers:
            self.policies[i].access(entry.key, now)
        d = self._dirty_tier(entry)
        if d >= 0 and entry.key in self._dirty_keys[d]:
            self._dirty_keys[d].move_to_end(entry.key)

    def count_read(self, tier: Tier, nbytes: int, block: bool = True) -> None:
        """Count ``nbytes`` served from ``tier``; ``block``: and one block read (False for
        the further pieces of a block read in several)."""
        c = self.counters
        if block:
            c.inc("reads")
            c.inc(f"reads_{tier.name}")
        c.inc("read_bytes", nbytes)
        c.inc(f"read_bytes_{tier.name}", nbytes)

    def kick_if_full(self, i: int) -> None:
        """Wake the cleaner when tier ``i`` passed its high watermark."""
        tier = self.tiers[i]
        if self.cleaner is not None and tier.used_bytes > self.high * tier.capacity_bytes:
            self.cleaner.kick()

    def resident_bytes(self, i: int) -> int:
        return self._resident[i]

    def dirty_bytes(self, i: int) -> int:
        return self._dirty[i]

    def dirty_keys(self, i: int) -> Iterator[bytes]:
        """Tier ``i``'s dirty blocks (held by no lower tier), least recently used first
        (lock held; do not change placement while iterating)."""
        return iter(self._dirty_keys[i])

    # ------------------------------------------------------------------ eviction

    def evictable(self, key: bytes) -> bool:
        e = self.cat.raw(key)
        return e is not None and e.pins == 0

    def _clean_in(self, i: int) -> Callable[[bytes], bool]:
        raw = self.cat.raw

        def clean(key: bytes) -> bool:
            e = raw(key)
            return e is not None and e.pins == 0 and (i == self.last or e.tiers[-1] > i)
        return clean

    def make_room_locked(self, i: int, nbytes: int, incoming: bytes | None) -> None:
        """Evict from tier ``i`` until ``nbytes`` fit. Raises TierFull, NoVictim, TierIOError."""
        tier, policy = self.tiers[i], self.policies[i]
        if nbytes > tier.max_block_bytes:
            raise TierFull(f"{tier.name}: a {nbytes}-byte block exceeds the largest block the tier "
                           f"can hold ({tier.max_block_bytes} bytes)")
        now = self.clock()
        clean = self._clean_in(i) if self.clean_first and i < self.last else None
        waited_until = None
        while not tier.fits(nbytes):
            victim = None
            if clean is not None:
                try:
                    victim = policy.victim(clean, incoming=incoming, now=now)
                except NoVictim:
                    if self.cleaner is not None and tier.used_bytes > self.high * tier.capacity_bytes:
                        # the cleaner demotes several blocks at once: wait for one to be
                        # clean rather than demoting a single block here, for a while
                        if waited_until is None:
                            self.cleaner.kick()
                            waited_until = time.monotonic() + min(self.transfer_timeout_s, CLEAN_WAIT_S)
                        if time.monotonic() < waited_until and self.cleaner.busy:
                            self.cat.changed.wait(0.05)
                            continue
            if victim is None:
                victim = policy.victim(self.evictable, incoming=incoming, now=now)
            self.evict_locked(i, victim)

    def evict_locked(self, i: int, key: bytes, reason: str = "evicted") -> None:
        """Move ``key`` out of tier ``i``: demote it to the next tier, or drop it.

        With async moves the copy runs on the (i, i+1) queue while this thread waits with
        the lock released; the block stays pinned meanwhile. If a reader pinned it during
        the copy, its tier-``i`` copy is kept (now clean) and the caller picks again.
        Raises TierIOError (the block is kept) or TierFull when the demotion fails.
        """
        entry = self.cat.raw(key)
        if entry is None:
            return
        if not any(j > i for j in entry.tiers) and i < self.last:
            # The cluster is best effort: when it cannot take the block, it is dropped as
            # if there were no tier below, so a dead cluster never fails a local put.
            best_effort = self.tiers[i + 1].capabilities.remote is not None
            for attempt in (1, 2):
                try:
                    t = self.start_transfer_locked(entry, i, i + 1, "demoted")
                except TierIOError as e:
                    if not best_effort:
                        raise
                    log.debug("demotion of block %s to %s failed (%s); dropping it", key.hex()[:16],
                              self.tiers[i + 1].name, e)
                    self.counters.inc("demotions_failed")
                    break
                except (TierFull, NoVictim) as e:
                    log.warning("demotion of block %s to %s impossible (%s); dropping it",
                                key.hex()[:16], self.tiers[i + 1].name, e)
                    self.counters.inc("demotions_failed")
                    break
                self.run_transfer(t, wait=True)
                if t.ok:
                    self.counters.inc("demotions")
                    if self.cat.raw(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read again while it was copied: keep the clean copy
                    break
                if self.cat.raw(key) is not entry or entry.deleted:
                    return  # deleted while it was copied: nothing to demote, its room is free
                self.counters.inc("demotions_failed")
                if isinstance(t.error, terr.TierFull) and attempt == 1:
                    continue   # the disk filled up: the tier now evicts to fit, so retry once
                if best_effort:
                    log.debug("demotion of block %s to %s failed (%s); dropping it", key.hex()[:16],
                              self.tiers[i + 1].name, t.error)
                    if self.cat.raw(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read while the copy was tried: keep it
                    break
                cls = TierFull if isinstance(t.error, terr.TierFull) else TierIOError
                raise cls(f"demotion of block {key.hex()[:16]} from {self.tiers[i].name} to "
                          f"{self.tiers[i + 1].name} failed: {t.error}")
        self.counters.inc(f"evictions_{self.tiers[i].name}")
        if self.drop_copy(entry, i, reason, policy=self.policies[i].name):
            self.counters.inc("blocks_dropped")

    def reserve_locked(self, i: int, key: bytes, nbytes: int, incoming: bytes | None) -> None:
        """Make room in tier ``i`` and reserve ``nbytes`` for ``key`` (a few tries: room made
        while the lock was released may be taken). Raises TierFull, NoVictim, TierIOError."""
        tier = self.tiers[i]
        for attempt in range(3):
            self.make_room_locked(i, nbytes, incoming)
            try:
                tier.reserve(key, nbytes)
                return
            except terr.TierFull as e:
                if attempt == 2 or nbytes > tier.max_block_bytes:
                    raise TierFull(f"{tier.name}: {e}") from None
            except terr.TierIOError as e:
                raise TierIOError(f"{tier.name}: reserving {nbytes} bytes failed: {e}") from None

    # ------------------------------------------------------------------ transfers

    def moving(self, key: bytes, dst: int) -> Transfer | None:
        return self._moving.get((key, dst))

    def start_transfer_locked(self, entry: Entry, src: int, dst: int, reason: str) -> Transfer:
        """Phase one of a copy: pin the block, make room in ``dst`` and reserve it.

        Returns the transfer already in flight for ``(key, dst)`` if there is one.
        Raises TierFull / NoVictim when ``dst`` cannot make room, TierIOError when an
        earlier copy of the block to ``dst`` is stuck.
        """
        key = entry.key
        existing = self._moving.get((key, dst))
        if existing is not None:
            if existing.abandoned:
                raise TierIOError(f"an earlier copy of block {key.hex()[:16]} to {self.tiers[dst].name} "
                                  "is stuck (timed out); not retrying until it returns")
            return existing
        if dst in entry.tiers:
            return Transfer.finished(key, src, dst)
        # Registered before room is made: making room may release the lock while it waits
        # on a demotion, and another copy of this block to ``dst`` must join this one.
        t = Transfer(key, src, dst, entry, reason=reason)
        self._moving[(key, dst)] = t
        entry.pins += 1  # the source copy must stay while room is made below and bytes move
        try:
            self.reserve_locked(dst, key, entry.size, incoming=key)
        except BaseException as e:
            self._moving.pop((key, dst), None)
            t.error = e
            t.done.set()
            self.cat.unpin(entry)
            self.cat.changed.notify_all()
            raise
        t.reserved = True
        return t

    def run_transfer(self, t: Transfer, wait: bool) -> None:
        """Phase two: copy the bytes, then commit. Lock held on entry (released while
        waiting). Async: the copy runs on the ``(src, dst)`` queue; with ``wait`` this
        waits up to ``transfer_timeout_s`` (then the transfer is abandoned)."""
        if t.done.is_set():
            return
        if not t.reserved:                # joined a copy still making room: wait for it
            if wait:
                deadline = time.monotonic() + self.transfer_timeout_s
                while not t.done.is_set() and not t.reserved and time.monotonic() < deadline:
                    self.cat.changed.wait(max(0.0, deadline - time.monotonic()))
            if not t.reserved:
                return
        if not self.mover.async_moves:
            self._copy_bytes(t)
            return
        if not t.submitted:
            t.submitted = True
            try:
                self.mover.submit(t.src, t.dst, lambda: self._copy_bytes(t))
            except RuntimeError as e:        # the mover is stopped: the store is closing
                self._finish_locked(t, terr.TierIOError(str(e)))
                return
        if not wait:
            return
        deadline = time.monotonic() + self.transfer_timeout_s
        while not t.done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon_locked(t)
                return
            self.cat.changed.wait(remaining)

    def _copy_bytes(self, t: Transfer) -> None:
        err: BaseException | None = None
        try:
            self.mover.copy(t.key, t.src, t.dst)
        except BaseException as e:  # noqa: BLE001 - reported through the transfer
            err = e
        with self.cat.lock:
            self._finish_locked(t, err)

    def _finish_locked(self, t: Transfer, err: BaseException | None) -> None:
        self._moving.pop((t.key, t.dst), None)
        dst = self.tiers[t.dst]
        entry = t.entry
        gone = self.cat.raw(t.key) is not entry or entry.deleted     # deleted during the copy
        if err is None and not t.abandoned and not gone:
            try:
                dst.commit(t.key)
            except BaseException as e:  # noqa: BLE001
                err = e
        if err is not None or t.abandoned or gone:
            dst.abort(t.key)
            t.error = err or (terr.TierIOError(f"transfer exceeded {self.transfer_timeout_s}s")
                              if t.abandoned else terr.TierError("the block was deleted during the copy"))
            if err is not None or t.abandoned:
                self.counters.inc("transfers_failed")
                log.warning("copy of block %s from %s to %s failed: %s", t.key.hex()[:16],
                            self.tiers[t.src].name, dst.name, t.error)
        else:
            self.policies[t.dst].insert(t.key, entry.size, self.clock())
            self.add_copy(entry, t.dst, t.reason)
            t.ok = True
        if not t.abandoned:
            self.cat.unpin(entry)
        t.done.set()
        self.cat.changed.notify_all()

    def _abandon_locked(self, t: Transfer) -> None:
        if t.abandoned or t.done.is_set():
            return
        t.abandoned = True
        t.error = terr.TierIOError(f"transfer did not finish in {self.transfer_timeout_s}s")
        self.counters.inc("transfers_timed_out")
        self.cat.unpin(t.entry)

    def copy_locked(self, entry: Entry, src: int, dst: int, reason: str) -> None:
        """Copy a committed block from ``src`` into ``dst`` and wait for it.
        Raises TierFull / NoVictim / TierIOError."""
        t = self.start_transfer_locked(entry, src, dst, reason)
        self.run_transfer(t, wait=True)
        if not t.ok:
            raise TierIOError(f"copy of block {entry.key.hex()[:16]} to {self.tiers[dst].name} failed: {t.error}")

    def promote(self, entry: Entry, to: int, wait: bool) -> Transfer | None:
        """Copy ``entry`` up into tier ``to`` from its fastest copy: THE promotion path
        (after a read, by prefetch, for a lease). Deduplicated: a block already moving
        there joins that transfer. Returns the transfer (None when no room could be made
        without evicting pinned blocks: counted in ``promotions_skipped``)."""
        with self.cat.lock:
            if entry.deleted or to in entry.tiers or not entry.tiers:
                return Transfer.finished(entry.key, to, to)
            existing = self._moving.get((entry.key, to))
            if existing is not None:
                self.counters.inc("promotions_deduplicated")
                t = existing
            else:
                src = entry.tiers[0]
                try:
                    t = self.start_transfer_locked(entry, src, to, "promoted")
                except (TierFull, NoVictim, TierIOError) as e:
                    self.counters.inc("promotions_skipped")
                    log.debug("promotion of %s skipped: %s", entry.key.hex()[:16], e)
                    return None
                self.counters.inc("promotions")
            self.run_transfer(t, wait=wait)
            return t


class _ScanBudgetSpent(Exception):
    """The policy looked at :data:`CLEAN_SCAN` blocks without finding a dirty one."""


class Cleaner:
    """Background watermark keeper of a :class:`Placement` (see the module docstring).

    Runs on its own thread; woken by :meth:`kick` (a put that found no clean victim,
    a commit past the high watermark) and every ``period_s`` seconds, when it also runs
    ``on_tick`` (the manager's lease and reservation expiry).
    """

    def __init__(self, placement: Placement, period_s: float = 0.25,
                 on_tick: Callable[[], None] | None = None):
        self.p = placement
        self.period_s = period_s
        self.on_tick = on_tick
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.busy = False                 # a cleaning pass is copying blocks down
        self._thread = threading.Thread(target=self._run, name="kvstore-cleaner", daemon=True)
        placement.cleaner = self

    def start(self) -> "Cleaner":
        self._thread.start()
        return self

    def kick(self) -> None:
        """Wake the cleaner; :attr:`busy` until its pass ends."""
        self.busy = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            try:
                if self.on_tick is not None:
                    self.on_tick()
                self.pass_once()
            except Exception:  # noqa: BLE001 - keep cleaning; the error is logged loudly
                log.exception("background cleaning failed")
            finally:
                self.busy = False
                with self.p.cat.lock:
                    self.p.cat.changed.notify_all()

    def pass_once(self) -> int:
        """One pass over every tier but the last; returns blocks cleaned."""
        done = 0
        for i, tier in enumerate(self.p.tiers):
            if self._stop.is_set():
                break
            cap = tier.capacity_bytes
            if i == self.p.last or cap <= 0 or tier.used_bytes <= self.p.high * cap:
                continue
            done += self._clean(i, cap)
        return done

    def _clean(self, i: int, cap: int) -> int:
        """Copy tier ``i``'s coldest dirty blocks down, several copies in flight, until its
        free and clean bytes reach ``1 - low`` of ``cap``. Returns blocks cleaned."""
        p = self.p
        tier, policy = p.tiers[i], p.policies[i]
        raw = p.cat.raw
        chosen: set[bytes] = set()
        inflight: list = []
        width = 1 if p.tiers[i + 1].volatile else max(1, p.mover.disk_workers)
        done = {"cleaned": 0, "moving": 0}               # blocks cleaned, bytes being copied

        def dirty(key: bytes) -> bool:
            e = raw(key)
            return e is not None and e.pins == 0 and not e.deleted and e.tiers[-1] == i and key not in chosen

        looked = [0]

        def dirty_near_front(key: bytes) -> bool:
            looked[0] += 1
            if looked[0] > CLEAN_SCAN:
                raise _ScanBudgetSpent
            return dirty(key)

        def next_victim() -> bytes | None:
            looked[0] = 0
            try:
                return policy.victim(dirty_near_front, incoming=None, now=p.clock())
            except NoVictim:
                return None
            except _ScanBudgetSpent:      # the policy's coldest blocks are clean already
                return next((k for k in p.dirty_keys(i) if dirty(k)), None)

        def settle(t) -> None:
            p.run_transfer(t, wait=True)
            done["moving"] -= t.entry.size
            if t.ok:
                done["cleaned"] += 1
                p.counters.inc("precleaned")
        with p.cat.lock:
            self.busy = True
            try:
                while not self._stop.is_set():
                    free = cap - tier.used_bytes
                    clean = p.resident_bytes(i) - p.dirty_bytes(i) + done["moving"]
                    if free + clean >= (1.0 - p.low) * cap:
                        break
                    victim = next_victim()
                    if victim is None:
                        break
                    chosen.add(victim)
                    try:
                        t = p.start_transfer_locked(raw(victim), i, i + 1, "demoted")
                    except (TierFull, NoVictim, TierIOError) as e:
                        log.debug("pre-cleaning %s skipped: %s", victim.hex()[:16], e)
                        break
                    p.run_transfer(t, wait=False)
                    inflight.append(t)
                    done["moving"] += t.entry.size
                    if len(inflight) >= width:
                        settle(inflight.pop(0))
                while inflight:
                    settle(inflight.pop(0))
            finally:
                self.busy = False
                p.cat.changed.notify_all()
        return done["cleaned"]
