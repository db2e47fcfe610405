"""Every policy: released blocks (ended sessions) go first, tail first; eviction events."""

from __future__ import annotations

import pytest

from kvstore.policy import POLICIES, EvictionEvent, make_policy

DAEMON_POLICIES = ("lru", "arc", "s3fifo", "next_use")


def k(name: str) -> bytes:
    return name.encode()


def filled(name: str, names: str, capacity: int = 100):
    p = make_policy(name, capacity, tier_name="host")
    for i, n in enumerate(names):
        p.insert(k(n), 1, float(i))
    return p


@pytest.mark.parametrize("name", DAEMON_POLICIES)
def test_released_blocks_are_the_first_victims_tail_first(name):
    p = filled(name, "abcdef")
    p.let_go([k("c"), k("d"), k("e")])                # a session's prefix, in order
    order = []
    for _ in range(3):
        v = p.victim(lambda x: True, now=10.0)
        order.append(v)
        p.evicted(v)
    assert order == [k("e"), k("d"), k("c")]
    assert len(p) == 3 and p.used_bytes == 3


@pytest.mark.parametrize("name", DAEMON_POLICIES)
def test_only_revive_undoes_a_release_and_pinned_ones_are_skipped(name):
    p = filled(name, "abcd")
    p.let_go([k("b"), k("c")])
    p.access(k("c"), 5.0)                               # the session's own last read
    assert p.is_let_go(k("c"))
    p.revive([k("c")])                                  # a new session uses it
    assert not p.is_let_go(k("c"))
    assert p.victim(lambda x: True, now=6.0) == k("b")
    v = p.victim(lambda x: x != k("b"), now=6.0)
    assert v != k("b") and not p.is_let_go(v)


@pytest.mark.parametrize("name", DAEMON_POLICIES)
def test_a_full_tier_refuses_a_released_block_that_arrives_later(name):
    p = filled(name, "ab", capacity=2)
    p.let_go([k("z")])                                 # not resident yet
    assert not p.admit(k("z"), 1, 3.0)
    assert p.admit(k("y"), 1, 3.0) or name == "next_use"  # next_use may refuse on its own
    q = filled(name, "a", capacity=2)
    q.let_go([k("z")])
    assert q.admit(k("z"), 1, 3.0)                      # room left: stored, but first to go
    q.insert(k("z"), 1, 3.0)
    assert q.victim(lambda x: True, now=4.0) == k("z")


def test_revive_and_removal_forget_released_state():
    p = filled("lru", "abc")
    p.let_go([k("a"), k("b")])
    p.revive([k("a")])
    p.remove(k("b"))
    assert p.victim(lambda x: True, now=5.0) == k("a")   # plain LRU order again
    assert not p.is_let_go(k("a"))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_pressure_eviction_is_reported_with_a_reason(name):
    events: list[EvictionEvent] = []
    p = filled(name, "abc")
    p.listener = events.append
    p.let_go([k("b")])
    v = p.victim(lambda x: True, now=7.0)
    p.evicted(v)
    assert events == [EvictionEvent(k("b"), "host", name, "its session ended (released by a session hint)", 7.0)]
    v = p.victim(lambda x: True, now=8.0)
    p.evicted(v)
    assert events[1].key == v and events[1].time == 8.0 and events[1].reason
    p.remove(k("a") if v != k("a") else k("c"))         # not pressure: no event
    assert len(events) == 2
