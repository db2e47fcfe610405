"""How much to believe a source of hints, learned from the returns the daemon observes.

A hint is advisory: one that turns out wrong may cost placement quality, but never
more than ignoring it would, so a source whose hints keep turning out wrong must end up
ignored. :class:`HintTrust` keeps two scores per source (an agent framework, a tenant,
a model of hints), both updated online from what the session table observes:

- **state trust**, the posterior mean of a Beta distribution over "the state was
  right": a *continues* hint is right when the session comes back before its check
  (``lapse_factor`` times the hinted gap, at least ``horizon_s``) and wrong when it
  does not; a *finished* or *abandoned* hint is wrong when the session comes back
  within ``horizon_s`` (a new hint or tool call for it) and right when it does not.
  Old outcomes fade (each new one multiplies the counts by ``1 - 1 / memory``), so a
  source that mends its ways is believed again. Below ``threshold`` the source's hints
  are ignored (recorded, to keep measuring them, but they move nothing).
- **time weight**, how far a continuing hint's ``expected_back_s`` moves the expected
  gap from the table's own guess (the median observed gap): the two are combined in
  log space with inverse-variance weights (the minimum-variance combination of two
  independent unbiased estimates), the variances being the mean squared log errors of
  each against the observed gaps of this source's returns. An exact source gets a
  weight near 1, one as noisy as the learned median 1/2, a random one near 0. The
  session table raises the per-session correction of the hint calibration to the same
  power (it was learned from the hinted times; where they count for little, so does it).

Both start from pseudo observations (``prior_right`` / ``prior_wrong``; ``prior_var``
for the hint and ``base_var`` for the median, each worth ``prior_weight``
observations), so an unknown source is believed at first: its states, and its times
as given (``prior_var`` 0), until its returns say otherwise.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

MIN_GAP_S = 0.1
"""Gaps are compared in log space from this many seconds up (a zero gap has no log)."""


@dataclass
class _Source:
    right: float
    wrong: float
    hint_sq: float          # sum of squared log errors of the hint (with the prior)
    base_sq: float          # ... of the learned median


class HintTrust:
    """State trust and time weight per hint source (see the module docstring).

    Args:
        prior_right, prior_wrong: pseudo outcomes of an unknown source's states.
        memory: outcomes after which an old one weighs 1/e.
        threshold: state trust below which a source's hints are ignored.
        horizon_s: how long a finished session is watched for a return (seconds).
        lapse_factor, lapse_min_s: a continuing session is judged not coming back after
            this many times its expected gap, and at least this many seconds.
        prior_var, base_var, prior_weight: the time weight's prior (squared natural-log
            errors of the hint and of the median; observations they are worth).
        max_sources: sources remembered (the least recently used are forgotten).
    """

    def __init__(self, prior_right: float = 4.0, prior_wrong: float = 1.0, memory: float = 200.0,
                 threshold: float = 0.5, horizon_s: float = 900.0, lapse_factor: float = 10.0,
                 lapse_min_s: float = 60.0,
                 prior_var: float = 0.0, base_var: float = 1.0, prior_weight: float = 4.0,
                 max_sources: int = 10_000):
        if not 0.0 <= threshold <= 1.0 or memory < 1.0 or prior_right <= 0 or prior_wrong < 0:
            raise ValueError("hint trust: threshold in [0, 1], memory >= 1, prior_right > 0, prior_wrong >= 0")
        self.prior = (prior_right, prior_wrong)
        self.fade = 1.0 - 1.0 / memory
        self.threshold = threshold
        self.horizon_s = horizon_s
        self.lapse_factor = lapse_factor
        self.lapse_min_s = lapse_min_s
        self.time_prior = (prior_var * prior_weight, base_var * prior_weight)
        self.max_sources = max_sources
        self._sources: OrderedDict[str, _Source] = OrderedDict()

    def _get(self, source: str) -> _Source:
        s = self._sources.get(source)
        if s is None:
            s = self._sources[source] = _Source(*self.prior, *self.time_prior)
            while len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        return s

    # ------------------------------------------------------------------ scores

    def state_trust(self, source: str) -> float:
        """Posterior mean probability that the source's states are right, in [0, 1]."""
        s = self._sources.get(source)
        right, wrong = (s.right, s.wrong) if s is not None else self.prior
        return right / (right + wrong)

    def believed(self, source: str) -> bool:
        """Whether the source's hints move placement (state trust >= threshold)."""
        return self.state_trust(source) >= self.threshold

    def time_weight(self, source: str) -> float:
        """Weight in [0, 1] of the source's hinted gaps against the learned median:
        ``E_median / (E_hint + E_median)`` (mean squared log errors)."""
        s = self._sources.get(source)
        hint_sq, base_sq = (s.hint_sq, s.base_sq) if s is not None else self.time_prior
        return base_sq / (hint_sq + base_sq) if hint_sq + base_sq > 0 else 0.5

    def expected_gap(self, source: str, hinted_s: float, median_s: float) -> float:
        """The gap to expect (seconds): the hinted and the median gap combined in log
        space by :meth:`time_weight`."""
        w = self.time_weight(source)
        if w >= 1.0:
            return hinted_s
        h, m = max(hinted_s, MIN_GAP_S), max(median_s, MIN_GAP_S)
        return math.exp(w * math.log(h) + (1.0 - w) * math.log(m))

    def end_checks(self) -> tuple[float, ...]:
        """Seconds after a finished or abandoned hint at which its session is looked at
        for a return (a return proves it wrong at once; the last check proves it right)."""
        return tuple(sorted({min(5.0, self.horizon_s), min(self.lapse_min_s, self.horizon_s), self.horizon_s}))

    def check_after(self, gap_s: float) -> float:
        """Seconds after a continuing hint at which its session is judged not coming back."""
        return max(self.lapse_factor * gap_s, self.lapse_min_s)

    # ------------------------------------------------------------------ outcomes

    def state_outcome(self, source: str, right: bool) -> None:
        """One hint's state turned out ``right`` (or not)."""
        s = self._get(source)
        s.right = s.right * self.fade + (1.0 if right else 0.0)
        s.wrong = s.wrong * self.fade + (0.0 if right else 1.0)

    def time_outcome(self, source: str, observed_s: float, hinted_s: float, median_s: float) -> None:
        """A continuing hint of ``hinted_s`` came back after ``observed_s``; the table's
        own guess was ``median_s`` (seconds)."""
        s = self._get(source)
        o = math.log(max(observed_s, MIN_GAP_S))
        s.hint_sq = s.hint_sq * self.fade + (o - math.log(max(hinted_s, MIN_GAP_S))) ** 2
        s.base_sq = s.base_sq * self.fade + (o - math.log(max(median_s, MIN_GAP_S))) ** 2

    def summary(self) -> dict[str, dict[str, float]]:
        """Per source: state trust and time weight."""
        return {name: {"state_trust": self.state_trust(name), "time_weight": self.time_weight(name)}
                for name in self._sources}
