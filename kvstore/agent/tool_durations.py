"""How long a wait lasts: every prediction of a tool call's duration (and of a hinted session gap).

- :class:`ToolPredictor` keeps per-tool duration estimators (:class:`WindowQuantile`,
  :class:`LogNormalFit`) learned online from observed durations (``ToolCallStart`` ->
  ``Resume``).
- :class:`WaitDurations` is what the prefetch scheduler asks: the quantiles of a waiting
  trajectory's remaining wait given the time it already waited, and the probability that
  it resumes within a horizon, for a tool call (from its tool's estimator) or a session
  hint (the hinted gap scaled by the learned ratio of observed to hinted gaps); it learns
  from every resume.

Everything is driven with explicit times (seconds), so the daemon and ``kvstore simulate``
share it.
"""

from __future__ import annotations

import abc
import math
import statistics
from collections import OrderedDict, deque
from typing import ClassVar, Sequence

import numpy as np

from kvstore.common.errors import ConfigError


def check_sample(seconds: float) -> float:
    """An observed duration as a float; raises ValueError unless it is finite and >= 0
    (a NaN or an infinity would poison every later prediction of the tool)."""
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a tool-call duration must be a finite number of seconds >= 0, got {seconds!r}")
    return seconds


class DurationEstimator(abc.ABC):
    """One tool's duration distribution, learned online from observed durations (seconds)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def observe(self, seconds: float) -> None:
        """Add one observed duration (seconds, > 0)."""

    @abc.abstractmethod
    def quantile(self, q: float) -> float:
        """The ``q``-quantile of the duration (seconds). Needs at least one observation."""

    @abc.abstractmethod
    def conditional_quantile(self, q: float, elapsed: float) -> float:
        """The ``q``-quantile of the duration given that it exceeds ``elapsed`` seconds."""

    @abc.abstractmethod
    def prob_within(self, elapsed: float, horizon: float) -> float:
        """A conservative estimate of P(duration <= elapsed + horizon | duration > elapsed):
        shrunk towards 0 when few observations lie beyond ``elapsed``."""

    @property
    @abc.abstractmethod
    def count(self) -> int:
        """Observations seen so far."""


class WindowQuantile(DurationEstimator):
    """Empirical quantiles over a sliding window of the last ``window`` durations.

    Quantiles interpolate linearly between order statistics (Hyndman & Fan 1996,
    "Sample quantiles in statistical packages", definition 7: numpy's default).
    Non-parametric and robust to outliers; adapts within ``window`` calls when a
    tool's latency shifts.
    """

    name = "quantile"

    def __init__(self, window: int = 64):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window: deque[float] = deque(maxlen=window)
        self._n = 0

    def observe(self, seconds: float) -> None:
        self._window.append(check_sample(seconds))
        self._n += 1

    @staticmethod
    def _q(values: Sequence[float], q: float) -> float:
        return float(np.quantile(np.asarray(values, dtype=float), q))

    def quantile(self, q: float) -> float:
        if not self._window:
            raise ValueError("no observations yet")
        return self._q(self._window, q)

    def conditional_quantile(self, q: float, elapsed: float) -> float:
        tail = [d for d in self._window if d > elapsed]
        if not tail:  # beyond everything seen: assume it ends about now (plus a 50% margin)
            return elapsed * 1.5
        return self._q(tail, q)

    def prob_within(self, elapsed: float, horizon: float) -> float:
        tail = [d for d in self._window if d > elapsed]
        hits = sum(1 for d in tail if d <= elapsed + horizon)
        return hits / (len(tail) + 2.0)      # two pseudo-observations of "later"

    @property
    def count(self) -> int:
        return self._n


class LogNormalFit(DurationEstimator):
    """A log-normal fitted online: exponentially weighted mean/variance of ``ln(duration)``.

    Tool and human think times are commonly modelled as log-normal (Limpert, Stahel &
    Abbt 2001, "Log-normal distributions across the sciences", BioScience 51(5)).
    The weights forget with an effective memory of ``window`` observations
    (West 1979, "Updating mean and variance estimates", CACM 22(9), weighted form).
    """

    name = "lognormal"

    def __init__(self, window: int = 64):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._alpha = 1.0 / window
        self._mu = 0.0
        self._var = 0.0
        self._n = 0

    def observe(self, seconds: float) -> None:
        x = math.log(max(check_sample(seconds), 1e-6))
        self._n += 1
        if self._n == 1:
            self._mu, self._var = x, 0.0
            return
        a = max(self._alpha, 1.0 / self._n)  # plain average until the window is full
        d = x - self._mu
        self._mu += a * d
        self._var = (1 - a) * (self._var + a * d * d)

    @property
    def sigma(self) -> float:
        """Standard deviation of ``ln(duration)``."""
        return math.sqrt(max(self._var, 1e-12))

    def quantile(self, q: float) -> float:
        if not self._n:
            raise ValueError("no observations yet")
        return math.exp(self._mu + self.sigma * statistics.NormalDist().inv_cdf(q))

    def prob_within(self, elapsed: float, horizon: float) -> float:
        nd = statistics.NormalDist(self._mu, self.sigma)
        lo = nd.cdf(math.log(max(elapsed, 1e-9)))
        hi = nd.cdf(math.log(max(elapsed + horizon, 1e-9)))
        p = (hi - lo) / (1.0 - lo) if lo < 1.0 - 1e-12 else 0.0
        return p * self._n / (self._n + 2.0)

    def conditional_quantile(self, q: float, elapsed: float) -> float:
        nd = statistics.NormalDist(self._mu, self.sigma)
        f = nd.cdf(math.log(max(elapsed, 1e-9)))
        target = f + q * (1.0 - f)
        if target >= 1.0 - 1e-12:
            return elapsed * 1.5
        return max(elapsed, math.exp(nd.inv_cdf(target)))

    @property
    def count(self) -> int:
        return self._n


ESTIMATORS: dict[str, type[DurationEstimator]] = {
    WindowQuantile.name: WindowQuantile,
    LogNormalFit.name: LogNormalFit,
}


class ToolPredictor:
    """Per-tool duration estimators and the resume-time predictions made from them.

    A tool with fewer than ``min_samples`` observations borrows the estimator pooled
    over all tools; before any observation ``default_s`` is used.

    Args:
        kind: estimator name (``"quantile"`` or ``"lognormal"``; config ``prefetch.predictor``).
        window: observations remembered per tool (``prefetch.window``).
        default_s: prediction (seconds) before anything was observed.
        min_samples: observations a tool needs before its own estimate is used.
        max_tools: tools with their own estimator (names come from clients); past it the
            least recently observed tool's estimator is dropped (it falls back to the pool).
    Raises:
        ConfigError: unknown ``kind``.
    """

    def __init__(self, kind: str = "quantile", window: int = 64, default_s: float = 1.0,
                 min_samples: int = 3, max_tools: int = 1024):
        if kind not in ESTIMATORS:
            raise ConfigError(f"prefetch.predictor: unknown predictor {kind!r} "
                              f"(known: {', '.join(sorted(ESTIMATORS))})")
        self.kind = kind
        self.window = window
        self.default_s = default_s
        self.min_samples = min_samples
        self.max_tools = max_tools
        self._tools: OrderedDict[str, DurationEstimator] = OrderedDict()   # least recently observed first
        self._pooled = ESTIMATORS[kind](window * 4)

    def _estimator(self, tool: str) -> DurationEstimator | None:
        est = self._tools.get(tool)
        if est is not None and est.count >= self.min_samples:
            return est
        return self._pooled if self._pooled.count else None

    def observe(self, tool: str, seconds: float) -> None:
        """Record that a call of ``tool`` took ``seconds`` (0 carries no information and is
        skipped). Raises ValueError for a duration that is not finite or is negative."""
        if check_sample(seconds) == 0:
            return
        est = self._tools.get(tool)
        if est is None:
            est = self._tools[tool] = ESTIMATORS[self.kind](self.window)
            while len(self._tools) > self.max_tools:
                self._tools.popitem(last=False)
        else:
            self._tools.move_to_end(tool)
        est.observe(seconds)
        self._pooled.observe(seconds)

    def predict(self, tool: str, q: float = 0.5) -> float:
        """The ``q``-quantile of ``tool``'s duration (seconds)."""
        est = self._estimator(tool)
        return self.default_s if est is None else est.quantile(q)

    def predict_remaining(self, tool: str, elapsed: float, q: float = 0.5) -> float:
        """Seconds still to wait for a call of ``tool`` already running ``elapsed`` seconds."""
        est = self._estimator(tool)
        if est is None:
            return max(self.default_s - elapsed, self.default_s * 0.5)
        return max(est.conditional_quantile(q, elapsed) - elapsed, 0.0)

    def prob_within(self, tool: str, elapsed: float, horizon: float) -> float:
        """Conservative P(a call of ``tool`` running ``elapsed`` seconds ends within
        ``horizon`` more seconds). Before any observation of any tool the configured
        ``default_s`` is taken as the duration (as :meth:`predict` does): 1.0 when the
        call would end within the horizon, else 0."""
        est = self._estimator(tool)
        if est is None:
            return 1.0 if self.predict_remaining(tool, elapsed) <= horizon else 0.0
        return est.prob_within(elapsed, horizon)

    def tools(self) -> dict[str, int]:
        """Observation count per tool."""
        return {t: e.count for t, e in self._tools.items()}


SESSION_TOOL = "(session hint)"
"""The ``tool`` of a wait that a session hint started; its duration is learned as the ratio
observed gap / hinted gap, in a predictor of its own (:attr:`WaitDurations.session_ratios`)."""


class WaitDurations:
    """The duration of a wait: a tool call (by tool) or a session's gap (by hinted gap).

    A tool call's wait is predicted by :attr:`tools`. A session hint's wait is the hinted
    gap (seconds) times the learned ratio observed / hinted gap (:attr:`session_ratios`,
    one estimator under :data:`SESSION_TOOL`); before ``min_samples`` ratios were observed
    the hinted gap is taken as given.

    Args:
        kind: estimator name (``"quantile"`` or ``"lognormal"``; ``prefetch.predictor``).
        window: observations remembered per tool (``prefetch.window``).
        floor_s: before any ratio is learned, a session that is late is expected to wait
            at least this many seconds more (the scheduler's ``refresh_s``).
    Raises:
        ConfigError: unknown ``kind``.
    """

    def __init__(self, kind: str = "quantile", window: int = 64, *, floor_s: float = 2.0):
        self.tools = ToolPredictor(kind, window)
        self.session_ratios = ToolPredictor(kind, window, default_s=1.0)
        self.floor_s = floor_s

    def learn(self, tool: str, start: float, predicted_resume: float, observed: float) -> None:
        """One wait that started at ``start`` and was predicted to end at
        ``predicted_resume`` (seconds) ended after ``observed`` seconds."""
        if tool == SESSION_TOOL:
            hinted = predicted_resume - start
            if hinted > 0 and observed > 0:
                self.session_ratios.observe(SESSION_TOOL, observed / hinted)
        else:
            self.tools.observe(tool, observed)

    def tool_quantile(self, tool: str, q: float) -> float:
        """The ``q``-quantile of a call of ``tool`` (seconds)."""
        return self.tools.predict(tool, q)

    def ratios_learned(self) -> bool:
        """Whether enough session gaps were observed to scale hinted gaps by their ratio."""
        return self.session_ratios.tools().get(SESSION_TOOL, 0) >= self.session_ratios.min_samples

    def gap_scale(self, q: float) -> float:
        """The ``q``-quantile of observed / hinted gap (1.0 until :meth:`ratios_learned`)."""
        return self.session_ratios.predict(SESSION_TOOL, q) if self.ratios_learned() else 1.0

    def remaining(self, tool: str, elapsed: float, hinted_gap: float, q: float) -> float:
        """The ``q``-quantile of the seconds a wait still lasts after ``elapsed`` seconds;
        ``hinted_gap`` (seconds) is a session hint's predicted gap (unused for a tool)."""
        if tool == SESSION_TOOL:   # in units of the hinted gap, from the learned ratios
            gap = max(hinted_gap, 1e-3)
            if self.ratios_learned():
                return gap * self.session_ratios.predict_remaining(SESSION_TOOL, elapsed / gap, q)
            return max(gap - elapsed, min(elapsed * 0.5, 600.0), self.floor_s)
        return self.tools.predict_remaining(tool, elapsed, q)

    def prob_within(self, tool: str, elapsed: float, hinted_gap: float, horizon: float) -> float:
        """Conservative P(a wait that lasted ``elapsed`` seconds ends within ``horizon``
        more seconds); ``hinted_gap`` as in :meth:`remaining`."""
        if tool == SESSION_TOOL:   # in units of the hinted gap
            gap = max(hinted_gap, 1e-3)
            return self.session_ratios.prob_within(SESSION_TOOL, elapsed / gap, horizon / gap)
        return self.tools.prob_within(tool, elapsed, horizon)
