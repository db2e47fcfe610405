"""Where each block's copies are: the per-tier bookkeeping of the store.

Tiers are ordered fastest first. :class:`Placement` records every committed copy that
appears in or leaves a tier (the catalogue's entry, the tier's eviction policy, the
counters and the block events), and keeps per tier its resident and *dirty* bytes (a
dirty block is held by no lower tier, so evicting it costs a demotion) with the dirty
blocks in least recently used order, which the background cleaner walks
(:mod:`kvstore.store.cleaner`). Choosing and moving blocks is elsewhere: which blocks
leave a tier is :mod:`kvstore.store.room`, copies are :mod:`kvstore.store.transfers`.

Every method expects the catalogue lock held unless it says it takes it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

from kvstore.common.errors import BlockNotFound, KVStoreError
from kvstore.policy import EvictionPolicy
from kvstore.store.catalogue import BlockEvent, Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter

log = logging.getLogger("kvstore.store.placement")


class Placement:
    """The copies of every block in ``tiers`` (see the module docstring).

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`); policies: one per tier.
        catalogue: the block catalogue (its lock guards every change here).
        counters: the daemon's counters.
        clock: time for the policies (seconds; virtual in the simulator).
    """

    def __init__(self, tiers: Sequence[TierAdapter], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 counters: Counters, clock: Callable[[], float]):
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.cat = catalogue
        self.counters = counters
        self.clock = clock
        self.last = len(self.tiers) - 1
        self._resident = [0] * len(self.tiers)      # payload bytes of committed copies per tier
        self._dirty = [0] * len(self.tiers)         # of which held by no lower tier
        self._dirty_keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.tiers]
        """Per tier, its dirty blocks, least recently used first."""

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
            if reason == "evicted":
                self.tiers[i].evict(entry.key)     # a disk may keep the file for the next write
            else:
                self.tiers[i].free(entry.key)
        except BlockNotFound:
            pass
        except KVStoreError as e:
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
        """Free every copy of ``entry`` (lock held); a deleted block's evicted files too."""
        held = list(entry.tiers)
        for i in held:
            self.drop_copy(entry, i, reason)
        if reason == "deleted":
            self._forget_evicted(entry.key, skip=held)
        self.cat.forget(entry)

    def _forget_evicted(self, key: bytes, skip: Sequence[int] = ()) -> None:
        """No file a tier kept of evicted block ``key`` remains (it is deleted: no crash
        brings it back; :meth:`tiers.base.Tier.forget_evicted`)."""
        for i, tier in enumerate(self.tiers):
            if i not in skip:
                try:
                    tier.forget_evicted(key)
                except KVStoreError as e:
                    log.warning("forgetting evicted block %s in %s failed: %s", key.hex()[:16], tier.name, e)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Delete blocks from every tier; returns how many were stored. A pinned (read or
        leased) block is hidden at once and freed with its last pin. Takes the lock."""
        deleted = 0
        with self.cat.lock:
            for key in keys:
                e = self.cat.get(key)
                if e is None:
                    self._forget_evicted(key)
                    continue
                deleted += 1
                if e.pins:
                    e.deleted = True
                    for i in e.tiers:           # no client finds it in a block table meanwhile
                        self.tiers[i].unpublish(key)
                else:
                    self.free_entry(e, "deleted")
        self.counters.inc("blocks_deleted", deleted)
        return deleted

    def touch(self, entry: Entry) -> None:
        """An access to ``entry`` for the policies of every tier holding it (lock held)."""
        now = self.clock()
        for i in entry.tiers:
            self.policies[i].access(entry.key, now)
        d = self._dirty_tier(entry)
        if d >= 0 and entry.key in self._dirty_keys[d]:
            self._dirty_keys[d].move_to_end(entry.key)

    def touch_all(self, entries: Iterable[Entry]) -> None:
        """:meth:`touch` of each of ``entries`` at one time (lock held): a lease's blocks."""
        now = self.clock()
        dirty_keys = self._dirty_keys
        hits: list[list[bytes]] = [[] for _ in self.policies]      # per tier, in order: one call each
        for entry in entries:
            key = entry.key
            for i in entry.tiers:
                hits[i].append(key)
            d = self._dirty_tier(entry)
            if d >= 0 and key in dirty_keys[d]:
                dirty_keys[d].move_to_end(key)
        for policy, keys in zip(self.policies, hits):
            if keys:
                policy.access_all(keys, now)

    def count_read(self, tier: TierAdapter, nbytes: int, block: bool = True) -> None:
        """Count ``nbytes`` served from ``tier``; ``block``: and one block read (False for
        the further pieces of a block read in several)."""
        c = self.counters
        if block:
            c.inc("reads")
            c.inc(f"reads_{tier.name}")
        c.inc("read_bytes", nbytes)
        c.inc(f"read_bytes_{tier.name}", nbytes)

    def resident_bytes(self, i: int) -> int:
        return self._resident[i]

    def dirty_bytes(self, i: int) -> int:
        return self._dirty[i]

    def dirty_keys(self, i: int) -> Iterator[bytes]:
        """Tier ``i``'s dirty blocks (held by no lower tier), least recently used first
        (lock held; do not change placement while iterating)."""
        return iter(self._dirty_keys[i])

    # ------------------------------------------------------------------ recovery

    def recover(self) -> None:
        """Record the blocks the tiers hold at start (persistent tiers: NVMe). A block
        found with different sizes in two tiers keeps its first copy. Takes the lock."""
        now = self.clock()
        with self.cat.lock:
            for i, tier in enumerate(self.tiers):
                for key, nbytes in tier.recover():
                    entry = self.cat.raw(key)
                    if entry is None:
                        self.new_entry(key, nbytes, i, "recovered")
                    elif entry.size == nbytes:
                        self.add_copy(entry, i, "recovered")
                    else:
                        log.warning("block %s has %d bytes in %s but %d elsewhere; dropping the %s copy",
                                    key.hex()[:16], nbytes, tier.name, entry.size, tier.name)
                        tier.free(key)
                        continue
                    self.policies[i].insert(key, nbytes, now)
                    self.counters.inc("blocks_recovered")
