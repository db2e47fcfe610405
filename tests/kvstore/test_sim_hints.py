"""Simulated session hints from a trace's future; the hint calibration they feed."""

from __future__ import annotations

import math

import pytest

from kvstore.tools import simulate
from kvstore.agent.hint_model import HintCalibration
from kvstore.agent.sessions import SessionState
from kvstore.tools.sim_hints import HintModel, NoisyHints, continuations, derive, parse_hints_spec
from kvstore.tools.trace import Request


def req(t: float, ids: list[int], tail: int = 100) -> Request:
    return Request(t * 1000.0, 512 * (len(ids) - 1) + tail, 1, ids)


# conversation A: [1,2,3] -> [1,2,3,4,5] -> [1,2,3,4,5,6,7] (ends); B: [8,9] alone; C: block 1 only
TRACE = [req(0, [0, 1, 2, 3]), req(5, [0, 8, 9]), req(30, [0, 1, 2, 3, 4, 5]), req(31, [0, 10]),
         req(90, [0, 1, 2, 3, 4, 5, 6, 7])]


def keys_of(ids):
    return [i.to_bytes(4, "little") * 8 for i in ids]


def test_continuations_and_conversations():
    nxt, conv = continuations(TRACE)
    assert nxt == [2, None, 4, 4, None]      # [0, 10]'s only full block, 0, is used again at 90 s
    assert conv[0] == conv[2] == conv[4] == 0 and conv[1] == 1 and conv[3] == 3


def test_exact_hints_say_when_each_request_continues():
    hints = derive(TRACE, [r.time_s for r in TRACE], NoisyHints(0.0, 1.0), keys_of)
    h0, h1, h2, h3, h4 = hints
    assert (h0.state, h0.expected_back_s, h0.session_id) == (SessionState.CONTINUES, 30.0, "conv-0")
    assert h0.keys == tuple(keys_of([0, 1, 2]))          # full blocks only
    assert h2.expected_back_s == 60.0 and h2.session_id == "conv-0"
    assert h1.state == h4.state == SessionState.FINISHED
    assert h4.keys == tuple(keys_of([0, 1, 2, 3, 4, 5, 6, 7]))   # with the partial block


def test_errors_flip_at_rate_p_and_scale_gaps_within_f_per_conversation():
    reqs = []
    for c in range(400):          # 400 two-turn conversations
        base = 10 * c
        reqs += [req(base, [0, 1000 + c, 2000 + c]), req(base + 7, [0, 1000 + c, 2000 + c, 3000 + c])]
    reqs.sort(key=lambda r: r.timestamp_ms)
    times = [r.time_s for r in reqs]
    exact = derive(reqs, times, NoisyHints(0.0, 1.0), keys_of)
    noisy = derive(reqs, times, NoisyHints(0.1, math.e, seed=3), keys_of)
    flips = sum(a.state != b.state for a, b in zip(exact, noisy))
    assert flips / len(reqs) == pytest.approx(0.1, abs=0.03)
    for a, b in zip(exact, noisy):
        if a.state == b.state == SessionState.CONTINUES:
            assert 1 / math.e - 1e-9 <= b.expected_back_s / a.expected_back_s <= math.e + 1e-9
    assert derive(reqs, times, NoisyHints(0.1, math.e, seed=3), keys_of) == noisy     # seeded


@pytest.mark.parametrize("text, p, f", [("noisy:0.05,e", 0.05, math.e), ("noisy:0,e^2", 0.0, math.e ** 2),
                                        ("noisy:0.1,1", 0.1, 1.0)])
def test_spec_parsing(text, p, f):
    s = parse_hints_spec(text)
    assert (s.misjudge, s.factor) == (p, pytest.approx(f))


@pytest.mark.parametrize("text, model", [
    ("realistic", HintModel("realistic", 0.0, 1.5)),
    ("realistic:sigma=0.5,wrong=0.1,source=fw", HintModel("realistic", 0.1, 0.5, source="fw")),
    ("realistic:notime", HintModel("realistic", times=False)),
    ("finish-only", HintModel("finish-only", continues=False)),
    ("finish-only:wrong=0.2", HintModel("finish-only", 0.2, continues=False)),
    ("continue-only:sigma=e", HintModel("continue-only", sigma=math.e, finished=False)),
])
def test_realistic_model_parsing(text, model):
    assert parse_hints_spec(text) == model


@pytest.mark.parametrize("bad", ["noisy:0.05", "hints:0,1", "noisy:2,e", "noisy:0.1,0.5", "realistic:sigma=-1",
                                 "realistic:wrong=2", "finish-only:colour=red", "realistic:sigma"])
def test_bad_specs_are_value_errors(bad):
    with pytest.raises(ValueError):
        parse_hints_spec(bad)


