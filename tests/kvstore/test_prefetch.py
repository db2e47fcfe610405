"""The prefetch scheduler: predictions, timed promotion, protection, and a small workload."""

from __future__ import annotations

import pytest

from kvstore.tools import simulate
from kvstore.tools.agent_trace import AgentWorkload, Tool, generate
from kvstore.config.node import PrefetchConfig
from kvstore.store.manager import TierManager
from kvstore.policy import make_policy
from kvstore.agent.prefetch import PrefetchScheduler
from kvstore.tools.trace import Request
from tiers.base import TierKind
from tiers.null import NullTier

BLOCK = 100


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def make(enabled: bool = True, hbm_blocks: int = 4, policy: str = "lru"):
    clock = Clock()
    tiers = [NullTier(TierKind.HBM, hbm_blocks * BLOCK), NullTier(TierKind.HOST, 1000 * BLOCK)]
    policies = [make_policy(policy, t.capacity_bytes) for t in tiers]
    m = TierManager(tiers, policies, clock=clock)
    s = PrefetchScheduler(m, PrefetchConfig(enabled=enabled, quantile=0.5, lead_time_s=0.1, window=8),
                          clock=clock, measure_bandwidth=False)
    for tool, seconds in (("search", 10.0), ("fast", 2.0)):   # teach the predictor
        for i in range(5):
            s.tool_call_start(f"warm-{tool}-{i}", tool, 1.0, [])
            s.resume(f"warm-{tool}-{i}", 1.0 + seconds)
    s.stats.__init__()
    return m, s, clock


def put(m: TierManager, names: str) -> list[bytes]:
    keys = [key(n) for n in names]
    for k in keys:
        m.put(k, bytes(BLOCK))
    return keys


def in_hbm(m: TierManager, keys) -> bool:
    return all(k in m.tiers[0] for k in keys)


def test_predicted_resume_and_unknown_resume():
    m, s, clock = make()
    assert s.tool_call_start("T", "search", 100.0, []) == pytest.approx(110.0)
    assert s.tool_call_start("U", "never-seen", 100.0, []) > 100.0      # pooled estimate
    assert s.resume("nobody", 105.0) == (False, 0.0)
    assert s.resume("T", 112.0) == (True, pytest.approx(12.0))
    assert s.stats.resumes == 1 and s.stats.resumes_unknown == 1
    assert s.stats.abs_error_s == [pytest.approx(2.0)]


@pytest.mark.parametrize("enabled, ready", [(True, 1.0), (False, 0.0)])
def test_demoted_prefix_is_back_in_hbm_before_the_resume(enabled, ready):
    m, s, clock = make(enabled)
    clock.t = 100.0
    t_keys = put(m, "abcd")
    s.tool_call_start("T", "search", 100.0, t_keys)           # resumes at ~110
    clock.t = 101.0
    put(m, "wxyz")                                             # other work pushes T to host
    assert not any(k in m.tiers[0] for k in t_keys)
    clock.t = 105.0
    s.tick(105.0)
    assert not any(k in m.tiers[0] for k in t_keys)            # not due yet
    due = s.next_due()
    if enabled:   # 109.9 (the median less the lead time) less 4 blocks at 64 GB/s
        assert due == pytest.approx(109.9 - 4 * BLOCK / 64e9, abs=1e-12)
    else:
        assert due == float("inf")
    clock.t = 109.9
    s.tick(109.9)
    assert in_hbm(m, t_keys) == enabled
    assert s.resume("T", 110.0) == (True, pytest.approx(10.0))
    assert s.stats.ready_rate == ready
    assert s.stats.promoted_bytes == (4 * BLOCK if enabled else 0)
    assert s.stats.wasted_bytes == 0


