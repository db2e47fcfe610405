"""The store's side of the cluster level's port: :class:`ClusterPort`.

The cluster level (:mod:`kvstore.cluster`) never imports the store; it declares what it
needs (:class:`kvstore.cluster.port.LocalStore`) and the store hands it this object,
built from the parts that do the work. Every method keeps the store's own rules: the
catalogue lock is taken here, room is made by the :class:`~kvstore.store.room.Room`,
copies are recorded by the :class:`~kvstore.store.placement.Placement`, and only store
errors come out.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.common.errors import KVStoreError
from kvstore.policy import EvictionPolicy
from kvstore.store.catalogue import BlockEvent, Catalogue, Entry
from kvstore.store.media import TierAdapter
from kvstore.store.moves import Moves
from kvstore.store.placement import Placement
from kvstore.store.room import Room
from kvstore.store.writes import PutOutcome, Writes

log = logging.getLogger("kvstore.cluster.cluster")


class ClusterPort:
    """This node's store as the cluster level sees it (:class:`kvstore.cluster.port.LocalStore`).

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`); policies: one per tier.
        catalogue, placement, room, moves, writes: the store's parts.
        clock: the policies' time (seconds).
    """

    def __init__(self, tiers: Sequence[TierAdapter], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 placement: Placement, room: Room, moves: Moves, writes: Writes, clock: Callable[[], float]):
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.cat = catalogue
        self.placement = placement
        self.room = room
        self.moves = moves
        self.writes = writes
        self.clock = clock

    # ------------------------------------------------------------------ where blocks are

    def fastest(self, keys: Sequence[bytes]) -> list[int | None]:
        cat = self.cat
        with cat.lock:
            return [None if (e := cat.get(k)) is None else e.tiers[0] for k in keys]

    def writing(self, key: bytes) -> bool:
        return self.cat.claim(key) is not None

    def size_of(self, key: bytes) -> int | None:
        with self.cat.lock:
            e = self.cat.get(key)
            return None if e is None else e.size

    # ------------------------------------------------------------------ page-in

    def begin_put(self, key: bytes, nbytes: int, *, tier: int | None = None) -> PutOutcome:
        return self.writes.begin_put(key, nbytes, tier=tier)

    def commit_put(self, pending: Any, *, in_place: bool = False) -> None:
        self.writes.commit_put(pending, in_place=in_place)

    def abort_put(self, pending: Any) -> None:
        self.writes.abort_put(pending)

    def put(self, key: bytes, data: Any) -> bool:
        return self.writes.put(key, data)

    def promote(self, key: bytes, to: int) -> bool:
        return self.moves.promote_key(key, to, wait=True)

    # ------------------------------------------------------------------ publishing

    def pin_missing(self, keys: Sequence[bytes], tier: int, skip: Callable[[bytes], bool]) -> list[Entry]:
        cat = self.cat
        held: list[Entry] = []
        with cat.lock:
            for key in keys:
                e = cat.get(key)
                if e is not None and tier not in e.tiers and not skip(key):
                    cat.pin_entry(e)
                    held.append(e)
        return held

    def unpin(self, held: Entry) -> None:
        self.cat.unpin(held)

    def make_room(self, tier: int, nbytes: int) -> None:
        with self.cat.lock:
            self.room.make_room_locked(tier, nbytes, incoming=None)

    def payload(self, held: Entry, prefer: int | None, skip: int) -> Any | None:
        if prefer is not None and prefer in held.tiers:
            try:
                return self.tiers[prefer].view(held.key)
            except KVStoreError:
                pass
        for i in list(held.tiers):
            if i == skip:
                continue
            buf = np.empty(held.size, np.uint8)
            try:
                self.tiers[i].read_into(held.key, buf)
                return buf
            except KVStoreError as err:
                log.debug("reading block %s to publish it failed: %s", held.key.hex()[:16], err)
        return None

    def record_copies(self, held: Sequence[Entry], stored: Sequence[bool], tier: int) -> int:
        recorded = 0
        now = self.clock()
        cat = self.cat
        with cat.lock:
            for e, good in zip(held, stored):
                if not good:
                    continue
                if cat.raw(e.key) is e and not e.deleted and e.tiers and tier not in e.tiers:
                    self.policies[tier].insert(e.key, e.size, now)
                    self.placement.add_copy(e, tier, "write_through")
                    recorded += 1
                elif tier not in e.tiers:
                    self.tiers[tier].free(e.key)   # deleted meanwhile: its cluster copy goes too
        return recorded

    def watch_puts(self, listener: Callable[[bytes], None]) -> Callable[[], None]:
        events = self.cat.events

        def on_event(event: BlockEvent) -> None:
            if event.kind == "stored" and event.reason == "put":
                listener(event.key)
        events.subscribe(on_event)
        return lambda: events.unsubscribe(on_event)


__all__ = ["ClusterPort"]
