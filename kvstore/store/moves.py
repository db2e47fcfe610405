"""Copies asked for by name: promotion up, write-through and persist down.

:class:`Moves` is what the rest of the store calls to copy a block on purpose, as
opposed to the demotions that making room runs (:mod:`kvstore.store.room`):

- **promote**: copy a block up into a faster tier from its fastest copy; the lower
  copy stays, so a later demotion is free. The one promotion path: after a read from
  a lower tier, by prefetch, for a lease, for a block only the cluster holds.
  :meth:`Moves.promote_ahead` starts the promotions of a run of blocks together (a
  lease's page-back: several NVMe reads in flight).
- **copy** (:meth:`Moves.copy_locked`): copy a committed block down and wait for it
  (write-through, persist on a graceful stop).

Each copy is one :class:`kvstore.store.transfers.Transfer`, deduplicated per ``(block,
destination)``; room in the destination is made by :class:`~kvstore.store.room.Room`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from kvstore.common.errors import KVStoreError, TierFull, TierIOError
from kvstore.policy import NoVictim
from kvstore.store.catalogue import Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter
from kvstore.store.room import Room
from kvstore.store.transfers import Transfer, Transfers

log = logging.getLogger("kvstore.store.placement")


class Moves:
    """Promotion and copies on request between ``tiers`` (see the module docstring).

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`).
        catalogue: pins and the lock; room: makes room in a destination.
        transfers: runs the copies; counters: ``promotions*``, ``blocks_persisted``.
    """

    def __init__(self, tiers: Sequence[TierAdapter], catalogue: Catalogue, room: Room, transfers: Transfers,
                 counters: Counters):
        self.tiers = list(tiers)
        self.cat = catalogue
        self.room = room
        self.transfers = transfers
        self.counters = counters

    def promote(self, entry: Entry, to: int, wait: bool) -> Transfer | None:
        """Copy pinned ``entry`` up into tier ``to`` from its fastest copy. Deduplicated: a
        block already moving there joins that transfer. Returns the transfer (None when
        no room could be made without evicting pinned blocks: counted in
        ``promotions_skipped``); with ``wait`` it has finished."""
        with self.cat.lock:
            if entry.deleted or to in entry.tiers or not entry.tiers:
                return Transfer.finished(entry.key, to, to)
            existing = self.transfers.moving(entry.key, to)
            if existing is not None:
                self.counters.inc("promotions_deduplicated")
                t = existing
            else:
                src = entry.tiers[0]
                try:
                    t = self.room.start_copy_locked(entry, src, to, "promoted")
                except (TierFull, NoVictim, TierIOError) as e:
                    self.counters.inc("promotions_skipped")
                    log.debug("promotion of %s skipped: %s", entry.key.hex()[:16], e)
                    return None
                self.counters.inc("promotions")
            self.transfers.run(t, wait=wait)
            return t

    def promote_ahead(self, keys: Sequence[bytes], to: int, budget: int) -> list[tuple[Entry, Transfer | None]]:
        """Start promotions into tier ``to`` of the blocks of ``keys`` that are not there,
        in order, without waiting, until ``budget`` bytes are on their way: a page-back
        then has several reads in flight (the ``(src, to)`` queue's workers), and the
        :meth:`promote` of each block that follows joins its transfer. Stops at the first
        key not stored and when no room can be made without evicting pinned blocks
        (counted in ``promotions_skipped``). Blocks already in ``to`` or on their way count
        in the budget (a window of ``budget`` bytes from the first key, however often it
        is asked). Returns the window: each entry, pinned once for the caller, who unpins
        it (so that later promotions do not evict it before it is used), with its
        transfer (None: it was in ``to`` already)."""
        window: list[tuple[Entry, Transfer | None]] = []
        with self.cat.lock:
            try:
                self._window_locked(keys, to, budget, window)
            except BaseException:
                for entry, _ in window:
                    self.cat.unpin(entry)
                raise
        return window

    def _window_locked(self, keys: Sequence[bytes], to: int, budget: int,
                       window: list[tuple[Entry, Transfer | None]]) -> None:
        started = 0
        for key in keys:
            if started >= budget:
                return
            entry = self.cat.get(key)
            if entry is None:
                return
            if not entry.tiers:
                continue
            t = None if to in entry.tiers else self.transfers.moving(key, to)
            if to not in entry.tiers and t is None:
                try:
                    t = self.room.start_copy_locked(entry, entry.tiers[0], to, "promoted")
                except (TierFull, NoVictim, TierIOError) as e:
                    self.counters.inc("promotions_skipped")
                    log.debug("promotion of %s ahead skipped: %s", key.hex()[:16], e)
                    return
                self.counters.inc("promotions")
                self.transfers.run(t, wait=False)
            entry.pins += 1
            window.append((entry, t))
            started += entry.size

    def promote_key(self, key: bytes, to: int = 0, wait: bool = True) -> bool:
        """:meth:`promote` the stored block ``key``: True when it is in tier ``to`` now
        (or, with ``wait=False``, on its way). Never evicts pinned blocks."""
        entry = self.cat.pin(key)
        if entry is None:
            return False
        try:
            t = self.promote(entry, to, wait)
            return t is not None and (t.ok or not wait)
        finally:
            self.cat.unpin(entry)

    def copy_locked(self, entry: Entry, src: int, dst: int, reason: str) -> None:
        """Copy committed ``entry`` from ``src`` into ``dst`` and wait for it (lock held,
        dropped while waiting). Raises TierFull / NoVictim / TierIOError."""
        t = self.room.start_copy_locked(entry, src, dst, reason)
        self.transfers.run(t, wait=True)
        if not t.ok:
            raise TierIOError(f"copy of block {entry.key.hex()[:16]} to {self.tiers[dst].name} failed: {t.error}")

    def persist(self, last: int, timeout: float = 60.0, cancelled: Callable[[], bool] | None = None) -> int:
        """Copy every block not held by tier ``last`` (the last local tier, persistent)
        there, within ``timeout`` seconds and until ``cancelled()`` says stop (asked between
        blocks); returns blocks copied."""
        deadline = time.monotonic() + timeout
        copied = 0
        with self.cat.lock:
            todo = [e for e in self.cat.entries() if last not in e.tiers]
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
                if cancelled is not None and cancelled():
                    log.warning("persist: stopped early; %d blocks stay only in memory", len(todo) - copied)
                    break
                if entry.deleted or last in entry.tiers or not entry.tiers:
                    continue
                try:
                    self.copy_locked(entry, entry.tiers[0], last, "demoted")
                    copied += 1
                except KVStoreError as e:
                    log.debug("persist of %s skipped: %s", entry.key.hex()[:16], e)
        self.counters.inc("blocks_persisted", copied)
        return copied


__all__ = ["Moves"]
