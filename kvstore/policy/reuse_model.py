"""The learned reuse model of the ``next_use`` policy: how likely and how soon a prefix returns.

Plain Python/numpy, driven with explicit times (seconds) so the daemon (wall clock) and
``kvstore simulate`` (virtual clock) share it. (Tool-call durations are learned apart,
in :mod:`kvstore.agent.tool_durations`.)

- :class:`ReuseModel`: learns, from the stream of request prefixes alone, how likely
  and how soon a stored prefix is used again; the ``next_use`` eviction policy turns
  that into a predicted distance to the next use of each block.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def best_hit_density(lam: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Best hit density from each age bin on, maximised over the wait horizon.

    ``lam[b]`` is the probability of the reuse in bin ``b`` given none before; ``widths``
    the bins' widths (seconds, or any unit of time). Returns, per bin ``b``,
    ``max_e P(reuse by the end of bin e | none before b) / E[time resident until then]``
    (reuses per unit of time; cf. Beckmann et al., LHD, NSDI'18). Its inverse is the
    expected residence per reuse: the time to the next use when that use is certain.
    """
    nb = len(lam)
    surv = np.concatenate([[1.0], np.cumprod(1.0 - lam)])
    resid = widths * (surv[:-1] + surv[1:]) / 2.0        # expected time resident per bin
    cum_res = np.concatenate([[0.0], np.cumsum(resid)])
    out = np.zeros(nb)
    for b in range(nb):
        if surv[b] <= 1e-12:
            continue
        p = (surv[b] - surv[b + 1:]) / surv[b]                   # P(reuse by end of e), e >= b
        e = (cum_res[b + 1:] - cum_res[b]) / surv[b]
        out[b] = float(np.max(p / np.maximum(e, 1e-9)))
    return out


