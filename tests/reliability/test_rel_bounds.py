"""Bounded state (issue 9, item 5): every per-client table of the daemon has a bound.

The prefetch scheduler runs on a virtual clock over byte-less tiers, so thousands of
tool calls take no real time and every verdict is a table size or a count. The manager's
leases and size-conflict log are driven directly. docs/reliability.md lists the bounds.
"""

from __future__ import annotations

import pytest

from kvstore.store import leases as leases_mod
from kvstore.config.node import PrefetchConfig
from kvstore.common.errors import SizeConflict
from kvstore.store.manager import MAX_SIZE_CONFLICTS_LOGGED, TierManager
from kvstore.policy import make_policy
from kvstore.agent.prefetch import PrefetchScheduler
from kvstore.agent.stats import RESERVOIR
from rel_support import MemTier, key
from tiers.base import TierKind
from tiers.null import NullTier

BLOCK = 100


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(enabled=True, hbm_blocks=64, predictor="lognormal", repromote=False, **cfg):
    clock = Clock()
    tiers = [NullTier(TierKind.HBM, hbm_blocks * BLOCK), NullTier(TierKind.HOST, 100_000 * BLOCK)]
    m = TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], clock=clock)
    config = PrefetchConfig(enabled=enabled, predictor=predictor, quantile=0.5, lead_time_s=0.1, window=8, **cfg)
    s = PrefetchScheduler(m, config, clock=clock, measure_bandwidth=False, repromote=repromote, confidence=0.0)
    for i in range(5):                               # "search" takes 10 s
        s.tool_call_start(f"warm-{i}", "search", 1.0, [])
        s.resume(f"warm-{i}", 11.0)
    s.stats.__init__()
    return m, s, clock


def sizes(s) -> dict:
    t = s.waits.sizes()
    return {"waiting": t["waiting"], "due": len(s.timeline), "expiry": t["expiry"], "active": t["running"],
            "expired": t["expired"], "promoted": len(s.pager),
            "errors": len(s.stats.abs_error_s), "tools": len(s.predictor.tools())}


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["prefetch", "observe-only"])
def test_5000_never_resumed_calls_expire_and_leave_the_tables_empty(enabled):
    m, s, clock = scheduler(enabled, hbm_blocks=8, expire_factor=2.0)      # expire 20 s after the call
    peak: dict = {}
    for i in range(5000):                            # one call a second, each with its own block
        clock.t = 100.0 + i
        k = key(i, "never")
        m.put(k, bytes(BLOCK))                       # pushes older calls' blocks to the host tier
        s.tool_call_start(f"T{i}", "search", clock.t, [k])
        s.tick()
        peak = {n: max(v, peak.get(n, 0)) for n, v in sizes(s).items()}
    assert peak["waiting"] <= 21                     # 20 s of calls
    assert peak["due"] <= 4 * (2 * 21 + 64) and peak["expiry"] <= 2 * (2 * 21 + 64) + 1
    assert peak["promoted"] <= 16 + 21
    assert peak["expired"] <= 65536 and peak["active"] == 0
    if enabled:
        assert s.stats.promoted_blocks > 0           # the tables were exercised
    clock.t = 100.0 + 5000 + 21                      # past the last call's expiry
    s.tick()
    after = sizes(s)
    assert after["waiting"] == 0 and after["promoted"] == 0
    assert after["expired"] == 5000 and s.stats.expired == 5000
    assert s.next_due() == float("inf")


def test_max_waiting_bounds_the_table_even_within_the_expiry_time():
    m, s, clock = scheduler(max_waiting=100)
    clock.t = 100.0
    for i in range(5000):
        s.tool_call_start(f"T{i}", "search", clock.t, [])
        assert len(s.waits) <= 100
    assert s.stats.expired == 4900 and s.waits.sizes()["expired"] <= 100 and s.waits.sizes()["expiry"] <= 2 * (2 * 100 + 64) + 1


def test_20000_start_resume_pairs_keep_statistics_and_tables_bounded():
    m, s, clock = scheduler()
    for i in range(20_000):                          # a 10 s tool call every second, 10 in flight
        clock.t = 100.0 + i
        s.tool_call_start(f"T{i}", "search", clock.t, [])
        if i >= 10:
            assert s.resume(f"T{i - 10}", clock.t) == (True, pytest.approx(10.0))
        s.tick()
    got = sizes(s)
    assert got["waiting"] == 10 and got["errors"] == RESERVOIR and got["tools"] == 1
    assert got["active"] <= 31                        # resumed within active_protect_s (30 s)
    assert got["due"] <= 4 * (2 * 10 + 64) and got["expiry"] <= 2 * (2 * 10 + 64) + 1
    assert s.stats.resumes == 19_990 and s.stats.errors_seen == 19_990
    assert s.stats.summary()["prediction_mae_s"] == pytest.approx(0.0, abs=1e-6)