def two_turns(n: int = 2000) -> list[Request]:
    reqs = []
    for c in range(n):            # two-turn conversations, back after 7 s
        reqs += [req(10 * c, [0, 10_000 + c, 20_000 + c]), req(10 * c + 7, [0, 10_000 + c, 20_000 + c, 30_000 + c])]
    reqs.sort(key=lambda r: r.timestamp_ms)
    return reqs


def test_the_realistic_model_errs_per_request_with_the_given_sigma():
    reqs = two_turns()
    times = [r.time_s for r in reqs]
    hints = derive(reqs, times, parse_hints_spec("realistic:sigma=1.5,source=fw", seed=2), keys_of)
    cont = [h for h in hints if h.state == SessionState.CONTINUES]
    assert len(cont) == 2000 and all(h.source == "fw" for h in hints)          # the state is known
    logs = [math.log(h.expected_back_s / 7.0) for h in cont]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert abs(mean) < 0.1 and sd == pytest.approx(1.5, abs=0.08)
    assert sum(h.state == SessionState.FINISHED for h in hints) == 2000
    exact = derive(reqs, times, parse_hints_spec("realistic:sigma=0"), keys_of)
    assert all(h.expected_back_s == pytest.approx(7.0) for h in exact if h.state == SessionState.CONTINUES)


def test_finish_only_continue_only_and_no_time_models_send_part_of_the_hints():
    reqs = two_turns(200)
    times = [r.time_s for r in reqs]
    fin = derive(reqs, times, parse_hints_spec("finish-only"), keys_of)
    assert [h is None for h in fin] == [i % 2 == 0 for i in range(400)]          # first turns: nothing
    assert all(h.state == SessionState.FINISHED for h in fin if h is not None)
    cont = derive(reqs, times, parse_hints_spec("continue-only:notime"), keys_of)
    assert all((h is None) == (i % 2 == 1) for i, h in enumerate(cont))
    assert all(h.expected_back_s is None for h in cont if h is not None)
    wrong = derive(reqs, times, parse_hints_spec("finish-only:wrong=1"), keys_of)
    assert all((h is None) == (i % 2 == 1) for i, h in enumerate(wrong))       # every call said finished


def test_exact_hints_beat_no_hints_on_a_small_cache():
    reqs = []
    for c in range(300):          # conversations that come back after long or short gaps
        base = 20 * c
        ids = [0] + list(range(10 * c + 1, 10 * c + 4))
        reqs.append(req(base, ids))
        reqs.append(req(base + (3 if c % 2 else 200), ids + [10 * c + 5]))
    reqs.sort(key=lambda r: r.timestamp_ms)
    tiers = [simulate.TierSpec("host", 24 * 1024, "next_use")]
    plain = simulate.run(reqs, tiers, block_bytes=1024)
    hints = derive(reqs, simulate.virtual_times(reqs), NoisyHints(0.0, 1.0), simulate.TraceKeys())
    hinted = simulate.run(reqs, tiers, block_bytes=1024, session_hints=hints)
    opt = simulate.opt_hit_rate(reqs, 24 * 1024, block_bytes=1024).hit_rate
    assert plain.hit_rate < hinted.hit_rate <= opt + 1e-12
    assert hinted.sessions["finished"] > 0 and hinted.sessions["returns"] > 0


def test_calibration_of_exact_hints_and_of_hints_that_never_return():
    cal = HintCalibration(min_samples=10, refresh_every=10)
    for i in range(200):                      # every hint exact: back after 10 s
        rec = cal.hinted(20.0 * i, 10.0)
        cal.returned(rec, f"s{i}", 20.0 * i + 10.0, 10.0)
    assert cal.ready
    assert cal.distance(10.0, 0.0) == pytest.approx(10.0, rel=0.25)      # ~ the time to go
    assert cal.distance(10.0, 5.0) < cal.distance(10.0, 0.0)
    liar = HintCalibration(min_samples=10, refresh_every=10)
    for i in range(200):                      # half come back on time, half never
        rec = liar.hinted(20.0 * i, 10.0)
        if i % 2:
            liar.returned(rec, f"s{i}", 20.0 * i + 10.0, 10.0)
    liar.refresh(4000.0)
    assert liar.distance(10.0, 0.0) > 1.5 * cal.distance(10.0, 0.0)      # discounted
    assert liar.distance(10.0, 100.0) == math.inf or liar.distance(10.0, 100.0) > 100.0


def test_a_session_that_is_always_late_is_corrected():
    cal = HintCalibration(prior_weight=1.0)
    for i in range(3):
        rec = cal.hinted(100.0 * i, 10.0)
        cal.returned(rec, "slow", 100.0 * i + 20.0, 10.0)                 # twice the hint
    assert cal.correction("slow") == pytest.approx(2.0 ** (3 / 4))        # one pseudo observation
    assert cal.correction("unknown") == 1.0