def test_promotion_never_evicts_a_trajectory_needed_sooner():
    m, s, clock = make(hbm_blocks=4)
    clock.t = 100.0
    t_keys = put(m, "abc")
    s.tool_call_start("T", "search", 100.0, t_keys)           # expected back at 110
    clock.t = 101.0
    put(m, "op")
    clock.t = 107.95
    v_keys = put(m, "vu")                                      # HBM now holds o p v u
    s.tool_call_start("V", "fast", 107.95, v_keys)            # expected back at 109.95: sooner
    clock.t = 109.9
    s.tick(109.9)
    assert in_hbm(m, v_keys)                                   # V kept
    assert key("o") not in m.tiers[0] and key("p") not in m.tiers[0]
    assert in_hbm(m, t_keys[:2]) and t_keys[2] not in m.tiers[0]   # head first, then blocked
    assert s.stats.promotions_blocked == 1


def test_waste_counts_promoted_blocks_evicted_before_use():
    m, s, clock = make(hbm_blocks=4)
    clock.t = 100.0
    t_keys = put(m, "ab")
    s.tool_call_start("T", "search", 100.0, t_keys)
    clock.t = 101.0
    put(m, "wxyz")
    clock.t = 109.9
    s.tick(109.9)
    assert in_hbm(m, t_keys)
    put(m, "qrst")                                             # LRU pushes the promoted blocks out
    s.resume("T", 110.0)
    assert s.stats.promoted_bytes == 2 * BLOCK
    assert s.stats.wasted_bytes == 2 * BLOCK and s.stats.waste == 1.0
    assert s.stats.ready_rate == 0.0


def test_disabled_scheduler_moves_nothing_but_still_measures():
    m, s, clock = make(enabled=False)
    clock.t = 100.0
    t_keys = put(m, "ab")
    s.tool_call_start("T", "search", 100.0, t_keys)
    s.tick(109.9)
    assert s.next_due() == float("inf")
    s.resume("T", 110.0)
    assert s.stats.ready_rate == 1.0 and s.stats.promoted_blocks == 0


def test_background_thread_starts_and_stops():
    m, s, clock = make()
    s.start()
    s.start()            # idempotent
    s.stop()
    assert not s.ticker.running


LIGHT_TOOLS = (Tool("search", 0.8, 0.4, 400, 0.5, 0.35), Tool("browse", 2.5, 0.5, 1200, 0.6, 0.25),
               Tool("python", 4.0, 0.9, 250, 1.0, 0.25), Tool("tests", 20.0, 0.7, 600, 0.7, 0.15))


def test_small_light_tailed_workload_prefetch_raises_readiness():
    w = AgentWorkload(agents=6, duration_s=600.0, seed=1, tools=LIGHT_TOOLS, chat=None, abandon_prob=0.0,
                      mean_turns=8)
    reqs_raw, events = generate(w)
    reqs = [Request(float(r["timestamp"]), r["input_length"], r["output_length"], r["hash_ids"])
            for r in reqs_raw]
    tiers = [simulate.TierSpec("hbm", 60 * BLOCK, "next_use"), simulate.TierSpec("host", 10_000 * BLOCK, "next_use")]
    out = {}
    for enabled in (False, True):
        r = simulate.run(reqs, tiers, block_bytes=BLOCK, events=events,
                         prefetch=PrefetchConfig(enabled=enabled, quantile=0.1, lead_time_s=0.05))
        out[enabled] = r.prefetch
    assert out[False]["resumes"] == out[True]["resumes"] > 100
    assert out[False]["promoted_bytes"] == 0 < out[True]["promoted_bytes"]
    assert out[True]["ready_token_rate"] >= out[False]["ready_token_rate"] + 0.015
    assert out[True]["ready_rate"] >= out[False]["ready_rate"] + 0.015
    assert out[True]["waste"] <= 0.1


def test_a_session_hint_schedules_a_promotion_and_its_next_hint_is_the_resume():
    from kvstore.agent.sessions import SessionHint
    m, s, clock = make()
    for i in range(5):                                         # sessions come back when they say
        s.session_hint(SessionHint(f"warm{i}", "continues", (), expected_back_s=10.0, time=10.0 * i))
        s.session_hint(SessionHint(f"warm{i}", "finished", (), time=10.0 * i + 10.0))
    s.stats.__init__()
    clock.t = 100.0
    keys = put(m, "abcd")
    assert s.session_hint(SessionHint("S", "continues", tuple(keys), expected_back_s=10.0)) == 110.0
    clock.t = 101.0
    put(m, "wxyz")                                             # pushes S's blocks to host
    assert not any(k in m.tiers[0] for k in keys)
    due = s.next_due()
    assert 105.0 < due < 110.0
    clock.t = due
    s.tick(due)
    assert in_hbm(m, keys)
    clock.t = 110.0
    s.session_hint(SessionHint("S", "finished", (), time=110.0))   # its last request: the resume
    assert s.stats.resumes == 1 and s.stats.ready_rate == 1.0 and s.stats.waste == 0.0
    assert s.sessions.get("S") is None