def test_no_re_promotion_after_expiry():
    m, s, clock = scheduler(hbm_blocks=4, repromote=True)
    clock.t = 100.0
    t_keys = [key(i, "T") for i in range(2)]
    for k in t_keys:
        m.put(k, bytes(BLOCK))
    s.tool_call_start("T", "search", 100.0, t_keys)   # median 10 s: expires at 200 s

    def push_out(tag):
        for i in range(4):
            m.put(key(i, tag), bytes(BLOCK))          # LRU pushes T's blocks to the host tier
        assert not any(k in m.tiers[0] for k in t_keys)
    push_out("a")
    promoted = []
    for step in range(1, 400):                        # 0.5 s steps from 100 s to ~300 s
        clock.t = 100.0 + step * 0.5
        s.tick()
        promoted.append(s.stats.promoted_blocks)
        if clock.t in (120.0, 150.0, 220.0, 260.0):
            push_out(f"b{clock.t}")
    before_expiry = promoted[:199]                    # up to 199.5 s
    after_expiry = promoted[199:]
    assert before_expiry[-1] >= 6                     # promoted, then re-promoted after each push-out
    assert "T" not in s.waits and s.stats.expired == 1
    assert after_expiry[-1] == after_expiry[0] == before_expiry[-1]     # nothing promoted after 200 s
    assert not any(k in m.tiers[0] for k in t_keys)


@pytest.mark.parametrize("predictor", ["quantile", "lognormal"])
def test_a_heavy_tailed_tools_wait_does_not_expire_before_its_observed_tail(predictor):
    """Most calls of "shell" take 0.2 s, a few 30 s (a heavy tail, as agents' tool gaps):
    a wait expires after the tail of what was observed, not after 10 x the median (2 s),
    and never later than max_wait_s."""
    m, s, clock = scheduler(predictor=predictor, expire_factor=10.0)
    for i in range(16):
        s.tool_call_start(f"w{i}", "shell", 1.0, [])
        s.resume(f"w{i}", 1.0 + (30.0 if i % 8 == 0 else 0.2))
    tail = s.durations.tool_quantile("shell", 0.99)
    assert s.durations.tool_quantile("shell", 0.5) < 1.0 and tail > 5.0
    clock.t = 100.0
    s.tick()
    expired = s.stats.expired
    s.tool_call_start("T", "shell", 100.0, [key(0, "T")])
    for t in (103.0, 100.0 + 0.9 * tail):
        clock.t = t
        s.tick()
        assert "T" in s.waits                         # past 10 x its median, within its tail
    clock.t = 100.0 + tail + 0.01
    s.tick()
    assert "T" not in s.waits and s.stats.expired == expired + 1
    _, capped, clock = scheduler(predictor=predictor, expire_factor=10.0, max_wait_s=3.0)
    for i in range(16):
        capped.tool_call_start(f"w{i}", "shell", 1.0, [])
        capped.resume(f"w{i}", 1.0 + (30.0 if i % 8 == 0 else 0.2))
    clock.t = 100.0
    capped.tool_call_start("T", "shell", 100.0, [key(0, "T")])
    clock.t = 103.01
    capped.tick()
    assert "T" not in capped.waits                    # max_wait_s still bounds it


def test_a_tail_learnt_while_a_trajectory_waits_keeps_it_waiting():
    """T opens its wait while "shell" looks light-tailed (0.2 s: it would expire at 2 s);
    long calls observed during its wait extend it to the tail learnt since."""
    m, s, clock = scheduler(predictor="quantile", expire_factor=10.0)
    for i in range(8):
        s.tool_call_start(f"a{i}", "shell", 1.0, [])
        s.resume(f"a{i}", 1.2)
    clock.t = 100.0
    s.tick()
    s.tool_call_start("T", "shell", 100.0, [key(0, "T")])
    clock.t = 100.5
    for i in range(4):                                 # four 30 s calls end while T waits
        s.tool_call_start(f"b{i}", "shell", 70.0, [])
        s.resume(f"b{i}", 100.5)
    tail = s.durations.tool_quantile("shell", 0.99)
    assert tail > 20.0
    for t in (103.0, 100.0 + 0.9 * tail):
        clock.t = t
        s.tick()
        assert "T" in s.waits
    expired = s.stats.expired
    clock.t = 100.0 + tail + 0.01
    s.tick()
    assert "T" not in s.waits and s.stats.expired == expired + 1


