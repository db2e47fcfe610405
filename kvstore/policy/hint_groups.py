"""The explicit next-use hints of one ``next_use`` policy: hint groups, gap classes, distance, expiry.

A hint says that some keys will be used at ``t`` (seconds), as predicted at ``t_set``
(a session's expected-back time, a tool call's predicted resume). The keys of one hint
form a :class:`HintGroup`, evicted tail first. Groups are classed by their hinted gap
``t - t_set`` (bins 1.25x apart, 0.25 s to about 4 h); per class two heaps keep the
groups hinted longest ago and most recently, the two ends at which the farthest
candidate of a class lies (:meth:`HintGroups.best`).

A group's distance (seconds to its use, :meth:`HintGroups.distance`) is ``t - now``
until ``t``; after it the hint is overdue and the distance grows as ``overdue_ratio *
(now - t)`` (the longer overdue, the later and the less likely the return), unless a
:class:`kvstore.agent.hint_model.HintCalibration` learned from the hints' outcomes gives
it. ``hint_grace_s`` after ``t`` the hint expires (:meth:`HintGroups.expire`) and its
keys fall back to the learned reuse model.

Plain Python; not thread-safe on its own: the policy's lock is held around every call.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Callable, Iterable, Iterator

_GAP0, _GAP_STEP, _GAP_BINS = 0.25, math.log(1.25), 56   # hint classes: gap bins 0.25 s .. ~4 h


def push_ends(old: dict[int, list], young: dict[int, list], cls: int, t: float, ident: int,
              live: Callable[[], Iterable[tuple[float, int]]], bound: int) -> None:
    """Push ``(t, ident)`` onto class ``cls``'s two end heaps: ``old`` holds ``(t, ident)``
    (oldest at the top), ``young`` ``(-t, -ident)`` (youngest). Entries of items gone are
    skipped when they reach a top; once either heap passes ``bound`` entries both are
    rebuilt from ``live()``, the ``(t, ident)`` of the class's items still there."""
    o, y = old.setdefault(cls, []), young.setdefault(cls, [])
    heapq.heappush(o, (t, ident))
    heapq.heappush(y, (-t, -ident))
    if max(len(o), len(y)) > bound:
        entries = list(live())
        old[cls] = [(a, b) for a, b in entries]
        young[cls] = [(-a, -b) for a, b in entries]
        heapq.heapify(old[cls])
        heapq.heapify(young[cls])


class HintGroup:
    """One explicit hint: keys expected to be used at ``t``, hinted at ``t_set`` (seconds).

    Attributes:
        hid: unique id (increasing).
        exact: the time is a commitment (a page back kept until used), not a prediction.
        gap: the hinted gap ``t - t_set`` (seconds, at least 1 ms); cls: its gap class.
        pos: key -> position in the hinted prefix.
        resident: the keys resident in the tier (:meth:`tail_first`: in position order,
            last first; blocks arriving in any order cost O(log n) each to place).
        queued: in the candidate heaps.
    """

    __slots__ = ("hid", "t", "t_set", "gap", "cls", "pos", "resident", "queued", "exact", "_key_at", "_order")

    def __init__(self, hid: int, t: float, t_set: float, exact: bool = False):
        self.hid = hid
        self.exact = exact
        self.t = t
        self.t_set = t_set
        self.gap = max(t - t_set, 1e-3)
        self.cls = max(0, min(int(math.log(self.gap / _GAP0) / _GAP_STEP), _GAP_BINS - 1))
        self.pos: dict[bytes, int] = {}
        self.resident: set[bytes] = set()
        self.queued = False                        # in the candidate heaps
        self._key_at: dict[int, bytes] = {}        # position -> key
        self._order: list[int] = []                # positions of the resident keys, ascending

    def name(self, key: bytes, pos: int) -> None:
        """``key`` is at position ``pos`` of the hinted prefix."""
        self.pos[key] = pos
        self._key_at[pos] = key

    def forget(self, key: bytes) -> None:
        """``key`` leaves the group (resident or not)."""
        self.drop_resident(key)
        del self._key_at[self.pos.pop(key)]

    def add_resident(self, key: bytes) -> None:
        if key in self.resident:
            return
        self.resident.add(key)
        p, order = self.pos[key], self._order
        if not order or p > order[-1]:
            order.append(p)
        else:
            bisect.insort(order, p)

    def drop_resident(self, key: bytes) -> None:
        if key not in self.resident:
            return
        self.resident.discard(key)
        p, order = self.pos[key], self._order
        if order[-1] == p:
            order.pop()
        else:
            del order[bisect.bisect_left(order, p)]

    def tail_first(self) -> Iterator[bytes]:
        """The resident keys, last position first."""
        at = self._key_at
        for p in reversed(self._order):
            yield at[p]


