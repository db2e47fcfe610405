"""Trust per hint source: wrong sources end up ignored, honest ones keep their gain."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from kvstore.agent.hint_trust import HintTrust
from kvstore.agent.sessions import SessionHint, SessionTable
from kvstore.policy import make_policy
from kvstore.tools import sim_hints, simulate
from kvstore.tools.trace import Request


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def test_a_source_that_is_always_wrong_falls_below_the_threshold_and_recovers():
    trust = HintTrust()
    assert trust.state_trust("new") == pytest.approx(0.8) and trust.believed("new")
    for _ in range(4):
        trust.state_outcome("liar", False)
    f = trust.fade                                         # old outcomes fade: 1 - 1/200 per new one
    assert trust.state_trust("liar") == pytest.approx(4 * f ** 4 / (5 * f ** 4 + f ** 3 + f ** 2 + f + 1))
    assert not trust.believed("liar")
    for _ in range(50):
        trust.state_outcome("honest", True)
    trust.state_outcome("honest", False)
    assert trust.state_trust("honest") > 0.95
    for _ in range(10):                                   # the liar mends its ways
        trust.state_outcome("liar", True)
    assert trust.believed("liar")


def test_the_time_weight_is_the_inverse_variance_weight_of_hint_and_median():
    trust = HintTrust(prior_weight=1e-9, memory=1e9)      # (almost) no prior and no fading: the data alone
    rng = random.Random(1)
    for _ in range(3000):          # hints off by exp(N(0, 0.5)) or exp(N(0, 1.5)), the median by exp(N(0, 1))
        gap = 60.0
        median = gap * math.exp(rng.gauss(0, 1.0))
        trust.time_outcome("good", gap, gap * math.exp(rng.gauss(0, 0.5)), median)
        trust.time_outcome("poor", gap, gap * math.exp(rng.gauss(0, 1.5)), median)
    assert trust.time_weight("good") == pytest.approx(1.0 / (1.0 + 0.25), abs=0.03)
    assert trust.time_weight("poor") == pytest.approx(1.0 / (1.0 + 2.25), abs=0.03)
    for _ in range(100):
        trust.time_outcome("exact", 30.0, 30.0, 300.0)
    assert trust.time_weight("exact") == pytest.approx(1.0)
    assert trust.expected_gap("exact", 30.0, 300.0) == pytest.approx(30.0)
    w = trust.time_weight("poor")
    assert trust.expected_gap("poor", 10.0, 1000.0) == pytest.approx(10.0 ** w * 1000.0 ** (1 - w))
    assert HintTrust().expected_gap("unknown", 10.0, 1000.0) == 10.0     # believed as given at first


def table(capacity: int = 100):
    p = make_policy("lru", capacity, tier_name="host")
    return SessionTable([p]), p


def test_finished_sessions_that_come_back_make_their_source_ignored_and_only_it():
    st, p = table()
    for i in range(6):                                    # "finished", then back 10 s later
        ks = (key(f"w{i}"),)
        p.insert(ks[0], 1, 0.0)
        st.apply(SessionHint(f"s{i}", "finished", ks, source="liar"), 100.0 * i)
        st.apply(SessionHint(f"s{i}", "continues", ks, expected_back_s=5.0, source="liar"), 100.0 * i + 10.0)
    assert not st.trust.believed("liar")
    ks = (key("last"), key("honest"))
    for k in ks:
        p.insert(k, 1, 0.0)
    st.apply(SessionHint("x", "finished", ks[:1], source="liar"), 1000.0)
    st.apply(SessionHint("y", "finished", ks[1:], source="good"), 1000.0)
    assert not p.is_let_go(ks[0]) and p.is_let_go(ks[1])
    assert st.stats.ignored >= 1


def test_when_a_source_loses_trust_what_its_recent_hints_did_is_undone():
    p = make_policy("lru", 100, tier_name="host")
    nu = make_policy("next_use", 100, tier_name="hbm")
    st = SessionTable([p, nu])
    done = [key(f"v{i}") for i in range(3)]
    for k in done + [key("c")]:
        p.insert(k, 1, 0.0)
        nu.insert(k, 1, 0.0)
    st.apply(SessionHint("victim", "finished", tuple(done), source="liar"), 0.0)
    st.apply(SessionHint("cont", "continues", (key("c"),), expected_back_s=1e4, source="liar"), 0.0)
    assert all(p.is_let_go(k) for k in done) and nu.distance(key("c"), 0.0) == pytest.approx(1e4)
    for i in range(6):                                    # its other finished sessions come back
        st.apply(SessionHint(f"s{i}", "finished", (key(f"w{i}"),), source="liar"), 1.0 + i)
        st.apply(SessionHint(f"s{i}", "continues", (key(f"w{i}"),), source="liar"), 2.0 + i)
    assert not st.trust.believed("liar")
    assert not any(p.is_let_go(k) or nu.is_let_go(k) for k in done)
    assert nu.distance(key("c"), 10.0) != pytest.approx(1e4 - 10.0)      # back to the learned order


def test_an_ignored_hint_stays_ignored_when_the_prefetch_scheduler_renews_it():
    nu = make_policy("next_use", 100, tier_name="hbm")
    st = SessionTable([nu])
    for _ in range(6):
        st.trust.state_outcome("liar", False)
    nu.insert(key("k"), 1, 0.0)
    st.apply(SessionHint("s", "continues", (key("k"),), expected_back_s=500.0, source="liar"), 0.0)
    st.expect("s", [], 300.0, now=1.0, hinted_at=1.0)                 # a renewal (not a tool call)
    assert key("k") not in nu.hint_groups
    st.expect("s", [], 20.0, now=2.0, hinted_at=2.0, calibrate=True)  # a tool call: the daemon's own guess
    assert key("k") in nu.hint_groups


def test_a_continuing_session_that_never_returns_is_a_wrong_hint():
    st, p = table()
    for i in range(6):
        st.apply(SessionHint(f"c{i}", "continues", (key(f"c{i}"),), expected_back_s=2.0, source="ghost"), 10.0 * i)
    st.tick(1000.0)                                       # 10 x 2 s, at least 60 s: judged
    assert not st.trust.believed("ghost")


def test_a_continuing_session_that_returns_without_a_hint_proves_its_hint_right():
    st, p = table()
    for i in range(8):
        k, t = key(f"q{i}"), 100.0 * i
        p.admit(k, 1, t)
        p.insert(k, 1, t)
        st.apply(SessionHint(f"q{i}", "continues", (k,), expected_back_s=2.0, source="terse"), t)
        p.access(k, t + 20.0)                             # back, reading its prefix, and no hint
        st.tick(t + 99.0)
    assert st.trust.state_trust("terse") > 0.9


def test_a_finished_session_whose_blocks_are_read_again_without_a_hint_is_a_wrong_hint():
    """The return shows in the uses of its blocks even when the session sends nothing."""
    st, p = table()
    for i in range(6):
        k = key(f"r{i}")
        t = 100.0 * i
        p.admit(k, 1, t)
        p.insert(k, 1, t)
        st.apply(SessionHint(f"r{i}", "finished", (k,), source="quiet"), t + 1.0)
        p.access(k, t + 1.0)                              # its own last request
        p.access(k, t + 30.0)                             # it came back, without a hint
        p.access(k, t + 31.0)
        st.tick(t + 99.0)
    assert not st.trust.believed("quiet")


# ---------------------------------------------------------------------- whole runs


def conversations(n: int = 800, seed: int = 1) -> list[Request]:
    """Conversations of 1-7 turns sharing a first block, log-normal gaps (median 30 s)."""
    rng = random.Random(seed)
    reqs, next_id, t0 = [], 1, 0.0
    for _ in range(n):
        t0 += rng.expovariate(0.5)
        k = rng.randint(2, 6)
        ids, next_id = [0] + list(range(next_id, next_id + k)), next_id + k
        t = t0
        for _ in range(1 + min(int(rng.expovariate(1 / 1.5)), 6)):
            reqs.append(Request(t * 1000.0, 512 * len(ids) + 100, 10, ids + [next_id]))
            k = rng.randint(1, 3)
            ids, next_id = ids + list(range(next_id + 1, next_id + 1 + k)), next_id + 1 + k
            t += math.exp(rng.gauss(math.log(30.0), 1.2))
    reqs.sort(key=lambda r: r.timestamp_ms)
    return reqs


@pytest.fixture(scope="module")
def runs():
    reqs = conversations()
    tiers = [simulate.TierSpec("host", 120 * 1024, "next_use")]
    times = simulate.virtual_times(reqs)

    def run(spec: str | None, **kw) -> float:
        hints = sim_hints.derive(reqs, times, sim_hints.parse_hints_spec(spec), simulate.TraceKeys()) if spec else None
        return simulate.run(reqs, tiers, block_bytes=1024, session_hints=hints, **kw).hit_rate
    return run


@pytest.mark.parametrize("spec", ["realistic:wrong=1", "finish-only:wrong=1", "continue-only:wrong=1"])
def test_always_wrong_hints_end_where_no_hints_are(runs, spec):
    none = runs(None)
    assert runs(spec) == pytest.approx(none, abs=0.01)
    assert runs(spec, trust={"off": True}) < none - 0.05          # believed, they would wreck it


def test_honest_hints_keep_their_gain(runs):
    none = runs(None)
    assert runs("realistic") > none + 0.1
    assert runs("realistic") == pytest.approx(runs("realistic", trust={"off": True}), abs=0.01)
    assert runs("finish-only") > none + 0.05
