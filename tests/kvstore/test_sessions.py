"""Session hints: continuing sessions feed next_use, ended ones are released; kv_hints mapping."""

from __future__ import annotations

import math
import time

import pytest

from kvstore.common.errors import InvalidRequest
from kvstore.agent.kv_hints import session_hints
from kvstore.policy import make_policy
from kvstore.agent.sessions import SessionHint, SessionState, SessionTable


def k(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def table(*names: str, capacity: int = 100):
    policies = [make_policy(n, capacity, tier_name=f"t{i}") for i, n in enumerate(names)]
    return SessionTable(policies), policies


def resident(p, names: str, now: float = 0.0) -> None:
    for n in names:
        p.insert(k(n), 1, now)


def test_continuing_sessions_give_their_private_blocks_one_time_each():
    st, (nu,) = table("next_use")
    resident(nu, "abcxyz")
    assert st.apply(SessionHint("A", "continues", (k("a"), k("b"), k("c")), expected_back_s=50.0), 0.0) == 50.0
    st.apply(SessionHint("B", "continues", (k("x"), k("y")), expected_back_s=10.0), 0.0)
    assert nu.distance(k("a"), 0.0) == pytest.approx(50.0)
    assert nu.distance(k("y"), 0.0) == pytest.approx(10.0)
    assert nu.victim(lambda x: True, now=1.0) == k("c")             # A is due last; its tail first
    assert st.private_keys("A") == [k("a"), k("b"), k("c")]


def test_a_finished_session_releases_only_its_private_blocks():
    st, (nu, lru) = table("next_use", "lru")
    for p in (nu, lru):
        resident(p, "sabz")
    st.apply(SessionHint("A", "continues", (k("s"), k("a"), k("b")), 30.0), 0.0)
    st.apply(SessionHint("Z", "continues", (k("s"), k("z")), 30.0), 0.0)     # s is shared
    assert st.private_keys("A") == [k("a"), k("b")]
    st.apply(SessionHint("A", "finished"), 5.0)                     # keys: as last given
    for p in (nu, lru):
        assert p.is_let_go(k("a")) and p.is_let_go(k("b")) and not p.is_let_go(k("s"))
        assert p.victim(lambda x: True, now=6.0) == k("b")          # tail first
    assert st.stats.finished == 1 and st.stats.released_blocks == 2
    assert st.get("A") is None


def test_abandoned_and_dropped_prefix_blocks_are_released_and_revived_on_reuse():
    st, (lru,) = table("lru")
    resident(lru, "abcd")
    st.apply(SessionHint("A", "continues", (k("a"), k("b"), k("c")), 20.0), 0.0)
    st.apply(SessionHint("A", "continues", (k("a"), k("d")), 20.0), 10.0)   # history edited: b, c dropped
    assert lru.is_let_go(k("b")) and lru.is_let_go(k("c")) and not lru.is_let_go(k("a"))
    st.apply(SessionHint("A", "abandoned"), 12.0)
    assert lru.is_let_go(k("a")) and lru.is_let_go(k("d"))
    st.apply(SessionHint("C", "continues", (k("a"),), 5.0), 13.0)          # a new session reuses a
    assert not lru.is_let_go(k("a"))
    assert st.stats.abandoned == 1 and st.stats.returns == 1


def test_without_an_expected_time_the_gap_is_learned_and_capped_by_the_ttl():
    st, (nu,) = table("next_use")
    assert st.expected_gap() == 60.0
    for i in range(5):                                              # sessions come back after 8 s
        st.apply(SessionHint(f"S{i}", "continues", (k(f"s{i}"),)), 100.0 * i)
        st.apply(SessionHint(f"S{i}", "finished"), 100.0 * i + 8.0)
    assert st.expected_gap() == pytest.approx(8.0)
    assert st.apply(SessionHint("T", "continues", (k("t"),)), 1000.0) == pytest.approx(1008.0)
    assert st.apply(SessionHint("U", "continues", (k("u"),), ttl_s=3.0), 1000.0) == pytest.approx(1003.0)


def test_a_ttl_that_runs_out_drops_the_hint_without_releasing():
    st, (nu,) = table("next_use")
    resident(nu, "ab")
    st.apply(SessionHint("A", "continues", (k("a"),), expected_back_s=5.0, ttl_s=20.0), 0.0)
    assert nu.distance(k("a"), 1.0) == pytest.approx(4.0)
    st.tick(25.0)
    assert st.get("A") is None and st.stats.lapsed == 1
    assert not nu.is_let_go(k("a"))
    assert nu.distance(k("a"), 25.0) != pytest.approx(-20.0)       # back to the learned order


def test_expect_refines_the_time_of_a_tool_call():
    st, (nu,) = table("next_use")
    resident(nu, "ab")
    st.apply(SessionHint("A", "continues", (k("a"), k("b")), expected_back_s=100.0), 0.0)
    st.expect("A", [], 12.0, now=2.0)
    assert nu.distance(k("b"), 2.0) == pytest.approx(10.0)
    assert st.stats.returns == 0


@pytest.mark.parametrize("bad", [dict(session_id=""), dict(state="paused"), dict(expected_back_s=-1.0),
                                 dict(ttl_s=math.inf), dict(keys=(b"short",))])
def test_bad_hints_are_invalid_requests(bad):
    args = dict(session_id="A", state="continues", keys=(k("a"),))
    args.update(bad)
    with pytest.raises(InvalidRequest):
        SessionHint(**args)


def envelope(*actions):
    return {"protocol_version": "0.1", "message_id": "m1",
            "actions": [{"action_id": f"a{i}", "action_version": "1.0", **a} for i, a in enumerate(actions)]}


def test_kv_hints_envelope_maps_our_action_and_the_agent_hint_rfc():
    keys = [k("a"), k("b"), k("c")]
    hints, skipped = session_hints(envelope(
        {"action_type": "kvstore.session", "payload": {"session_id": "S", "state": "continues",
                                                       "expected_back_s": 4.5}},
        {"action_type": "agent_hint", "payload": {"session_id": "T", "cache_control": {"type": "ephemeral",
                                                                                     "ttl": 120}}},
        {"action_type": "agent_hint", "payload": {"session_id": "U", "context_management": {
            "edits": [{"type": "evict"}, {"type": "evict", "block_start": 1, "block_end": 3}]}}},
        {"action_type": "kv.fetch", "payload": {}},
    ), keys, time=7.0)
    assert skipped == ["a3"]
    assert hints[0] == SessionHint("S", SessionState.CONTINUES, tuple(keys), 4.5, None, 7.0)
    assert hints[1] == SessionHint("T", SessionState.CONTINUES, tuple(keys), None, 120, 7.0)
    assert hints[2].state == SessionState.FINISHED and hints[2].keys == tuple(keys)
    assert len(hints) == 3                            # the whole context is let go: the range adds nothing
    assert session_hints(None, keys) == ([], [])


def test_an_evict_edit_of_a_block_range_cuts_those_blocks_from_a_continuing_session():
    keys = [k(c) for c in "abcde"]
    hints, _ = session_hints(envelope({"action_type": "agent_hint", "payload": {"session_id": "U", "context_management": {
        "edits": [{"type": "evict", "block_start": 1, "block_end": 3}, {"type": "evict", "block_start": 4}]}}}),
        keys, time=7.0)
    assert hints == [SessionHint("U", SessionState.CONTINUES, (k("a"), k("d")), time=7.0,
                                 dropped=(k("b"), k("c"), k("e")))]
    hints, _ = session_hints(envelope({"action_type": "agent_hint", "payload": {"session_id": "U", "context_management": {
        "edits": [{"type": "evict", "block_start": 0, "block_end": 5}]}}}), keys)
    assert hints[0].state == SessionState.FINISHED and hints[0].keys == tuple(keys)


@pytest.mark.parametrize("env", [{"protocol_version": "9"}, {"protocol_version": "0.1", "actions": {}},
                                 envelope({"action_type": "kvstore.session", "payload": []}),
                                 envelope({"action_type": "agent_hint", "payload": {
                                     "session_id": "U", "context_management": {"edits": [
                                         {"type": "evict", "block_start": 2, "block_end": 9}]}}})])
def test_malformed_envelopes_are_invalid_requests(env):
    with pytest.raises(InvalidRequest):
        session_hints(env, [k("a"), k("b")])


def test_session_hints_through_the_daemon_make_finished_sessions_first_victims(tmp_path):
    """A finished session's blocks go before older blocks of a session that continues."""
    import hashlib

    import numpy as np

    from support.daemon import daemon_config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))
    try:
        def keys(tag, n):
            return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]
        a, b, c_ = keys("a", 3), keys("b", 3), keys("c", 3)
        with KVStoreClient(d.address, timeout=30) as c:
            c.put_from(a, np.zeros((3, 128 << 10), dtype=np.uint8))     # oldest: LRU would evict these first
            c.put_from(b, np.zeros((3, 128 << 10), dtype=np.uint8))
            assert c.session_hint("agent-a", "continues", a, expected_back_s=5.0) > time.time()
            assert c.session_hint("agent-b", "finished", b) == float("inf")
            c.put_from(c_, np.zeros((3, 128 << 10), dtype=np.uint8))   # 9 x 128 KiB > 1 MiB: 1 must go
            assert c.lookup(a).hit_blocks == 3                         # kept: it continues
            assert c.lookup(b).hit_blocks < 3                          # the finished session paid
            with pytest.raises(InvalidRequest, match="expected_back_s"):     # refused before it is sent
                c.session_hint("agent-x", "continues", a, expected_back_s=float("nan"))
    finally:
        d.stop(0)