class HintGroups:
    """Every explicit hint of one tier's ``next_use`` policy.

    Args:
        hint_grace_s: seconds a hint stays valid past its time.
        overdue_ratio: distance of an overdue hint per second overdue.

    Attributes:
        calibration: a :class:`kvstore.agent.hint_model.HintCalibration` (set by the session
            table through the policy's ``use_calibration``), or None: hints as given.
    """

    def __init__(self, hint_grace_s: float, overdue_ratio: float):
        self.hint_grace_s = hint_grace_s
        self.overdue_ratio = overdue_ratio
        self.calibration = None
        self._hint_of: dict[bytes, HintGroup] = {}
        self._hints: dict[int, HintGroup] = {}
        self._hold: dict[int, list[tuple[float, int]]] = {}     # per gap class: (t_set, hid)
        self._hyoung: dict[int, list[tuple[float, int]]] = {}   # per gap class: (-t_set, -hid)
        self._expiry: list[tuple[float, int]] = []    # (t, hid): every hint, for expiry
        self._hid = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` has a hint."""
        return key in self._hint_of

    def group_of(self, key: bytes) -> HintGroup | None:
        return self._hint_of.get(key)

    # ------------------------------------------------------------------ changes

    def new_group(self, t: float, since: float, exact: bool = False) -> HintGroup:
        """A new, empty hint group for use at ``t``, hinted at ``since`` (seconds)."""
        h = HintGroup(next(self._hid), t, since, exact)
        self._hints[h.hid] = h
        heapq.heappush(self._expiry, (t, h.hid))
        if len(self._expiry) > 2 * len(self._hints) + 1024:     # groups whose keys all moved on
            self._expiry = [e for e in self._expiry if e[1] in self._hints]
            heapq.heapify(self._expiry)
        return h

    def assign(self, h: HintGroup, key: bytes, pos: int) -> None:
        """``key`` (at position ``pos`` of the prefix) is hinted by ``h`` now, no longer by
        any earlier hint (a key named twice in one hint keeps its first position). Call
        :meth:`join` too when it is resident."""
        if self._hint_of.get(key) is h:
            return
        self.unhint(key)
        h.name(key, pos)
        self._hint_of[key] = h

    def join(self, h: HintGroup, key: bytes) -> None:
        """Resident ``key`` joins hint group ``h`` (which re-enters the candidate heaps)."""
        h.add_resident(key)
        if not h.queued:
            h.queued = True
            push_ends(self._hold, self._hyoung, h.cls, h.t_set, h.hid, bound=2 * len(self._hints) + 1024,
                      live=lambda: ((g.t_set, g.hid) for g in self._hints.values() if g.cls == h.cls and g.queued))

    def unhint(self, key: bytes) -> bool:
        """Drop ``key``'s hint; False when it had none."""
        h = self._hint_of.pop(key, None)
        if h is None:
            return False
        h.forget(key)
        if not h.pos:
            del self._hints[h.hid]
        return True

    def left(self, key: bytes) -> None:
        """``key`` left the tier: it keeps its hint, but is no candidate."""
        h = self._hint_of.get(key)
        if h is not None:
            h.drop_resident(key)

    def expire(self, now: float) -> Iterator[tuple[bytes, float]]:
        """Drop the hints ``hint_grace_s`` past their time at ``now`` (seconds), yielding
        ``(key, t)`` for every key that lost its hint (``t``: the hinted time)."""
        exp = self._expiry
        while exp and exp[0][0] + self.hint_grace_s < now:
            _, hid = heapq.heappop(exp)
            h = self._hints.get(hid)
            if h is None:
                continue
            for key in list(h.pos):
                self.unhint(key)
                yield key, h.t

    # ------------------------------------------------------------------ scoring

    def distance(self, h: HintGroup, now: float) -> float:
        """Seconds from ``now`` until ``h``'s keys are used (see the module docstring)."""
        cal = self.calibration
        if cal is not None and cal.ready and not h.exact:
            return cal.distance(h.gap, now - h.t_set)
        if now <= h.t:
            return h.t - now
        return self.overdue_ratio * (now - h.t)

    def best(self, evictable: Callable[[bytes], bool], now: float) -> tuple[float, float, bytes] | None:
        """The farthest evictable hinted candidate as ``(distance, -t_set, key)``: the tail
        block of the group at either end of each gap class; None if there is none."""
        best: tuple[float, float, bytes] | None = None
        for cls, heap in self._hold.items():
            for h, sign in ((heap, 1), (self._hyoung[cls], -1)):
                cand = self._candidate(h, sign, evictable, now)
                if cand is not None and (best is None or cand[:2] > best[:2]):
                    best = cand
        return best

    def _candidate(self, heap: list, sign: int, evictable, now: float) -> tuple | None:
        """The evictable tail block of the hint group at the top of ``heap``."""
        skipped, found = [], None
        while heap:
            h = self._hints.get(sign * heap[0][1])
            if h is None:
                heapq.heappop(heap)
                continue
            if not h.resident:                         # re-queued when a block arrives
                heapq.heappop(heap)
                h.queued = False
                continue
            key = next((k for k in h.tail_first() if evictable(k)), None)
            if key is None:
                skipped.append(heapq.heappop(heap))
                continue
            found = (self.distance(h, now), -h.t_set, key)
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found
