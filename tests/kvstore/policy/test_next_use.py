"""next_use: online Belady from explicit hints and the learned reuse model."""

from __future__ import annotations

import pytest

from kvstore.common.errors import ConfigError
from kvstore.policy import AcceptsNextUse, NoVictim, UsesReuseModel, make_policy
from kvstore.policy.reuse_model import ReuseModel


def k(name: str) -> bytes:
    return name.encode()


def test_implements_both_hint_interfaces():
    p = make_policy("next_use", 10)
    assert isinstance(p, AcceptsNextUse) and isinstance(p, UsesReuseModel)
    assert not isinstance(make_policy("lru", 10), AcceptsNextUse)


def test_without_hints_it_is_lru_with_tail_first():
    p = make_policy("next_use", 10)
    p.insert(k("a"), 1, 0.0)
    p.insert(k("b"), 1, 1.0)
    p.insert(k("c"), 1, 2.0)
    assert p.victim(lambda x: True, now=3.0) == k("a")
    p.access(k("a"), 3.0)
    assert p.victim(lambda x: True, now=4.0) == k("b")
    # blocks inserted together (one request) leave tail first
    q = make_policy("next_use", 10)
    for name in ("x", "y", "z"):
        q.insert(k(name), 1, 5.0)
    assert q.victim(lambda x: True, now=6.0) == k("z")


def test_explicit_hints_evict_the_farthest_next_use():
    p = make_policy("next_use", 10)
    for name in "abc":
        p.insert(k(name), 1, 0.0)
    p.set_next_use([k("a"), k("b"), k("c")], [10.0, 30.0, 20.0], now=0.0)
    assert p.victim(lambda x: True, now=1.0) == k("b")
    assert p.victim(lambda x: x != k("b"), now=1.0) == k("c")      # pinned b is skipped
    assert p.distance(k("a"), 1.0) == pytest.approx(9.0)
    with pytest.raises(NoVictim):
        p.victim(lambda x: False, now=1.0)


def test_a_hint_is_consumed_by_its_use_and_expires_after_the_grace():
    p = make_policy("next_use", 10, {"hint_grace_s": 5.0, "overdue_ratio": 1.0})
    p.insert(k("a"), 1, 0.0)
    p.insert(k("b"), 1, 0.0)
    p.set_next_use([k("a")], 1000.0, now=0.0)
    assert p.victim(lambda x: True, now=1.0) == k("a")            # far hint: evicted first
    p.set_next_use([k("a")], 2.0, now=1.0)
    assert p.victim(lambda x: True, now=1.5) == k("b")            # near hint: kept
    assert p.distance(k("a"), 4.0) == pytest.approx(2.0)          # 2 s overdue: distance 2 s
    assert p.victim(lambda x: True, now=100.0) == k("b")          # expired: back to recency, b is the tail
    assert p.distance(k("a"), 100.0) <= p.distance(k("b"), 100.0)
    p.set_next_use([k("b")], 110.0, now=100.0)
    p.access(k("b"), 101.0)                                       # a hit does not consume it
    assert p.distance(k("b"), 101.0) == pytest.approx(9.0)
    p.clear_hints([k("b")], 108.0)                                # the session table drops it
    assert p.distance(k("b"), 108.0) != pytest.approx(2.0)


def test_a_hint_group_leaves_tail_first_and_overdue_groups_grow_farther():
    p = make_policy("next_use", 100, {"overdue_ratio": 0.5})
    names = ["s0", "s1", "s2", "t0", "t1"]
    for n in names:
        p.insert(k(n), 1, 0.0)
    p.set_next_use([k("s0"), k("s1"), k("s2")], 50.0, now=0.0)
    p.set_next_use([k("t0"), k("t1")], 20.0, now=0.0)
    assert p.victim(lambda x: True, now=1.0) == k("s2")           # due last, tail first
    assert p.victim(lambda x: x != k("s2"), now=1.0) == k("s1")
    # at 100 s both are overdue: t by 80 s (distance 40), s by 50 s (distance 25)
    assert p.victim(lambda x: True, now=100.0) == k("t1")
    assert p.distance(k("s0"), 100.0) == pytest.approx(25.0)


def test_admission_refuses_a_block_needed_later_than_all_residents():
    p = make_policy("next_use", 2)
    p.set_next_use([k("a"), k("b"), k("c"), k("d")], [5.0, 6.0, 100.0, 1.0], now=0.0)
    p.insert(k("a"), 1, 0.0)
    assert p.admit(k("c"), 1, 0.0)                                # room left: always admitted
    p.insert(k("b"), 1, 0.0)
    assert not p.admit(k("c"), 1, 0.0)                            # full, and needed last
    assert p.admit(k("d"), 1, 0.0)                                # full, but needed first
    assert p.counters["refused"] == 1
    assert make_policy("next_use", 2, {"admission": False}).admit(k("c"), 5, 0.0)


def _train(model: ReuseModel, n: int = 300) -> None:
    """Conversations whose body is reused 5 s later and whose tail never is."""
    shared = k("S")
    for i in range(n):
        t = 10.0 * i
        body = [shared, k(f"a{i}"), k(f"b{i}")]
        model.observe_request(body + [k(f"t{i}")], t)
        model.observe_request(body + [k(f"c{i}"), k(f"u{i}")], t + 5.0)
    model.refresh(10.0 * n)


def test_reuse_model_classes_continuations_and_distances():
    m = ReuseModel(refresh_every=10**9)
    _train(m)
    assert m.continuations == 300
    body = m.record_of(k("a299"))
    assert body.cls == m.conv_class(1, 2)          # continued once, the request added 2 blocks
    assert m.record_of(k("u299")).cls == m.TAIL
    assert m.record_of(k("S")).cls == m.SHARED
    # a fresh conversation body is needed sooner than a tail, and much sooner than an old body
    fresh = m.distance(m.conv_class(0, 3), 1.0)
    assert fresh < m.distance(m.TAIL, 1.0)
    assert fresh < m.distance(m.conv_class(0, 3), 600.0)
    assert m.distance(m.SHARED, 1.0) < fresh


def test_learned_model_evicts_the_dead_tail_first():
    m = ReuseModel(refresh_every=10**9)
    _train(m)
    p = make_policy("next_use", 100)
    p.attach(m)
    keys = [k("S"), k("x1"), k("x2"), k("xt")]
    m.observe_request(keys, 5000.0)
    for key in keys:
        p.insert(key, 1, 5000.0)
    assert p.victim(lambda x: True, now=5001.0) == k("xt")
    assert p.victim(lambda x: x != k("xt"), now=5001.0) == k("x2")   # then the body, tail first


@pytest.mark.parametrize("params", [{"admission": 1}, {"hint_grace_s": -1}, {"overdue_ratio": "x"},
                                    {"bogus": True}])
def test_bad_parameters_are_config_errors(params):
    with pytest.raises(ConfigError):
        make_policy("next_use", 4, params)
