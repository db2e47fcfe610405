"""``next_use``: evict the block whose predicted next use is farthest (online Belady).

Belady's MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2)) evicts the block used again farthest in the
future and is optimal; it needs the future. This policy predicts it from three sources:

1. **Blocks let go** (:meth:`EvictionPolicy.let_go`, from session hints: the session
   finished or was abandoned) are never used again: the first victims (base class).
2. **Explicit hints** (:meth:`NextUsePolicy.set_next_use`): a session's expected-back
   time (:mod:`kvstore.agent.sessions`) or a tool call's predicted resume
   (:mod:`kvstore.agent.prefetch`). The keys of one call form a *hint group* with one time
   ``t``: its distance is ``t - now``; once ``t`` has passed without the use (the
   session or tool is late) the distance grows as ``overdue_ratio * (now - t)`` (the
   longer overdue, the later and the less likely the return) until ``hint_grace_s``
   after ``t``, when the hint is dropped and the blocks fall back to (3). A hit does
   not consume a hint: it stays until replaced, cleared (the session returned) or
   expired. The hint groups are kept by :class:`kvstore.policy.hint_groups.HintGroups`.
3. **Learned reuse** (:class:`kvstore.policy.reuse_model.ReuseModel`, shared by all tiers via
   :meth:`attach`): blocks belong to *records* (blocks last used together: a
   conversation's prefix, its partial tail block, a shared system prompt) with a class
   and an age; the model gives the expected seconds of residence per reuse for that
   class and age (the inverse of LHD's hit density; it is the time to the next use
   when that use is certain, so the sources compare on one scale).

The victim is the farthest candidate; candidates are, per class, the oldest and the
youngest record (the learned distance rises with age once past the usual reuse gap
and may fall at first, so within a class the extreme is at one of the two ends), and
the same two ends of every class of hint groups (classed by their hinted gap, 1.25x
apart). Within a record or a hint group the block with the highest position goes first
(tail-first, as vLLM frees a request's blocks), so a partly evicted prefix keeps its
head, which still hits.

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
from typing import Callable, Sequence

from kvstore.common.errors import ConfigError
from kvstore.policy.base import EvictionPolicy, NoVictim, register
from kvstore.policy.hint_groups import HintGroups, push_ends
from kvstore.policy.reuse_model import ReuseModel


class _Group:
    """Resident blocks of one record, in position order."""

    __slots__ = ("rid", "cls", "t0", "keys")

    def __init__(self, rid: int, cls: int, t0: float):
        self.rid = rid
        self.cls = cls
        self.t0 = t0
        self.keys: dict[bytes, None] = {}


def _number(name: str, value, lo: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo:
        raise ConfigError(f"policy 'next_use': {name} must be a number >= {lo:g}, got {value!r}")
    return float(value)


@register
class NextUsePolicy(EvictionPolicy):
    """Online Belady: evict the farthest predicted next use (see the module docstring).

    Args:
        capacity_bytes: the tier's capacity (admission compares against it).
        admission: refuse a new block when the tier is full and the block's predicted
            next use is farther than the victim's (bool, default true).
        hint_grace_s: seconds an explicit hint stays valid past its time (default 300).
        overdue_ratio: distance of an overdue hint per second overdue (default 1.0).
    Raises:
        ConfigError: unknown parameter or bad value.
    """

    name = "next_use"
    params_doc = {
        "admission": "refuse a block when full and its predicted next use is farther than the victim's (bool, true)",
        "hint_grace_s": "seconds a next-use hint stays valid past its predicted time (300)",
        "overdue_ratio": "predicted seconds to the next use per second a hint is overdue (1.0)",
    }

    def __init__(self, capacity_bytes: int, **params):
        admission = params.pop("admission", True)
        grace = params.pop("hint_grace_s", 300.0)
        overdue = params.pop("overdue_ratio", 1.0)
        super().__init__(capacity_bytes, **params)
        if not isinstance(admission, bool):
            raise ConfigError(f"policy 'next_use': admission must be true or false, got {admission!r}")
        self.admission = admission
        self.hint_grace_s = _number("hint_grace_s", grace)
        self.overdue_ratio = _number("overdue_ratio", overdue)
        self.model = ReuseModel()          # never fed unless replaced by attach(): prior only
        self._group_of: dict[bytes, _Group] = {}
        self._groups: dict[int, _Group] = {}
        self._old: dict[int, list[tuple[float, int]]] = {}     # per class: min-heap (t0, rid)
        self._young: dict[int, list[tuple[float, int]]] = {}   # per class: min-heap (-t0, -rid)
        self.hint_groups = HintGroups(self.hint_grace_s, self.overdue_ratio)
        self._unknown_rid = itertools.count(-1, -1)
        self._last_unknown: _Group | None = None
        self.counters = {"refused": 0, "hinted": 0}

    # ------------------------------------------------------------------ hints

    def use_calibration(self, calibration) -> None:
        """Correct hinted gaps with ``calibration`` (a
        :class:`kvstore.agent.hint_model.HintCalibration`, or None: hints as given)."""
        self.hint_groups.calibration = calibration

    def attach(self, model: ReuseModel) -> None:
        """Use ``model`` (fed with every request by the scheduler or simulator)."""
        with self._lock:
            self.model = model

    def set_next_use(self, keys: Sequence[bytes], times: float | Sequence[float], now: float,
                     since: float | None = None, exact: bool = False) -> None:
        """Explicit predicted next use of ``keys`` (seconds, same clock as ``now``), in
        prefix order, hinted at ``since`` (default ``now``). One time for all keys makes
        one hint group (evicted tail first); per-key times make one group per run of
        equal times. ``math.inf`` = never: the keys are let go (first victims).
        ``exact``: the time is a commitment (a prefetch that must be kept until used),
        not a prediction to calibrate: the fixed rule applies."""
        with self._lock:
            seq = [times] * len(keys) if isinstance(times, (int, float)) else list(times)
            run: list[bytes] = []
            for i, key in enumerate(keys):
                run.append(key)
                if i + 1 == len(keys) or seq[i + 1] != seq[i]:
                    self._hint_group(run, float(seq[i]), now, now if since is None else min(since, now), exact)
                    run = []

    def _hint_group(self, keys: list[bytes], t: float, now: float, since: float, exact: bool = False) -> None:
        if t == math.inf:
            self.clear_hints(keys, now)
            self.let_go(keys)
            return
        if t + self.hint_grace_s < now:
            return
        self._expire(now)          # also here: evictions served by blocks let go never expire hints
        self.revive(keys)
        h = self.hint_groups.new_group(t, since, exact)
        for i, key in enumerate(keys):
            self.hint_groups.assign(h, key, i)
            if key in self._sizes:
                self._ungroup(key)
                self.hint_groups.join(h, key)
            self.counters["hinted"] += 1

    def clear_hints(self, keys: Sequence[bytes], now: float) -> None:
        """Drop explicit hints of ``keys``: they fall back to the learned model."""
        with self._lock:
            for key in keys:
                if self.hint_groups.unhint(key) and key in self._sizes:
                    self._place(key, now)

    # ------------------------------------------------------------------ groups

    def _group_for(self, key: bytes, now: float) -> _Group:
        rec = self.model.record_of(key)
        if rec is None:   # unknown to the model: a group per time of last use
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
        push_ends(self._old, self._young, g.cls, g.t0, g.rid, bound=2 * len(self._groups) + 1024,
                  live=lambda: ((x.t0, x.rid) for x in self._groups.values() if x.cls == g.cls))

    def _ungroup(self, key: bytes) -> None:
        g = self._group_of.pop(key, None)
        if g is not None:
            del g.keys[key]
            if not g.keys:
                del self._groups[g.rid]

    def _place(self, key: bytes, now: float) -> None:
        """Put resident ``key`` in its hint group or its record's group."""
        h = self.hint_groups.group_of(key)
        if h is not None:
            self._ungroup(key)
            self.hint_groups.join(h, key)
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
        for key, t in self.hint_groups.expire(now):
            if key in self._sizes:
                self._place(key, min(t, now))   # age from the use that did not come

    # ------------------------------------------------------------------ protocol

    def _insert(self, key: bytes, nbytes: int, now: float) -> None:
        with self._lock:
            self._place(key, now)

    def _access(self, key: bytes, now: float) -> None:
        with self._lock:
            if key in self._sizes and key not in self.hint_groups:
                self._place(key, now)      # a hint stays until replaced, cleared or expired

    def _remove(self, key: bytes) -> None:
        with self._lock:
            self._ungroup(key)
            self.hint_groups.left(key)

    def _admit(self, key: bytes, nbytes: int, now: float) -> bool:
        with self._lock:
            if not self.admission or self._used + nbytes <= self.capacity_bytes or self._let_go_resident:
                return True
            self._expire(now)
            best = self._best(lambda k: True, now)
            if best is None or self._distance_new(key, now) < best[0]:
                return True
            self.counters["refused"] += 1
            return False

    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes:
        with self._lock:
            self._expire(now)
            best = self._best(evictable, now)
            if best is None:
                best = self._scan_all(evictable, now)
            if best is None:
                raise NoVictim(f"next_use: none of {len(self._sizes)} resident blocks is evictable")
            return best[2]

    def victim_reason(self, key: bytes, now: float) -> str:
        d = self.distance(key, now)
        src = "hint" if key in self.hint_groups else "learned reuse"
        return "never used again" if d == math.inf else f"farthest predicted next use ({d:.1f} s, {src})"

    # ------------------------------------------------------------------ scoring

    def _distance_new(self, key: bytes, now: float) -> float:
        if self._still_let_go(key, now):
            return math.inf
        h = self.hint_groups.group_of(key)
        if h is not None:
            return self.hint_groups.distance(h, now)
        rec = self.model.record_of(key)
        if rec is None:
            return self.model.distance(self.model.UNKNOWN, 0.0)
        return self.model.distance(rec.cls, now - rec.t0)

    def distance(self, key: bytes, now: float) -> float:
        """Predicted distance (seconds) of ``key`` to its next use; inf when let go."""
        with self._lock:
            g = self._group_of.get(key)
            if g is None or self._still_let_go(key, now):
                return self._distance_new(key, now)
            return self.model.distance(g.cls, now - g.t0)

    def _best(self, evictable: Callable[[bytes], bool], now: float) -> tuple[float, float, bytes] | None:
        """The farthest candidate as ``(distance, -t0, key)``; None if no candidate is evictable."""
        best = self.hint_groups.best(evictable, now)
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
        for key in self._sizes:
            if not evictable(key):
                continue
            g = self._group_of.get(key)
            cand = (self.distance(key, now), -(g.t0 if g else now), key)
            if best is None or cand[:2] > best[:2]:
                best = cand
        return best
