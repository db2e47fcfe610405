"""Block movement between tiers: eviction, demotion, promotion, background cleaning.

Tiers are ordered fastest first. A tier that needs room asks its eviction policy for a
victim; the victim is **demoted** (copied to the next tier, then freed here) or, when
the next tier already holds a copy (the block is *clean*), simply freed; the last
tier's victims leave the store. A block read from a lower tier is **promoted** (copied
up; the lower copy stays, so a later demotion is free). Every copy is one
:class:`kvstore.store.mover.Transfer`, deduplicated per ``(block, destination)``.

**Off the put path** (``async_moves``, the daemon): a :class:`~kvstore.store.cleaner.Cleaner` thread watches
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

This module keeps the per-tier bookkeeping (resident and dirty bytes, the dirty lists)
and eviction; the copies themselves are :mod:`kvstore.store.transfers`, the background
cleaning :mod:`kvstore.store.cleaner`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from tiers import errors as terr
from tiers.base import Tier

from kvstore.store.catalogue import BlockEvent, Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.common.errors import TierFull, TierIOError
from kvstore.store.mover import Mover, Transfer
from kvstore.policy import EvictionPolicy, NoVictim
from kvstore.store.transfers import TransferMixin

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.cleaner import Cleaner

log = logging.getLogger("kvstore.store.placement")

CLEAN_SCAN = 256
"""Blocks the cleaner lets a policy look at to find its next dirty victim before it
takes the least recently used dirty block instead."""

CLEAN_WAIT_S = 5.0
"""How long a put that found no clean victim waits for the cleaner's demotions before it
demotes a block itself (seconds)."""


class Placement(TransferMixin):
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
        :class:`kvstore.common.types.BlockMeta` (kept without its token ids)."""
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
        except terr.MediaError as e:
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
                if isinstance(t.error, terr.NoRoom) and attempt == 1:
                    continue   # the disk filled up: the tier now evicts to fit, so retry once
                if best_effort:
                    log.debug("demotion of block %s to %s failed (%s); dropping it", key.hex()[:16],
                              self.tiers[i + 1].name, t.error)
                    if self.cat.raw(key) is not entry or i not in entry.tiers or entry.pins:
                        return  # deleted, or read while the copy was tried: keep it
                    break
                cls = TierFull if isinstance(t.error, terr.NoRoom) else TierIOError
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
            except terr.NoRoom as e:
                if attempt == 2 or nbytes > tier.max_block_bytes:
                    raise TierFull(f"{tier.name}: {e}") from None
            except terr.MediaIOError as e:
                raise TierIOError(f"{tier.name}: reserving {nbytes} bytes failed: {e}") from None