def test_a_late_resume_after_expiry_still_teaches_the_predictor():
    m, s, clock = scheduler()
    before = s.predictor.tools()["search"]
    s.tool_call_start("T", "search", 100.0, [])
    clock.t = 500.0
    s.tick()
    assert "T" not in s.waits
    assert s.resume("T", 500.0) == (True, pytest.approx(400.0))
    assert s.predictor.tools()["search"] == before + 1 and s.stats.resumes_expired == 1
    assert s.resume("T", 501.0) == (False, 0.0)


# ------------------------------------------------------------------ manager tables

def shared_manager():
    from tiers.host import HostTier
    host = HostTier(8 << 20, shared=True)
    return TierManager([host], [make_policy("lru", host.capacity_bytes)])


def test_leases_of_misses_hold_nothing_and_the_lease_table_is_capped(monkeypatch):
    m = shared_manager()
    try:
        m.put(key(1), b"x" * 4096)
        for i in range(2000):
            grant = m.lease([key(i, "missing")], 30.0)
            assert grant.lease_id == "" and not grant.blocks[0].found
        assert m.catalogue.num_leases == 0
        monkeypatch.setattr(leases_mod, "MAX_LEASES", 100)
        grants = [m.lease([key(1)], 30.0) for _ in range(150)]
        assert sum(1 for g in grants if g.lease_id) == 100 and m.catalogue.num_leases == 100
        refused = grants[-1]
        assert refused.lease_id == "" and refused.blocks == () and refused.resume_at == 0
        assert m.counters["leases_refused"] == 50
        for g in grants:
            m.release(g.lease_id)
        for _ in range(20_000):                       # grant and release: the deadline heap stays small
            m.release(m.lease([key(1)], 600.0).lease_id)
        assert m.catalogue.num_leases == 0 and len(m.catalogue._deadlines) <= 1024 + 2
    finally:
        m.close()


def test_the_size_conflict_log_is_bounded():
    tier = MemTier(TierKind.HOST, 64 << 20)
    m = TierManager([tier], [make_policy("lru", tier.capacity_bytes)])
    keys = [key(i, "c") for i in range(MAX_SIZE_CONFLICTS_LOGGED + 1000)]
    for k in keys:
        m.put(k, b"a" * 16)
    for k in keys:
        with pytest.raises(SizeConflict):
            m.put(k, b"b" * 32)
    assert len(m.writes._size_conflicts_logged) == MAX_SIZE_CONFLICTS_LOGGED
    assert m.counters["puts_size_conflict"] == len(keys)


def test_the_reuse_model_and_the_request_dedupe_table_are_bounded():
    from kvstore.policy.reuse_model import ReuseModel
    model = ReuseModel(max_records=500, max_keys=2000)
    for i in range(1000):                              # 1,000 requests of 8 fresh blocks each
        model.observe_request([key(i * 8 + j, "reuse") for j in range(8)], now=float(i))
    assert len(model._records) <= 500 and len(model._record_of) <= 2000
    m, s, clock = scheduler(enabled=False)
    for i in range(10_000):
        s.observe_request([key(i, "dedupe")], now=float(i))
    assert len(s.observer._recent) <= 4096


def test_session_hint_waits_expire_and_a_late_hint_still_calibrates():
    from kvstore.agent.sessions import SessionHint, SessionState
    m, s, clock = scheduler()
    clock.t = 100.0
    for i in range(300):                              # sessions that never come back
        s.session_hint(SessionHint(f"S{i}", SessionState.CONTINUES, (), expected_back_s=20.0, time=clock.t))
    assert len(s.waits) == 300
    clock.t = 100.0 + 10 * 20.0 + 1                   # past expire_factor (10) x the hinted gap
    s.tick()
    assert len(s.waits) == 0 and s.stats.expired == 300
    assert s.resume("S0", clock.t) == (True, pytest.approx(201.0))   # late: learned, not scored
    assert s.stats.resumes_expired == 1 and s.stats.resumes == 0


# ------------------------------------------------------------------ hint tables and keys

def test_one_session_hinted_many_times_keeps_its_heaps_small():
    """Every continuing hint with a TTL pushes a deadline and a trust check; replaced ones
    are dropped when they outnumber the live ones, not kept until their time."""
    from kvstore.agent.sessions import SessionHint, SessionTable
    table = SessionTable([make_policy("next_use", 1000 * BLOCK)])
    for i in range(20_000):
        table.apply(SessionHint("one", "continues", (key(1),), expected_back_s=3000.0, ttl_s=80_000.0), float(i))
    assert len(table._deadlines) <= 4 * 1 + 1024 + 1
    assert len(table._checks) <= 4 * 1 + 1024 + 1
    assert table.get("one").keys == (key(1),)


