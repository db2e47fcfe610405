"""Every call the prefetch scheduler makes into the tier manager, in one place.

:class:`kvstore.prefetch.PrefetchScheduler` reads placement and moves blocks only
through :class:`ManagerPort`, so a change of the manager's API touches this file
alone. What it needs:

- where a block is and how big (:meth:`ManagerPort.kind_of`, :meth:`size_of`,
  :meth:`in_fast`), the fastest tier's kind and room (:meth:`fast_kind`,
  :meth:`fast_fits`, :meth:`fast_free_bytes`, :meth:`fast_capacity_bytes`);
- the tiers' eviction policies (:meth:`policies`), to attach the reuse model and read
  ``next_use`` distances;
- moves: :meth:`promote` (copy up into the fastest tier), :meth:`demote` (move a
  block out of the fastest tier) and :meth:`make_room` (demote victims chosen by the
  fastest tier's policy among blocks the scheduler does not protect, until a block
  fits).

Today these use the manager's public methods (``promote``, ``demote``, ``tiers``,
``policies``) and, in :meth:`make_room`, its lock and the fastest policy's
``victim``: the one place that reaches into the manager's eviction. A manager with
a promotion API that takes a "protected" predicate would replace :meth:`make_room`.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable, Sequence

from tiers.base import TierKind

from .errors import KVStoreError
from .policy import EvictionPolicy, NoVictim

log = logging.getLogger("kvstore.prefetch")


class ManagerPort:
    """The prefetch scheduler's view of a :class:`kvstore.manager.TierManager`."""

    def __init__(self, manager):
        self.manager = manager

    # ------------------------------------------------------------------ reads

    def policies(self) -> Sequence[EvictionPolicy]:
        """One eviction policy per tier, fastest first."""
        return self.manager.policies

    def num_tiers(self) -> int:
        return len(self.manager.tiers)

    def fast_kind(self) -> TierKind:
        return self.manager.tiers[0].kind

    def in_fast(self, key: bytes) -> bool:
        """Whether the fastest tier holds ``key``."""
        return key in self.manager.tiers[0]

    def fast_fits(self, nbytes: int) -> bool:
        return self.manager.tiers[0].fits(nbytes)

    def fast_free_bytes(self) -> int:
        t = self.manager.tiers[0]
        return t.capacity_bytes - t.used_bytes

    def fast_capacity_bytes(self) -> int:
        return self.manager.tiers[0].capacity_bytes

    def kind_of(self, key: bytes) -> TierKind | None:
        """Kind of the fastest tier holding ``key``; None when not stored."""
        for t in self.manager.tiers:
            if key in t:
                return t.kind
        return None

    def size_of(self, key: bytes) -> int:
        """Bytes of ``key`` (0 when not stored)."""
        for t in self.manager.tiers:
            if key in t:
                return t.size_of(key)
        return 0

    def distance(self, key: bytes, now: float) -> float | None:
        """The fastest tier policy's predicted seconds to the next use of ``key``, when
        the policy predicts them (``next_use``); else None."""
        d = getattr(self.manager.policies[0], "distance", None)
        return None if d is None else d(key, now)

    # ------------------------------------------------------------------ moves

    def promote(self, key: bytes) -> bool:
        """Copy ``key`` up into the fastest tier. True when it is there now."""
        return self.manager.promote(key, 0)

    def demote(self, key: bytes) -> bool:
        """Move ``key`` out of the fastest tier to the next one. False when it is not
        there, pinned, or the move failed (logged); never drops the only copy."""
        if len(self.manager.tiers) < 2:
            return False
        try:
            return self.manager.demote(key, 0)
        except KVStoreError as e:   # the lower tier failed or is full: keep the block here
            log.warning("prefetch: demotion of %s failed: %s", key.hex()[:16], e)
            return False

    def make_room(self, nbytes: int, protected: Callable[[bytes], bool], need_in_s: float,
                  now: float, on_demoted: Callable[[bytes], None]) -> bool:
        """Demote the fastest tier's policy victims among unprotected blocks until
        ``nbytes`` fit. A ``next_use`` victim predicted to be needed within
        ``need_in_s`` seconds stops it (False). Calls ``on_demoted(key)`` per move."""
        if self.fast_fits(nbytes):
            return True
        policy = self.manager.policies[0]
        distance = getattr(policy, "distance", None)
        refused: set[bytes] = set()
        with getattr(self.manager, "lock", None) or nullcontext():
            while not self.fast_fits(nbytes):
                try:
                    victim = policy.victim(lambda k: not protected(k) and k not in refused, incoming=None, now=now)
                except NoVictim:
                    return False
                if distance is not None and distance(victim, now) < need_in_s:
                    return False
                if self.demote(victim):
                    on_demoted(victim)
                else:
                    refused.add(victim)
        return True
