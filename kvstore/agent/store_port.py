"""Every call the prefetch scheduler makes into the tier manager, in one place.

:class:`kvstore.agent.prefetch.PrefetchScheduler` reads placement and moves blocks only
through :class:`ManagerPort`, so a change of the manager's API touches this file
alone. What it needs:

- whether an engine still holds a block in its own cache (:meth:`ManagerPort.engine_holds`);
- where a block is and how big (:meth:`ManagerPort.kind_of`, :meth:`size_of`,
  :meth:`in_fast`), the fastest tier's kind and room (:meth:`fast_kind`,
  :meth:`fast_fits`, :meth:`fast_free_bytes`, :meth:`fast_capacity_bytes`);
- the tiers' eviction policies (:meth:`policies`), to attach the reuse model and read
  ``next_use`` distances;
- moves: :meth:`promote` (copy up into the fastest tier), :meth:`demote` (move a
  block out of the fastest tier), :meth:`make_room` (demote victims chosen by the
  fastest tier's policy among blocks the scheduler does not protect, until a block
  fits) and :meth:`page_in` (blocks held only in the cluster, into the host arena in the
  background).

Every method maps to one public method of the manager (or of its :class:`kvstore.store.reads.Reads`); none takes the manager's lock
or chooses victims itself: :meth:`make_room` asks :meth:`TierManager.make_room` (the
store's one room-making object, :class:`kvstore.store.room.Room`, which alone asks the
policy for victims) to demote unprotected blocks, and learns which ones moved from its
callback; :meth:`promote` is the store's one promotion path
(:meth:`kvstore.store.moves.Moves.promote`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from tiers.base import TierKind

from kvstore.agent.engine_holdings import event_hash
from kvstore.policy import EvictionPolicy


class ManagerPort:
    """The prefetch scheduler's view of a :class:`kvstore.store.manager.TierManager`."""

    def __init__(self, manager, engines=None):
        self.manager = manager
        self.engines = engines          # EngineHoldings, or None: no engine's holdings are known

    # ------------------------------------------------------------------ reads

    def policies(self) -> Sequence[EvictionPolicy]:
        """One eviction policy per tier, fastest first (to attach models, read distances)."""
        return self.manager.policies

    def num_tiers(self) -> int:
        return self.manager.num_tiers

    def fast_kind(self) -> TierKind:
        return self.manager.tier_kind(0)

    def in_fast(self, key: bytes) -> bool:
        """Whether the fastest tier holds ``key``."""
        loc = self.manager.locate(key)
        return loc is not None and loc[1] == 0

    def fast_fits(self, nbytes: int) -> bool:
        return self.manager.fits(0, nbytes)

    def fast_free_bytes(self) -> int:
        return self.manager.capacity_bytes(0) - self.manager.used_bytes(0)

    def fast_capacity_bytes(self) -> int:
        return self.manager.capacity_bytes(0)

    def kind_of(self, key: bytes) -> TierKind | None:
        """Kind of the fastest tier holding ``key``; None when not stored."""
        loc = self.manager.locate(key)
        return None if loc is None else self.manager.tier_kind(loc[1])

    def size_of(self, key: bytes) -> int:
        """Bytes of ``key`` (0 when not stored)."""
        loc = self.manager.locate(key)
        return 0 if loc is None else loc[0]

    def engine_hash(self, key: bytes) -> int | None:
        """The hash engines' KV events name ``key`` by, when the engines' holdings are
        known and its put carried one (:func:`kvstore.agent.engine_holdings.event_hash`)."""
        if self.engines is None:
            return None
        h = self.manager.reads.engine_hash(key)
        return event_hash(h) if h else None

    def engine_holds(self, key: bytes) -> bool:
        """Whether an engine still holds ``key`` in its own KV cache (it will not load it
        from the store; :mod:`kvstore.agent.engine_holdings`). False when unknown."""
        h = self.engine_hash(key)
        return h is not None and self.engines.holds(h)

    def evict_engine_held_first(self, unless_within_s: float = 0.0,
                                clock: Callable[[], float] = time.monotonic) -> None:
        """Make the blocks an engine holds, where a lower tier has their copy, the first
        victims of every tier above the last (:attr:`kvstore.store.room.Room.redundant`):
        exclusive caching, as in Wong and Wilkes, "My cache or yours? Making storage more
        exclusive" (USENIX ATC 2002), but for blocks the fastest tier's policy predicts to
        be used within ``unless_within_s`` seconds (at ``clock()``) and blocks an engine
        stored within the last ``unless_within_s`` seconds (a running request's, whose agent
        is back soon): an engine short of room drops blocks at any time, and one dropped just
        before its use is paged back too late, so a block needed soon keeps its copy. No-op
        when the engines' holdings are unknown."""
        if self.engines is None:
            return
        if unless_within_s <= 0:
            self.manager.room.redundant = self.engine_holds
            return

        def redundant(key: bytes) -> bool:
            h = self.engine_hash(key)
            age = self.engines.held_for(h) if h is not None else None     # None: not held
            if age is None or age <= unless_within_s:       # stored just now: its request runs
                return False
            d = self.distance(key, clock())
            return d is None or d > unless_within_s
        self.manager.room.redundant = redundant

    def engines_dropped(self) -> tuple[list[int], bool]:
        """The hashes of blocks engines dropped since the last call, and whether any held
        block may have been (:meth:`EngineHoldings.take_removed`); ``([], False)`` unknown."""
        return ([], False) if self.engines is None else self.engines.take_removed()

    def distance(self, key: bytes, now: float) -> float | None:
        """The fastest tier policy's predicted seconds to the next use of ``key``, when
        the policy predicts them (``next_use``); else None."""
        return self.manager.distance(0, key, now)

    # ------------------------------------------------------------------ moves

    def promote(self, key: bytes) -> bool:
        """Copy ``key`` up into the fastest tier. True when it is there now."""
        return self.manager.promote(key, 0)

    def demote(self, key: bytes) -> bool:
        """Move ``key`` out of the fastest tier to the next one. False when it is not
        there, pinned, or the move failed (logged by the manager); never drops the only
        copy."""
        if self.manager.num_tiers < 2:
            return False
        return self.manager.demote(key, 0)

    def make_room(self, nbytes: int, protected: Callable[[bytes], bool], need_in_s: float,
                  now: float, on_demoted: Callable[[bytes], None]) -> bool:
        """Demote the fastest tier's policy victims among unprotected blocks until
        ``nbytes`` fit (:meth:`TierManager.make_room`). A ``next_use`` victim predicted to
        be needed within ``need_in_s`` seconds stops it (False). Calls ``on_demoted(key)``
        per move."""
        if self.manager.num_tiers < 2:
            return self.fast_fits(nbytes)

        def sooner(victim: bytes) -> bool:
            d = self.manager.distance(0, victim, now)
            return d is not None and d < need_in_s
        return self.manager.make_room(0, nbytes, protect=protected, give_up=sooner, on_moved=on_demoted)

    def page_in(self, keys: Sequence[bytes], on_done: Callable[[set[bytes], float], None]) -> bool:
        """Ask for the blocks of ``keys`` held only in the cluster to be paged into the host
        arena in the background (:meth:`kvstore.cluster.cluster.Cluster.pull_ahead`);
        ``on_done(paged_keys, seconds)`` runs when they are. False when there is no
        cluster or every block is local (nothing asked)."""
        cluster = self.manager.cluster
        if cluster is None:
            return False
        if all((loc := self.manager.locate(k)) is not None and loc[1] != cluster.index for k in keys):
            return False
        cluster.pull_ahead(keys, on_done)
        return True