def test_the_keys_held_by_session_hints_are_bounded():
    from kvstore.agent.sessions import SessionHint, SessionTable
    table = SessionTable([make_policy("lru", 1000 * BLOCK)], max_keys=10_000)
    for i in range(100):                              # 100 sessions x 1,000 keys: 10x the bound
        keys = tuple(key(i * 1000 + j) for j in range(1000))
        table.apply(SessionHint(f"s{i}", "continues", keys, expected_back_s=60.0), float(i))
        if i % 2:
            table.apply(SessionHint(f"s{i - 1}", "finished", ()), float(i))
    held = sum(len(s.keys) for s in table._sessions.values()) + sum(len(e.keys) for e in table._ended.values())
    assert held <= 10_000
    assert table.get("s99") is not None and table.get("s0") is None      # the least recently hinted went


def test_the_keys_held_by_waiting_and_running_trajectories_are_bounded():
    m, s, clock = scheduler(hbm_blocks=8)
    s.waits.max_keys = 5_000
    for i in range(60):                               # 60 waits x 500 keys: 6x the bound
        clock.t = 100.0 + i
        s.tool_call_start(f"t{i}", "search", clock.t, [key(i * 1000 + j) for j in range(500)])
        if i % 3 == 0:
            s.resume(f"t{i}", clock.t + 0.5)
    t = s.waits.sizes()
    assert t["keys"] <= 5_000
    assert t["keys"] == (sum(len(s.waits.get(tid).keys) for tid in s.waits)
                         + sum(len(k) for k in s.waits.running_keys()))
    assert "t59" in s.waits                           # the newest wait stays


def test_next_use_hint_heaps_stay_small_when_one_session_is_hinted_again_and_again():
    from kvstore.agent.sessions import SessionHint, SessionTable
    p = make_policy("next_use", 1000 * BLOCK)
    table = SessionTable([p])
    p.insert(key(1), BLOCK, 0.0)
    for i in range(20_000):
        table.apply(SessionHint("one", "continues", (key(1),), expected_back_s=float(i % 50 + 1)), float(i))
    g = p.hint_groups
    assert len(g._hints) == 1
    assert len(g._expiry) <= 2 * 1 + 1024 + 1
    assert sum(map(len, g._hold.values())) <= 56 * (2 * 1 + 1024 + 1)


def test_a_hint_groups_blocks_arriving_in_any_order_leave_tail_first():
    import random
    from kvstore.policy.hint_groups import HintGroups
    groups = HintGroups(hint_grace_s=60.0, overdue_ratio=1.0)
    h = groups.new_group(100.0, 0.0)
    keys = [key(i) for i in range(2000)]
    for i, k in enumerate(keys):
        groups.assign(h, k, i)
    order = list(range(2000))
    random.Random(5).shuffle(order)
    for i in order:
        groups.join(h, keys[i])
    for i in order[:500]:                                 # some leave again
        groups.left(keys[i])
    assert list(h.tail_first()) == [keys[i] for i in sorted(order[500:], reverse=True)]


def test_next_use_hints_of_finished_sessions_expire_and_their_heaps_stay_small():
    """Short hinted sessions that finish, in a full tier: evictions are served by the blocks
    let go (the policy's own choice never runs), yet old hint groups expire and the
    candidate heaps of both ends of each gap class stay bounded."""
    from kvstore.agent.sessions import SessionHint, SessionTable
    tier = MemTier(TierKind.HOST, 64 * BLOCK)
    p = make_policy("next_use", tier.capacity_bytes, tier_name="host")
    clock = [0.0]
    m = TierManager([tier], [p], clock=lambda: clock[0], watermarks=(1.0, 1.0))
    table = SessionTable([p])
    try:
        for i in range(3000):
            clock[0] += 26.0
            ks = (key(2 * i), key(2 * i + 1))
            m.put(ks[0], b"x" * BLOCK)
            table.apply(SessionHint(f"s{i}", "continues", ks[:1], expected_back_s=float(i % 40 + 1)), clock[0])
            m.put(ks[1], b"y" * BLOCK)
            table.apply(SessionHint(f"s{i}", "continues", ks, expected_back_s=5.0), clock[0] + 1.0)
            table.apply(SessionHint(f"s{i}", "finished", ks), clock[0] + 2.0)
        g = p.hint_groups
        assert len(g._hints) <= 64                    # groups of hints still valid (300 s grace)
        assert len(g._expiry) <= 2 * len(g._hints) + 1024 + 1
        assert max(map(len, g._hyoung.values())) <= 2 * len(g._hints) + 1024 + 1
        assert max(map(len, p._young.values()), default=0) <= 2 * len(p._groups) + 1024 + 1
    finally:
        m.close()