def censored_counts(times: np.ndarray, at_risk_for: np.ndarray, horizon: float,
                    edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier (Kaplan & Meier 1958) counts per bin of ``edges``.

    ``times[i]``: when item i's event happened (``inf``: not yet); ``at_risk_for[i]``: how
    long it has been observed. An event counts in its bin; an item without one is censored
    at ``min(at_risk_for, horizon)`` and counts half a bin at risk there. Returns
    ``(events, at_risk)``, one float per bin.
    """
    nb = len(edges) - 1
    seen = times <= at_risk_for
    exit_t = np.where(seen, times, np.minimum(at_risk_for, horizon))
    b = np.clip(np.searchsorted(edges, exit_t, side="right") - 1, 0, nb - 1)
    events = np.bincount(b[seen], minlength=nb).astype(float)
    exits = np.bincount(b, minlength=nb).astype(float)
    return events, np.cumsum(exits[::-1])[::-1] - 0.5 * (exits - events)


# --------------------------------------------------------------------------- reuse


@dataclass(eq=False)
class Record:
    """A run of blocks that were last used together and are expected to be reused together.

    Attributes:
        rid: unique id (increasing).
        cls: reuse class (see :class:`ReuseModel`).
        t0: time of the use that formed the record (seconds).
        turn: how many times the conversation was continued before this request.
        keys: the keys assigned to it (some may have moved to newer records since).
        nkeys: how many of ``keys`` still belong to it.
        sample: ``[t0, gap]`` entry in the class's learning window (``gap`` = seconds to
            the first reuse, ``inf`` until then).
    """

    rid: int
    cls: int
    t0: float
    turn: int
    keys: list[bytes] = field(default_factory=list)
    nkeys: int = 0
    sample: list[float] = field(default_factory=list)


class ReuseModel:
    """Learns how soon a stored prefix is reused, online, from request prefixes only.

    Every request's keys are split into *records* (blocks last used together):

    - **conversation** records: the request's blocks except the last, classed by *turn*
      (how many times this conversation has been continued, capped at
      ``turn_buckets - 1``): in the Mooncake conversation trace a conversation that was
      continued k times is more likely to be continued again (0.31 for k = 0, 0.51 for
      k = 2, > 0.7 for k >= 6).
    - a **tail** record: the request's last block, often partial and then never reused.
    - a **shared** record: leading blocks that another, diverging request used too
      (system prompts, shared documents).

    A request that re-uses all of a conversation record *continues* it: the record's
    first reuse time is observed. Per class the model estimates the reuse-time
    distribution with a Kaplan-Meier estimator over log-spaced age bins (censoring:
    records not reused yet count as at risk up to their current age; Kaplan & Meier
    1958), smoothed towards the pooled estimate. From the hazard it derives, for each
    class and age, the best achievable *hit density* (expected reuses per second of
    cache residence, maximised over how long one waits: a Gittins-style index; cf.
    Beckmann, Chen & Cidon, "LHD: Improving cache hit rate by maximizing hit density",
    NSDI'18). :meth:`distance` is its inverse: the expected seconds of residence per
    reuse, which equals the time to the next use when that use is certain, so it is
    what an online Belady (farthest next use first) evicts by.

    Args:
        turn_buckets: conversation classes (turns 0 .. turn_buckets-1, the last is open).
        horizon_s: oldest age the model reasons about (seconds); older is "never".
        window: learning samples kept per class (recent ones).
        refresh_every: requests between recomputations of the tables.
        max_records: records remembered; max_keys: keys mapped to records. The oldest
            records are forgotten past either bound, or past ``horizon_s``.
        bins: number of log-spaced age bins between ``min_age_s`` and ``horizon_s``.
        min_age_s, prior_beta: the prior's smallest age bin and decreasing hazard.
        smoothing: pseudo observations pulling each class towards the pooled estimate.
        growth_buckets: edges of the "blocks added by the request" classes.
        gap_buckets: edges (seconds) of the "gap since the previous turn" classes of
            continued conversations (empty: no such classes).

    The defaults of ``window`` (512) and ``gap_buckets`` (60 s, 180 s) were chosen on the
    first half of the Mooncake conversation trace (``bench/placement_trace.py``).
    """

    def __init__(self, turn_buckets: int = 4, horizon_s: float = 3600.0, window: int = 512,
                 refresh_every: int = 64, max_records: int = 200_000, max_keys: int = 2_000_000,
                 bins: int = 28,
                 min_age_s: float = 0.25, prior_beta: float = 0.5, smoothing: float = 4.0,
                 growth_buckets: Sequence[int] = (4, 16), gap_buckets: Sequence[float] = (60.0, 180.0)):
        if turn_buckets < 1:
            raise ValueError("turn_buckets must be >= 1")
        self.turn_buckets = turn_buckets
        self.growth_buckets = tuple(growth_buckets)
        self.gap_buckets = tuple(gap_buckets)
        nconv = turn_buckets * (len(self.growth_buckets) + 1) * (len(self.gap_buckets) + 1)
        self.num_conv = nconv
        self.TAIL = nconv
        self.SHARED = nconv + 1
        self.UNKNOWN = nconv + 2                  # pooled table, for keys the model never saw
        self.num_classes = nconv + 2
        self.horizon_s = float(horizon_s)
        self.prior_beta = prior_beta
        self.smoothing = smoothing
        self.refresh_every = refresh_every
        self.max_records = max_records
        self.max_keys = max_keys
        self.edges = [0.0] + list(np.geomspace(min_age_s, horizon_s, bins))
        self._edges_np = np.asarray(self.edges)
        self._widths = np.diff(self._edges_np)
        self._record_of: dict[bytes, Record] = {}
        self._records: OrderedDict[int, Record] = OrderedDict()
        self._samples: list[deque[list[float]]] = [deque(maxlen=window) for _ in range(self.num_classes)]
        self._next_rid = 1
        self._since_refresh = 0
        self._now = 0.0
        self.requests_seen = 0
        self.continuations = 0
        self._index = np.tile(self._prior_index(), (self.num_classes + 1, 1))
        self._dist = (1.0 / np.maximum(self._index, 1e-12)).tolist()

    # -------------------------------------------------------------- observation

    def record_of(self, key: bytes) -> Record | None:
        """The record ``key`` currently belongs to, or None when the model never saw it."""
        return self._record_of.get(key)

    def _new_record(self, cls: int, now: float, turn: int, keys: list[bytes]) -> Record:
        rec = Record(self._next_rid, cls, now, turn, keys, len(keys), [now, math.inf])
        self._next_rid += 1
        for k in keys:
            old = self._record_of.get(k)
            if old is not None:
                old.nkeys -= 1
            self._record_of[k] = rec
        self._records[rec.rid] = rec
        self._samples[cls].append(rec.sample)
        return rec

    def _reused(self, rec: Record, now: float) -> None:
        if rec.sample[1] == math.inf:
            rec.sample[1] = max(now - rec.t0, 0.0)

    def observe_request(self, keys: Sequence[bytes], now: float) -> None:
        """Learn from one request's prefix ``keys`` (in order) arriving at ``now`` (seconds).

        Call before the request's blocks are looked up, read or written, so the
        policies see the blocks in their new records. Cost: O(len(keys)).
        """
        n = len(keys)
        if n == 0:
            return
        self._now = now
        self.requests_seen += 1
        rec_map = self._record_of
        k = 0
        while k < n and keys[k] in rec_map:
            k += 1
        turn = 0
        gap = math.inf
        shared: list[bytes] = []
        conv: list[bytes] = []
        i = 0
        while i < k:
            rec = rec_map[keys[i]]
            j = i + 1
            while j < k and rec_map[keys[j]] is rec:
                j += 1
            run = keys[i:j]
            whole = (j - i) == rec.nkeys
            if rec.cls == self.SHARED:
                self._reused(rec, now)
                shared.extend(run)
            elif whole:           # a conversation (or its tail) continued
                self._reused(rec, now)
                turn = max(turn, rec.turn + 1)
                gap = min(gap, now - rec.t0)
                conv.extend(run)
            else:                 # diverged inside it: the common part is a shared prefix
                shared.extend(run)
            i = j
        if turn:
            self.continuations += 1
        if shared:
            self._new_record(self.SHARED, now, 0, shared)
        rest = list(keys[k:])
        if k < n:
            tail = [rest.pop()]
        else:
            tail = []
        body = conv + rest
        if body:
            self._new_record(self.conv_class(turn, n - k, gap), now, turn, body)
        if tail:
            self._new_record(self.TAIL, now, turn, tail)
        self._prune(now)
        self._since_refresh += 1
        if self._since_refresh >= self.refresh_every:
            self.refresh(now)

    def conv_class(self, turn: int, new_blocks: int, gap: float = math.inf) -> int:
        """Class of a conversation record: by turn, by how many blocks the request added
        and (continued records) by the gap since the turn before (seconds)."""
        g = bisect.bisect_right(self.growth_buckets, new_blocks)
        p = bisect.bisect_right(self.gap_buckets, gap) if turn and gap < math.inf else 0
        cls = min(turn, self.turn_buckets - 1) * (len(self.growth_buckets) + 1) + g
        return cls * (len(self.gap_buckets) + 1) + p

    def _prune(self, now: float) -> None:
        recs = self._records
        while recs:
            rid, rec = next(iter(recs.items()))
            if (len(recs) <= self.max_records and len(self._record_of) <= self.max_keys
                    and now - rec.t0 <= self.horizon_s):
                break
            del recs[rid]
            for k in rec.keys:
                if self._record_of.get(k) is rec:
                    del self._record_of[k]

    # -------------------------------------------------------------- estimation

    def _prior_hazard(self) -> np.ndarray:
        """Per-bin reuse probability of a decreasing-hazard prior, h(a) = 0.5 / (a + 10 s):
        before any data it makes younger blocks more valuable (LRU order)."""
        lo, hi = self._edges_np[:-1], self._edges_np[1:]
        return 1.0 - ((lo + 10.0) / (hi + 10.0)) ** self.prior_beta

    def _prior_index(self) -> np.ndarray:
        return self._index_from_hazard(self._prior_hazard())

    def _index_from_hazard(self, lam: np.ndarray) -> np.ndarray:
        return best_hit_density(lam, self._widths)

    def _hazard(self, samples: Sequence[list[float]], now: float) -> tuple[np.ndarray, np.ndarray]:
        """(events, at-risk) per age bin, Kaplan-Meier style, from ``[t0, gap]`` samples."""
        if not samples:
            return np.zeros(len(self._widths)), np.zeros(len(self._widths))
        arr = np.asarray(samples, dtype=float)
        return censored_counts(arr[:, 1], now - arr[:, 0], self.horizon_s, self._edges_np)

    def refresh(self, now: float | None = None) -> None:
        """Recompute the per-class tables from the learning windows (seconds: ``now``)."""
        now = self._now if now is None else now
        self._since_refresh = 0
        prior = self._prior_hazard()
        per_class = [self._hazard(s, now) for s in self._samples]
        convs = [per_class[c] for c in range(self.num_classes) if c != self.SHARED]
        ev_all = sum(e for e, _ in convs)
        risk_all = sum(r for _, r in convs)
        pooled = (ev_all + 2.0 * prior) / (risk_all + 2.0)
        index = np.empty((self.num_classes + 1, len(prior)))
        for c, (ev, risk) in enumerate(per_class):
            lam = np.clip((ev + self.smoothing * pooled) / (risk + self.smoothing), 0.0, 1.0)
            index[c] = self._index_from_hazard(lam)
        index[self.UNKNOWN] = self._index_from_hazard(pooled)
        self._index = index
        self._dist = (1.0 / np.maximum(index, 1e-12)).tolist()

    def age_bin(self, age: float) -> int:
        b = bisect.bisect_right(self.edges, age) - 1
        return min(max(b, 0), len(self.edges) - 2)

    def distance(self, cls: int, age: float) -> float:
        """Predicted seconds of residence per reuse for a block of class ``cls`` last used
        ``age`` seconds ago (the inverse hit density). Evict the largest first."""
        if age >= self.horizon_s:
            return math.inf
        return self._dist[cls][self.age_bin(age)]

    def hit_density(self, cls: int, age: float) -> float:
        """Expected reuses per second of residence (1 / :meth:`distance`)."""
        return 1.0 / self.distance(cls, age)

    def class_names(self) -> list[str]:
        edges = (0,) + self.growth_buckets
        gaps = ("",) + tuple(f">={g:g}s" for g in self.gap_buckets)
        names = []
        for t in range(self.turn_buckets):
            plus = "+" if t == self.turn_buckets - 1 else ""
            for g, lo in enumerate(edges):
                hi = f"-{edges[g + 1] - 1}" if g + 1 < len(edges) else "+"
                for gp in gaps:
                    names.append(f"turn{t}{plus}/new{lo}{hi}" + (f"/gap{gp}" if gp else ""))
        return names + ["tail", "shared", "unknown"]
