"""Room in a tier: which blocks leave it, and how. The one place victims are chosen.

:class:`Room` is the only object in the project that asks an eviction policy for its
victims (``policy.victim``). Everything that needs room asks it: a put reserving its
first copy and every copy into a tier (:meth:`Room.reserve_locked`), the background
cleaner (:meth:`Room.dirty_victim`), prefetch and the manager's ``make_room``
(:meth:`Room.make_room`), publishing to the cluster (:meth:`Room.make_room_locked`).

A victim is **demoted** (copied to the next tier, then freed here) or, when a lower tier
already holds a copy (the block is *clean*), simply freed; the last tier's victims leave
the store. Pinned and leased blocks are never victims.

**Off the put path** (``async_moves``, the daemon): a
:class:`~kvstore.store.cleaner.Cleaner` thread watches each tier's watermarks. When a
tier other than the last holds more than ``high`` of its capacity, it copies its
coldest dirty blocks down until the free and clean bytes reach ``1 - low`` of the
capacity, with up to ``disk_workers`` copies into a disk in flight, each replaced as soon
as it ends (one slow write holds up no other): in the tier policy's order while its next
dirty block is near the front
(:data:`CLEAN_SCAN`), else the least recently used dirty block (the placement's dirty
list), so a tier whose coldest blocks are all clean already costs no scan per cleaned
block. A put into a full tier then evicts a clean block near the policy's front (within
:data:`CLEAN_SCAN` blocks, so a put never scans the tier), which costs a free and no I/O;
it waits for a demotion only when no clean block is there (a burst faster than the
disk, or clean blocks hit since and now behind dirty ones), bounded by ``transfer_timeout_s``. The last tier's victims leave the store, which
costs a free (no copy), so they are evicted when a put needs the room and the last tier
keeps its whole capacity. Without ``async_moves`` (the simulator) every eviction runs
inline, in pure policy order.

Methods whose name ends in ``_locked`` expect the catalogue lock held; the others take
it. Waiting on a transfer drops it for the wait.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kvstore.common.errors import KVStoreError, TierFull, TierIOError
from kvstore.policy import EvictionPolicy, NoVictim
from kvstore.store.catalogue import Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter
from kvstore.store.placement import Placement
from kvstore.store.transfers import Transfer, Transfers
from tiers.block_table import STUCK_READER_S

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.cleaner import CleanerSignal

log = logging.getLogger("kvstore.store.placement")

CLEAN_SCAN = 256
"""Blocks the cleaner lets a policy look at to find its next dirty victim before it
takes the least recently used dirty block instead."""

RETIRED_POLL_S = 0.002
"""How often a put waiting for retired arena space to come free looks again (seconds)."""
CLEAN_AHEAD_BLOCKS = 8
"""Above a disk, the cleaner keeps at least this many blocks (of the latest put's size)
free or clean, the whole tier at most: twice the mover's default disk workers, so
puts fill the room cleaned while the next writes run."""
CLEAN_WAIT_S = 5.0
"""How long a put that found no clean victim waits for the cleaner's demotions before it
demotes a block itself (seconds)."""


class Room:
    """Makes room in ``tiers`` under their ``policies`` (see the module docstring).

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`); policies: one per tier.
        catalogue: its lock guards every decision here; placement: the per-tier bookkeeping.
        transfers: the copies a demotion runs; counters: the daemon's counters.
        clock: time for the policies (seconds; virtual in the simulator).
        watermarks: ``(low, high)`` fractions of each tier's capacity (background cleaning).
        cleaner: how to wake the background cleaner (``async_moves``); None: every
            eviction runs inline, in pure policy order (the simulator).
    """

    def __init__(self, tiers: Sequence[TierAdapter], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 placement: Placement, transfers: Transfers, counters: Counters, clock: Callable[[], float],
                 watermarks: tuple[float, float] = (0.85, 0.95), cleaner: CleanerSignal | None = None,
                 ahead_blocks: int | None = None):
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.cat = catalogue
        self.placement = placement
        self.transfers = transfers
        self.counters = counters
        self.clock = clock
        self.low, self.high = watermarks
        self.cleaner = cleaner
        self.last = len(self.tiers) - 1
        self.ahead_blocks = CLEAN_AHEAD_BLOCKS if ahead_blocks is None else ahead_blocks
        """Blocks kept free or clean above a disk (:meth:`ahead_bytes`)."""
        self._put_bytes = [0] * len(self.tiers)      # size of the latest block put into each tier
        self.redundant: Callable[[bytes], bool] | None = None
        """Blocks an engine still holds in its own cache (prefetch sets it from the engines'
        KV events): their clean copies in a tier above the last are its first victims."""

    # ------------------------------------------------------------------ which blocks may go

    def evictable(self, key: bytes) -> bool:
        """Whether ``key`` may leave a tier now (stored and not pinned or leased)."""
        e = self.cat.raw(key)
        return e is not None and e.pins == 0

    def _clean_in(self, i: int) -> Callable[[bytes], bool]:
        raw = self.cat.raw

        def clean(key: bytes) -> bool:
            e = raw(key)
            return e is not None and e.pins == 0 and (i == self.last or e.tiers[-1] > i)
        return clean

    def _redundant_in(self, i: int) -> Callable[[bytes], bool] | None:
        """Blocks of tier ``i`` an engine holds whose copy a lower tier has (None: none known)."""
        held = self.redundant
        if held is None or i >= self.last:
            return None
        clean = self._clean_in(i)
        return lambda key: clean(key) and held(key)

    def above_high(self, i: int) -> bool:
        """Whether tier ``i`` holds more than its high watermark."""
        tier = self.tiers[i]
        return tier.used_bytes > self.high * tier.capacity_bytes

    def ahead_bytes(self, i: int) -> int:
        """Bytes the cleaner keeps free or clean in tier ``i`` below its watermarks: above a
        disk, :attr:`ahead_blocks` blocks of the latest put's size (the whole tier at most);
        else, and with a high watermark of 1 (no background cleaning), 0. In a tier of a
        few blocks (a small staging tier) the watermarks are less than a block apart:
        without these blocks the disk would wait while puts fill the tier to ``high``, and
        then puts would wait while the disk cleans."""
        nxt = self.tiers[i + 1] if i < self.last else None
        if nxt is None or nxt.volatile or nxt.remote is not None or self.high >= 1.0:
            return 0
        return min(self.tiers[i].capacity_bytes, self.ahead_blocks * self._put_bytes[i])

    def clean_goal(self, i: int) -> float:
        """Free and clean bytes a cleaning pass of tier ``i`` works toward: ``1 - low`` of its
        capacity, and at least :meth:`ahead_bytes`."""
        return max((1.0 - self.low) * self.tiers[i].capacity_bytes, self.ahead_bytes(i))

    def needs_cleaning(self, i: int) -> bool:
        """Whether tier ``i`` holds more than its high watermark, or dirty blocks while its
        free and clean bytes are below :meth:`ahead_bytes`."""
        if self.above_high(i):
            return True
        p, tier = self.placement, self.tiers[i]
        dirty = p.dirty_bytes(i)
        free = tier.capacity_bytes - tier.used_bytes
        return dirty > 0 and free + p.resident_bytes(i) - dirty < self.ahead_bytes(i)

    def kick_if_full(self, i: int, nbytes: int = 0) -> None:
        """Wake the cleaner when tier ``i`` needs cleaning; ``nbytes``: the block just put."""
        if nbytes:
            self._put_bytes[i] = nbytes
        if self.cleaner is not None and i < self.last and self.needs_cleaning(i):
            self.cleaner.kick()

    # ------------------------------------------------------------------ room for one block

    def make_room_locked(self, i: int, nbytes: int, incoming: bytes | None) -> None:
        """Evict from tier ``i`` until ``nbytes`` fit: a clean block an engine holds first
        (:attr:`redundant`), then a clean victim (with the cleaner), else the policy's
        victim, demoted. Raises TierFull, NoVictim, TierIOError."""
        tier, policy = self.tiers[i], self.policies[i]
        if nbytes > tier.max_block_bytes:
            raise TierFull(f"{tier.name}: a {nbytes}-byte block exceeds the largest block the tier "
                           f"can hold ({tier.max_block_bytes} bytes)")
        now = self.clock()
        cleaner = self.cleaner
        clean = self._clean_in(i) if cleaner is not None and i < self.last else None
        waited_until = None
        redundant = self._redundant_in(i)
        retired_until = None
        while not tier.fits(nbytes):
            if tier.retired_fit(nbytes):
                # freed space waits for clients reading the block table (a bounded time):
                # wait for it rather than evicting more for space that is coming
                if retired_until is None:
                    retired_until = time.monotonic() + STUCK_READER_S
                if time.monotonic() < retired_until:
                    self.cat.changed.wait(RETIRED_POLL_S)
                    continue
            victim = None
            if redundant is not None:
                try:
                    victim = self._near_front(policy, redundant, incoming, now)
                except NoVictim:
                    redundant = None
            if victim is None and clean is not None:
                try:
                    victim = self._near_front(policy, clean, incoming, now)
                except NoVictim:
                    if self.needs_cleaning(i):
                        # the cleaner demotes several blocks at once: wait for one to be
                        # clean rather than demoting a single block here, for a while
                        if waited_until is None:
                            cleaner.kick()
                            waited_until = time.monotonic() + min(self.transfers.transfer_timeout_s, CLEAN_WAIT_S)
                        if time.monotonic() < waited_until and cleaner.busy:
                            self.cat.changed.wait(0.05)
                            continue
            if victim is None:
                victim = policy.victim(self.evictable, incoming=incoming, now=now)
            self.evict_locked(i, victim)

    @staticmethod
    def _near_front(policy, wanted: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        """The policy's victim among the blocks ``wanted`` says yes to, looking at no more
        than :data:`CLEAN_SCAN` blocks from its front. The scan is bounded without an
        exception inside the policy: the predicate answers yes to the first block past the
        budget, which ends the policy's scan there, and that answer is set aside.
        Raises NoVictim when none of those is wanted: a clean block behind many dirty ones
        (blocks hit since they were cleaned) is not worth a scan of the whole tier under the
        store's lock, for every put (a host tier of 40,000 blocks: 4 ms a put)."""
        looked = 0

        def near(key: bytes) -> bool:
            nonlocal looked
            looked += 1
            return looked > CLEAN_SCAN or wanted(key)
        victim = policy.victim(near, incoming=incoming, now=now)
        if looked > CLEAN_SCAN:
            raise NoVictim(f"none of the {CLEAN_SCAN} blocks at the policy's front qualifies")
        return victim

    def reserve_locked(self, i: int, key: bytes, nbytes: int, incoming: bytes | None) -> None:
        """Make room in tier ``i`` and reserve ``nbytes`` for ``key`` (a few tries: room made
        while the lock was dropped may be taken). Raises TierFull, NoVictim, TierIOError."""
        tier = self.tiers[i]
        for attempt in range(3):
            self.make_room_locked(i, nbytes, incoming)
            try:
                tier.reserve(key, nbytes)
                return
            except TierFull:
                if attempt == 2 or nbytes > tier.max_block_bytes:
                    raise

    def start_copy_locked(self, entry: Entry, src: int, dst: int, reason: str) -> Transfer:
        """Phase one of a copy of ``entry`` into tier ``dst``, making room there
        (:meth:`kvstore.store.transfers.Transfers.start_locked`). Raises TierFull,
        NoVictim, TierIOError."""
        return self.transfers.start_locked(entry, src, dst, reason, self.reserve_locked)

    # ------------------------------------------------------------------ one block out

    def evict_locked(self, i: int, key: bytes, reason: str = "evicted") -> None:
        """Move ``key`` out of tier ``i``: demote it to the next tier, or drop it.

        With async moves the copy runs on the (i, i+1) queue while this thread waits with
        the lock dropped; the block stays pinned meanwhile. If a reader pinned it during
        the copy, its tier-``i`` copy is kept (now clean) and the caller picks again.
        Raises TierIOError (the block is kept) or TierFull when the demotion fails.
        """
        entry = self.cat.raw(key)
        if entry is None:
            return
        if not any(j > i for j in entry.tiers) and i < self.last:
            # The cluster is best effort: when it cannot take the block, it is dropped as
            # if there were no tier below, so a dead cluster never fails a local put.
            best_effort = self.tiers[i + 1].remote is not None
            for attempt in (1, 2):
                try:
                    t = self.transfers.start_locked(entry, i, i + 1, "demoted", self.reserve_locked)
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
                self.transfers.run(t, wait=True)
                if t.ok:
                    self.counters.inc("demotions")
                    if self.cat.raw(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read again while it was copied: keep the clean copy
                    break
                if self.cat.raw(key) is not entry or entry.deleted:
                    return  # deleted while it was copied: nothing to demote, its room is free
                self.counters.inc("demotions_failed")
                full = t.reserved and isinstance(t.error, TierFull)    # the medium filled up mid-copy
                if full and attempt == 1:
                    continue   # the disk filled up: the tier now evicts to fit, so retry once
                if best_effort:
                    log.debug("demotion of block %s to %s failed (%s); dropping it", key.hex()[:16],
                              self.tiers[i + 1].name, t.error)
                    if self.cat.raw(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read while the copy was tried: keep it
                    break
                cls = TierFull if full else TierIOError
                raise cls(f"demotion of block {key.hex()[:16]} from {self.tiers[i].name} to "
                          f"{self.tiers[i + 1].name} failed: {t.error}")
        self.counters.inc(f"evictions_{self.tiers[i].name}")
        if self.placement.drop_copy(entry, i, reason, policy=self.policies[i].name):
            self.counters.inc("blocks_dropped")

    def demote(self, key: bytes, frm: int = 0) -> bool:
        """Move ``key`` out of tier ``frm`` (to the next tier). False if absent there, pinned
        or leased, or when the demotion failed (logged)."""
        with self.cat.lock:
            e = self.cat.get(key)
            if e is None or frm not in e.tiers or e.pins or len(self.tiers) < 2:
                return False
            try:
                self.evict_locked(frm, key, reason="evicted")
            except KVStoreError as err:
                log.warning("demotion of %s failed: %s", key.hex()[:16], err)
                return False
            return frm not in e.tiers

    # ------------------------------------------------------------------ room on request

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
        if tier == self.last:
            return t.fits(nbytes)        # demoting from the last tier would drop blocks
        with self.cat.lock:
            try:
                for key in candidates:
                    if t.fits(nbytes):
                        return True
                    if key in t and not protect(key) and self.evictable(key):
                        self.evict_locked(tier, key)
                        if on_moved is not None:
                            on_moved(key)
                redundant = self._redundant_in(tier)
                while not t.fits(nbytes):
                    victim = None
                    if redundant is not None:
                        try:      # a block the engine holds, with a copy below: free to let go
                            victim = self.policies[tier].victim(lambda k: redundant(k) and not protect(k),
                                                                incoming=None, now=self.clock())
                        except NoVictim:
                            redundant = None
                    if victim is None:
                        victim = self.policies[tier].victim(lambda k: self.evictable(k) and not protect(k),
                                                            incoming=None, now=self.clock())
                        if give_up is not None and give_up(victim):
                            return False
                    self.evict_locked(tier, victim)
                    if on_moved is not None:
                        on_moved(victim)
                return True
            except (NoVictim, KVStoreError) as e:
                log.debug("make_room(%s, %d) gave up: %s", t.name, nbytes, e)
                return False

    def dirty_victim(self, i: int, skip: set[bytes]) -> bytes | None:
        """The cleaner's next block of tier ``i`` to copy down (lock held): the policy's
        coldest dirty block, unpinned and not in ``skip``, while one is within
        :data:`CLEAN_SCAN` blocks of the policy's front (:meth:`_near_front`); past that,
        the least recently used such block of the placement's dirty list. None when there
        is none."""
        raw = self.cat.raw

        def dirty(key: bytes) -> bool:
            e = raw(key)
            return e is not None and e.pins == 0 and not e.deleted and e.tiers[-1] == i and key not in skip

        try:
            return self._near_front(self.policies[i], dirty, None, self.clock())
        except NoVictim:                  # the policy's coldest blocks are clean already
            return next((k for k in self.placement.dirty_keys(i) if dirty(k)), None)


__all__ = ["CLEAN_SCAN", "CLEAN_WAIT_S", "Room"]
