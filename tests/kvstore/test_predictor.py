"""Tool-duration estimators and the resume predictor."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from kvstore.common.errors import ConfigError
from kvstore.agent.tool_durations import LogNormalFit, ToolPredictor, WindowQuantile


def test_window_quantile_is_the_type7_sample_quantile_of_the_last_window():
    est = WindowQuantile(window=5)
    for d in [100.0, 1, 2, 3, 4, 5]:          # 100 falls out of the window
        est.observe(d)
    assert est.quantile(0.5) == 3.0
    assert est.quantile(0.25) == 2.0
    assert est.quantile(0.1) == pytest.approx(1.4)   # 1 + 0.4 * (2 - 1)
    assert est.count == 6


def test_window_conditional_quantile_uses_the_tail():
    est = WindowQuantile(window=10)
    for d in range(1, 11):
        est.observe(float(d))
    assert est.conditional_quantile(0.5, 6.5) == 8.5        # median of 7, 8, 9, 10
    assert est.conditional_quantile(0.5, 50.0) == 75.0      # beyond everything: 1.5x elapsed


def test_lognormal_recovers_median_and_sigma():
    est = LogNormalFit(window=10_000)
    nd = statistics.NormalDist(math.log(4.0), 0.5)
    for i in range(1, 2000):
        est.observe(math.exp(nd.inv_cdf(i / 2000)))
    assert est.quantile(0.5) == pytest.approx(4.0, rel=0.01)
    assert est.sigma == pytest.approx(0.5, rel=0.02)
    assert est.quantile(0.1) == pytest.approx(4.0 * math.exp(-1.2816 * 0.5), rel=0.02)
    assert est.conditional_quantile(0.5, 4.0) > 4.0


def test_lognormal_forgets_with_its_window():
    est = LogNormalFit(window=20)
    for _ in range(200):
        est.observe(1.0)
    for _ in range(200):
        est.observe(10.0)
    assert est.quantile(0.5) == pytest.approx(10.0, rel=0.01)


@pytest.mark.parametrize("kind", ["quantile", "lognormal"])
def test_tool_predictor_learns_each_tool_and_pools_for_new_ones(kind):
    p = ToolPredictor(kind, window=32, default_s=7.0, min_samples=3)
    assert p.predict("search") == 7.0                          # nothing seen yet
    for _ in range(10):
        p.observe("search", 1.0)
        p.observe("tests", 20.0)
    assert p.predict("search") == pytest.approx(1.0, rel=0.05)
    assert p.predict("tests") == pytest.approx(20.0, rel=0.05)
    p.observe("browse", 100.0)                                     # one sample: pooled estimate
    pooled = p.predict("browse")
    assert 1.0 <= pooled <= 21.0
    assert p.predict_remaining("tests", 5.0) == pytest.approx(15.0, rel=0.1)
    assert p.tools() == {"search": 10, "tests": 10, "browse": 1}


def test_unknown_predictor_is_a_config_error():
    with pytest.raises(ConfigError, match="prefetch.predictor"):
        ToolPredictor("neural")


def test_predictions_track_a_shift():
    p = ToolPredictor("quantile", window=8)
    rng = np.random.default_rng(0)
    for d in rng.lognormal(math.log(2.0), 0.3, 50):
        p.observe("python", float(d))
    for d in rng.lognormal(math.log(8.0), 0.3, 8):
        p.observe("python", float(d))
    assert p.predict("python") == pytest.approx(8.0, rel=0.3)
