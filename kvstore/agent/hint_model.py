"""How good the hints are: calibrating hinted next-use times against what happened.

A hint says "this session is back at ``t``" when it is given at ``t_set``; the hinted
gap is ``g = t - t_set``. Hints err: late, early, and sometimes the session never comes
back. :class:`HintCalibration` learns, online, the distribution of the *ratio*
``observed gap / hinted gap`` over all hints (Kaplan-Meier over log-spaced ratio bins;
a hint not followed by a return yet is censored at its current ratio; one never
followed by a return keeps the survival curve above zero), and from it, as
:class:`kvstore.policy.reuse_model.ReuseModel` does for ages, the best hit density from each
elapsed ratio on (Beckmann et al., LHD, NSDI'18). :meth:`HintCalibration.distance`
turns it into seconds: ``g / density(elapsed / g)``. For exact hints this is ``t - now``
before ``t``; for late or missing returns the distance grows after ``t`` as the data
says it should.

Errors are often systematic per session (one user types slowly, one tool is always
slower than the framework assumes), so it also keeps, per session, the mean log ratio
of its past returns; :meth:`correction` is that ratio shrunk towards 1 (one pseudo
observation), by which the session table scales the session's next hinted gap.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque

import numpy as np

from kvstore.policy.reuse_model import best_hit_density, censored_counts


class HintCalibration:
    """Learned distribution of observed / hinted gaps, and per-session corrections.

    Args:
        window: hint outcomes kept (recent ones).
        min_samples: returns needed before :attr:`ready` (before: the caller's fixed rule).
        refresh_every: outcomes between recomputations of the table.
        max_ratio: largest ratio reasoned about; beyond it a hint is worthless.
        bins: log-spaced ratio bins between ``1 / max_ratio`` and ``max_ratio``.
        max_sessions: sessions whose correction is remembered.
        prior_weight: pseudo observations of ratio 1 in a session's correction (more:
            trust a session's own history less). The default, 0.25, was chosen on the
            first half of the Mooncake conversation trace (``bench/placement_trace.py``).
    """

    def __init__(self, window: int = 4096, min_samples: int = 32, refresh_every: int = 64,
                 max_ratio: float = 50.0, bins: int = 48, max_sessions: int = 200_000,
                 prior_weight: float = 0.25):
        self.min_samples = min_samples
        self.refresh_every = refresh_every
        self.max_ratio = max_ratio
        self.edges = [0.0] + list(np.geomspace(1.0 / max_ratio, max_ratio, bins))
        self._edges_np = np.asarray(self.edges)
        self._widths = np.diff(self._edges_np)
        self._samples: deque[list[float]] = deque(maxlen=window)    # [t_set, g, ratio or inf]
        self._returns = 0
        self._since = 0
        self._now = 0.0
        self._dist: list[float] | None = None
        self._log_ratio: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.max_sessions = max_sessions
        self.prior_weight = prior_weight

    @property
    def ready(self) -> bool:
        return self._dist is not None

    def hinted(self, t_set: float, gap: float) -> list[float]:
        """A hint of gap ``gap`` seconds given at ``t_set``; returns its outcome record."""
        rec = [t_set, max(gap, 1e-3), math.inf]
        self._samples.append(rec)
        return rec

    def returned(self, rec: list[float], session_id: str, t: float, raw_gap: float | None = None) -> None:
        """The hinted session came back at ``t`` (seconds). ``raw_gap``: the gap the
        hint gave before :meth:`correction`, for the session's own log ratio."""
        if rec[2] != math.inf:
            return
        observed = max(t - rec[0], 1e-3)
        rec[2] = observed / rec[1]
        self._returns += 1
        if raw_gap is not None and raw_gap > 0:
            s, n = self._log_ratio.pop(session_id, (0.0, 0))
            self._log_ratio[session_id] = (s + math.log(observed / raw_gap), n + 1)
            while len(self._log_ratio) > self.max_sessions:
                self._log_ratio.popitem(last=False)
        self._now = max(self._now, t)
        self._since += 1
        if self._since >= self.refresh_every and self._returns >= self.min_samples:
            self.refresh(t)

    def correction(self, session_id: str) -> float:
        """Factor for the session's next hinted gap: its past observed / hinted ratio
        (geometric mean), shrunk towards 1 by ``prior_weight`` pseudo observations."""
        s, n = self._log_ratio.get(session_id, (0.0, 0))
        return math.exp(s / (n + self.prior_weight)) if n else 1.0

    def forget(self, session_id: str) -> None:
        self._log_ratio.pop(session_id, None)

    def refresh(self, now: float) -> None:
        """Recompute the distance table from the outcomes (Kaplan-Meier, censored)."""
        self._since = 0
        arr = np.asarray(self._samples, dtype=float)
        elapsed = np.maximum(now - arr[:, 0], 0.0) / arr[:, 1]
        events, at_risk = censored_counts(arr[:, 2], elapsed, self.max_ratio, self._edges_np)
        lam = np.clip((events + 0.05) / (at_risk + 1.0), 0.0, 1.0)
        density = best_hit_density(lam, self._widths)
        self._dist = (1.0 / np.maximum(density, 1e-12)).tolist()

    def distance(self, gap: float, elapsed: float) -> float:
        """Expected seconds of residence per use for a hint of ``gap`` seconds given
        ``elapsed`` seconds ago (the policy's distance). Needs :attr:`ready`."""
        x = elapsed / max(gap, 1e-3)
        if x >= self.max_ratio or self._dist is None:
            return math.inf
        b = min(max(bisect.bisect_right(self.edges, x) - 1, 0), len(self._dist) - 1)
        return gap * self._dist[b]
