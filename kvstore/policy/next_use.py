"""``next_use``: evict the block whose predicted next use is farthest (online Belady).

Belady's MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2)) evicts the block used again farthest in the
future and is optimal; it needs the future. This policy predicts it from two sources:

1. **Explicit hints** (:meth:`NextUsePolicy.set_next_use`): the prefetch scheduler
   pushes the predicted resume time of a trajectory waiting on a tool call for all of
   its blocks. Their distance is ``t - now`` seconds. A hint counts until
   ``hint_grace_s`` seconds after its time (a tool that overruns), then the block falls
   back to (2). A hit consumes the hint.
2. **Learned reuse** (:class:`kvstore.predictor.ReuseModel`, shared by all tiers via
   :meth:`attach`): blocks belong to *records* (blocks last used together: a
   conversation's prefix, its partial tail block, a shared system prompt) with a class
   and an age; the model gives the expected seconds of residence per reuse for that
   class and age (the inverse of LHD's hit density; it is the time to the next use
   when that use is certain, so both sources compare on one scale).

The victim is the farthest candidate; candidates are, per class, the oldest and the
youngest record (the learned distance rises with age once past the usual reuse gap
and may fall at first, so within a class the extreme is at one of the two ends) and
the farthest explicitly hinted block. Within a record the block with the highest
position goes first (tail-first, as vLLM frees a request's blocks), so a partly
evicted prefix keeps its head, which still hits.

Admission control (``admission``, default on): when the tier is full, a new block
whose predicted next use is farther than the victim's is refused (Belady with
bypass); the manager then places it in a lower tier, or does not store it.

Without a model or hints every block is of the "unknown" class whose prior makes
younger blocks nearer: the policy then behaves as LRU with tail-first eviction.

Cost per operation: O(1) dict work plus O(classes) heap peeks per victim.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from typing import Callable, Sequence

from ..errors import ConfigError
from ..predictor import ReuseModel
from .base import EvictionPolicy, NoVictim, register


class _Group:
    """Resident blocks of one record, in position order."""

    __slots__ = ("rid", "cls", "t0", "keys")

    def __init__(self, rid: int, cls: int, t0: float):
        self.rid = rid
        self.cls = cls
        self.t0 = t0
        self.keys: dict[bytes, None] = {}


@register
class NextUsePolicy(EvictionPolicy):
    """Online Belady: evict the farthest predicted next use (see the module docstring).

    Args:
        capacity_bytes: the tier's capacity (admission compares against it).
        admission: refuse a new block when the tier is full and the block's predicted
            next use is farther than the victim's (bool, default true).
        hint_grace_s: seconds an explicit next-use hint stays valid past its time
            (default 30).
    Raises:
        ConfigError: unknown parameter or bad value.
    """

    name = "next_use"
    params_doc = {
        "admission": "refuse a block when full and its predicted next use is farther than the victim's (bool, true)",
        "hint_grace_s": "seconds a tool-call next-use hint stays valid past its predicted time (30)",
    }

    def __init__(self, capacity_bytes: int, **params):
        admission = params.pop("admission", True)
        grace = params.pop("hint_grace_s", 30.0)
        super().__init__(capacity_bytes, **params)
        if not isinstance(admission, bool):
            raise ConfigError(f"policy 'next_use': admission must be true or false, got {admission!r}")
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            raise ConfigError(f"policy 'next_use': hint_grace_s must be a number >= 0, got {grace!r}")
        self.admission = admission
        self.hint_grace_s = float(grace)
        self.model = ReuseModel()          # never fed unless replaced by attach(): prior only
        self._lock = threading.RLock()     # hints may arrive from the prefetch thread
        self._size: dict[bytes, int] = {}
        self._used = 0
        self._group_of: dict[bytes, _Group] = {}
        self._groups: dict[int, _Group] = {}
        self._old: dict[int, list[tuple[float, int]]] = {}     # per class: min-heap (t0, rid)
        self._young: dict[int, list[tuple[float, int]]] = {}   # per class: min-heap (-t0, -rid)
        self._explicit: dict[bytes, float] = {}
        self._far: list[tuple[float, int, bytes]] = []         # (-t, seq, key), resident explicit
        self._near: list[tuple[float, int, bytes]] = []        # (t, seq, key), for expiry
        self._seq = itertools.count()
        self._unknown_rid = itertools.count(-1, -1)
        self._last_unknown: _Group | None = None
        self.counters = {"refused": 0, "hinted": 0}

    # ------------------------------------------------------------------ hints

    def attach(self, model: ReuseModel) -> None:
        """Use ``model`` (fed with every request by the scheduler or simulator)."""
        with self._lock:
            self.model = model

    def set_next_use(self, keys: Sequence[bytes], times: float | Sequence[float], now: float) -> None:
        """Explicit predicted next use of ``keys`` (seconds, same clock as ``now``)."""
        with self._lock:
            seq = [times] * len(keys) if isinstance(times, (int, float)) else list(times)
            for key, t in zip(keys, seq):
                t = float(t)
                if t + self.hint_grace_s < now:
                    continue
                self._explicit[key] = t
                s = next(self._seq)
                heapq.heappush(self._near, (t, s, key))
                if key in self._size:
                    self._ungroup(key)
                    heapq.heappush(self._far, (-t, s, key))
                self.counters["hinted"] += 1

    # ------------------------------------------------------------------ groups

    def _group_for(self, key: bytes, now: float) -> _Group:
        rec = self.model.record_of(key)
        if rec is None:
            g = self._last_unknown
            if g is None or g.t0 != now or g.rid not in self._groups:
                g = _Group(next(self._unknown_rid), self.model.UNKNOWN, now)
                self._add_group(g)
                self._last_unknown = g
            return g
        g = self._groups.get(rec.rid)
        if g is None:
            g = _Group(rec.rid, rec.cls, rec.t0)
            self._add_group(g)
        return g

    def _add_group(self, g: _Group) -> None:
        self._groups[g.rid] = g
        heapq.heappush(self._old.setdefault(g.cls, []), (g.t0, g.rid))
        heapq.heappush(self._young.setdefault(g.cls, []), (-g.t0, -g.rid))

    def _ungroup(self, key: bytes) -> None:
        g = self._group_of.pop(key, None)
        if g is not None:
            del g.keys[key]
            if not g.keys:
                del self._groups[g.rid]

    def _place(self, key: bytes, now: float) -> None:
        """Put resident ``key`` in its hint heap or its record's group."""
        t = self._explicit.get(key)
        if t is not None and now <= t + self.hint_grace_s:
            self._ungroup(key)
            heapq.heappush(self._far, (-t, next(self._seq), key))
            return
        g = self._group_for(key, now)
        old = self._group_of.get(key)
        if old is g:
            return
        if old is not None:
            self._ungroup(key)
        g.keys[key] = None
        self._group_of[key] = g

    def _expire(self, now: float) -> None:
        near = self._near
        while near and near[0][0] + self.hint_grace_s < now:
            t, _, key = heapq.heappop(near)
            if self._explicit.get(key) == t:
                del self._explicit[key]
                if key in self._size:
                    self._place(key, now)

    # ------------------------------------------------------------------ protocol

    def insert(self, key: bytes, nbytes: int, now: float) -> None:
        with self._lock:
            if key not in self._size:
                self._size[key] = nbytes
                self._used += nbytes
            self._place(key, now)

    def access(self, key: bytes, now: float) -> None:
        with self._lock:
            if key not in self._size:
                return
            t = self._explicit.get(key)
            if t is not None and t - now > self.hint_grace_s:
                pass                       # an early touch (e.g. a lookup) does not consume a far hint
            elif t is not None:
                del self._explicit[key]    # the predicted use happened
            self._place(key, now)

    def remove(self, key: bytes) -> None:
        with self._lock:
            n = self._size.pop(key, None)
            if n is None:
                return
            self._used -= n
            self._ungroup(key)

    def admit(self, key: bytes, nbytes: int, now: float) -> bool:
        with self._lock:
            if not self.admission or self._used + nbytes <= self.capacity_bytes:
                return True
            self._expire(now)
            best = self._best(lambda k: True, now)
            if best is None:
                return True
            if self._distance_new(key, now) < best[0]:
                return True
            self.counters["refused"] += 1
            return False

    def victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None = None,
               now: float = 0.0) -> bytes:
        with self._lock:
            self._expire(now)
            best = self._best(evictable, now)
            if best is None:
                best = self._scan_all(evictable, now)
            if best is None:
                raise NoVictim(f"next_use: none of {len(self._size)} resident blocks is evictable")
            return best[2]

    def __contains__(self, key: bytes) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks this policy tracks as resident."""
        return self._used

    # ------------------------------------------------------------------ scoring

    def _distance_new(self, key: bytes, now: float) -> float:
        t = self._explicit.get(key)
        if t is not None and now <= t + self.hint_grace_s:
            return max(t - now, 0.0)
        rec = self.model.record_of(key)
        if rec is None:
            return self.model.distance(self.model.UNKNOWN, 0.0)
        return self.model.distance(rec.cls, now - rec.t0)

    def distance(self, key: bytes, now: float) -> float:
        """Predicted distance (seconds) of resident ``key`` to its next use."""
        with self._lock:
            g = self._group_of.get(key)
            if g is None:
                return self._distance_new(key, now)
            return self.model.distance(g.cls, now - g.t0)

    def _best(self, evictable: Callable[[bytes], bool], now: float) -> tuple[float, float, bytes] | None:
        """The farthest candidate as ``(distance, -t0, key)``; None if no candidate is evictable."""
        best: tuple[float, float, bytes] | None = None
        far = self._far
        skipped = []
        while far:
            negt, s, key = far[0]
            if key not in self._size or key in self._group_of or self._explicit.get(key) != -negt:
                heapq.heappop(far)
                continue
            if not evictable(key):
                skipped.append(heapq.heappop(far))
                continue
            best = (max(-negt - now, 0.0) if negt != -math.inf else math.inf, -now, key)
            break
        for item in skipped:
            heapq.heappush(far, item)
        groups = self._groups
        dist = self.model.distance
        for cls, heap in self._old.items():
            for h, sign in ((heap, 1), (self._young[cls], -1)):
                while h and (sign * h[0][1]) not in groups:
                    heapq.heappop(h)
                if not h:
                    continue
                g = groups[sign * h[0][1]]
                cand = (dist(g.cls, now - g.t0), -g.t0)
                if best is not None and cand <= best[:2]:
                    continue
                for key in reversed(g.keys):
                    if evictable(key):
                        best = (cand[0], cand[1], key)
                        break
        return best

    def _scan_all(self, evictable: Callable[[bytes], bool], now: float) -> tuple[float, float, bytes] | None:
        """Slow path when every candidate at the queue ends is pinned."""
        best = None
        for key in self._size:
            if not evictable(key):
                continue
            g = self._group_of.get(key)
            cand = (self.distance(key, now), -(g.t0 if g else now), key)
            if best is None or cand[:2] > best[:2]:
                best = cand
        return best