def test_low_confidence_holds_a_promotion_back_and_an_abandoned_session_is_dropped():
    from kvstore.agent.sessions import SessionHint
    m, s, clock = make()
    for i, d in enumerate([1.0, 1.0, 200.0, 300.0, 400.0, 500.0]):   # mostly very slow
        s.tool_call_start(f"w{i}", "flaky", 1.0, [])
        s.resume(f"w{i}", 1.0 + d)
    s.stats.__init__()
    clock.t = 100.0
    keys = put(m, "ab")
    s.tool_call_start("T", "flaky", 100.0, keys)
    put(m, "wxyz")
    for t in (100.5, 103.0, 106.0):
        clock.t = t
        s.tick(t)
    assert s.stats.promoted_blocks == 0 and s.next_due() < float("inf")   # checked again later
    s.session_hint(SessionHint("T", "abandoned", ()))
    assert s.next_due() == float("inf") and s.stats.resumes == 0
    assert all(m.policies[0].is_let_go(k) for k in keys)


def test_a_resume_of_a_session_wait_is_its_return_counted_once():
    from kvstore.agent.sessions import SessionHint, SessionState

    clock = Clock()
    tiers = [NullTier(TierKind.HBM, 4 * BLOCK), NullTier(TierKind.HOST, 1000 * BLOCK)]
    m = TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], clock=clock)
    s = PrefetchScheduler(m, PrefetchConfig(enabled=True), clock=clock, measure_bandwidth=False)
    keys = tuple(put(m, "ab"))
    clock.t = 100.0
    s.session_hint(SessionHint("S", SessionState.CONTINUES, keys, expected_back_s=10.0, time=100.0))
    clock.t = 105.0
    assert s.resume("S", 105.0) == (True, 5.0)        # the engine's Resume when its next request arrives
    assert s.sessions.stats.returns == 1
    clock.t = 108.0                                    # that request ran 3 s; it continues again
    s.session_hint(SessionHint("S", SessionState.CONTINUES, keys, expected_back_s=10.0, time=108.0))
    assert s.sessions.stats.returns == 1               # not a second return
    assert s.sessions.expected_gap() == 5.0            # the gap is to the arrival, not to the next hint


def test_a_lookup_never_waits_for_a_pass_that_holds_the_scheduler():
    """The daemon's Lookup feeds the reuse model through observe_request: while a pass
    (a page back from NVMe) holds the scheduler's lock it is queued, not waited for, and
    learnt at the time it arrived once the pass ends."""
    import threading

    m, s, clock = make()
    clock.t = 50.0
    seen = s.model.requests_seen
    holding, release = threading.Event(), threading.Event()

    def long_pass():
        with s._lock:
            holding.set()
            release.wait(60)
    t = threading.Thread(target=long_pass)
    t.start()
    try:
        assert holding.wait(60)
        done = threading.Event()
        threading.Thread(target=lambda: (s.observe_request([key("a"), key("b")]), done.set())).start()
        assert done.wait(60), "observe_request waited for the pass"
        assert s.model.requests_seen == seen               # queued, not learnt yet
    finally:
        release.set()
        t.join(60)
    clock.t = 50.1
    s.tick()
    assert s.model.requests_seen == seen + 1
    clock.t = 50.2
    s.observe_request([key("a"), key("b")])                  # the same prefix again within dedupe_s
    assert s.model.requests_seen == seen + 1
    s.observe_request([key("c")], now=60.0)                  # a timed call (the simulator) learns at once
    assert s.model.requests_seen == seen + 2
