"""Hints never hurt: a "finished" session lets go only of blocks nobody else used.

The reproduction of issue #20: a shared block S and a session's blocks are stored, another
client reads S, the session says it finished, then 40 more blocks are put with a read of S
between every two. S must stay (plain traffic keeps reading it), and a re-put of a
block let go that somebody else uses again must be admitted.
"""

from __future__ import annotations

import hashlib

import pytest

from support.fake_tiers import MemTier

from kvstore.agent.sessions import SessionHint, SessionTable
from kvstore.policy import make_policy
from kvstore.store.manager import TierManager
from tiers.base import TierKind

BLOCK = 100
POLICIES = ("lru", "arc", "s3fifo", "next_use")


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def manager(policy: str, blocks: int = 8):
    tier = MemTier(TierKind.HOST, blocks * BLOCK)
    policies = [make_policy(policy, tier.capacity_bytes, tier_name="host")]
    clock = [0.0]
    m = TierManager([tier], policies, clock=lambda: clock[0], watermarks=(1.0, 1.0))
    return m, SessionTable(policies), clock


def data(i: int = 0) -> bytes:
    return bytes([i % 251]) * BLOCK


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hinted_before", [False, True], ids=["finish-only", "continues-then-finished"])
def test_a_finished_session_does_not_take_a_shared_block_with_it(policy, hinted_before):
    m, table, clock = manager(policy)
    try:
        S = key("S")
        own = [key(f"a{i}") for i in range(3)]
        for i, k in enumerate([S] + own):
            clock[0] += 1.0
            m.put(k, data(i))
        if hinted_before:
            table.apply(SessionHint("A", "continues", tuple([S] + own), expected_back_s=30.0), clock[0])
        clock[0] += 1.0
        assert m.get(S).found                                        # another client reads S
        clock[0] += 1.0
        table.apply(SessionHint("A", "finished", tuple([S] + own)), clock[0])
        p = m.policies[0]
        assert not p.is_let_go(S)                                     # somebody else used it
        assert all(p.is_let_go(k) for k in own)                       # only the session did
        for i in range(40):
            clock[0] += 1.0
            m.put(key(f"x{i}"), data(i))
            clock[0] += 1.0
            assert m.get(S).found, f"S lost after {i + 1} puts"
        assert m.lookup([S]).hit_blocks == 1
        assert not any(m.lookup([k]).hit_blocks for k in own)         # the session's blocks went first
    finally:
        m.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_let_go_comes_back_when_somebody_else_uses_it(policy):
    m, table, clock = manager(policy, blocks=4)
    try:
        ks = [key(f"b{i}") for i in range(3)]
        for i, k in enumerate(ks):
            clock[0] += 1.0
            m.put(k, data(i))
        clock[0] += 1.0
        table.apply(SessionHint("B", "finished", tuple(ks)), clock[0])
        p = m.policies[0]
        assert all(p.is_let_go(k) for k in ks)
        for i in range(4):                                            # fill: the let-go blocks leave
            clock[0] += 1.0
            m.put(key(f"y{i}"), data(i))
        assert not any(m.lookup([k]).hit_blocks for k in ks)
        clock[0] += 10.0                                              # past the session's own last request
        assert m.put(ks[0], data(0)) is True                          # another request puts it again
        assert m.lookup([ks[0]]).hit_blocks == 1 and not p.is_let_go(ks[0])
    finally:
        m.close()


def test_the_finished_sessions_own_last_read_does_not_revive_its_blocks():
    """The hint comes with the session's last request (before its reads, as in
    ``kv_hints``): that request's reads and puts are its own, not another user's."""
    m, table, clock = manager("lru", blocks=4)
    try:
        ks = [key(f"c{i}") for i in range(2)]
        clock[0] += 1.0
        m.put(ks[0], data(0))
        clock[0] += 1.0
        table.apply(SessionHint("C", "finished", tuple(ks)), clock[0])
        assert m.get(ks[0]).found                                     # its own last request: a hit ...
        m.put(ks[1], data(1))                                         # ... and a put of its new block
        p = m.policies[0]
        assert p.is_let_go(ks[0]) and p.is_let_go(ks[1])
        clock[0] += 1.0
        assert m.get(ks[0]).found                                     # somebody else: kept from now on
        assert not p.is_let_go(ks[0]) and p.is_let_go(ks[1])
    finally:
        m.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_reads_of_a_shared_deepest_block_are_not_credited_to_the_session(policy):
    """A first turn whose stored prefix is only the shared block S names [S]; plain traffic
    then reads S 20 times; the session's next turn names [S, a] and later says it finished.
    Those 20 reads are not the session's: S keeps its place, only ``a`` is let go."""
    m, table, clock = manager(policy)
    try:
        S, a = key("S"), key("a")
        clock[0] += 1.0
        m.put(S, data(1))                                             # the session's first turn
        table.apply(SessionHint("A", "continues", (S,), expected_back_s=30.0), clock[0])
        for _ in range(20):                                           # plain traffic
            clock[0] += 1.0
            assert m.get(S).found
        clock[0] += 10.0
        assert m.get(S).found                                         # the session's second turn
        m.put(a, data(2))
        table.apply(SessionHint("A", "continues", (S, a), expected_back_s=30.0), clock[0])
        clock[0] += 10.0
        table.apply(SessionHint("A", "finished", (S, a)), clock[0])
        p = m.policies[0]
        assert not p.is_let_go(S)
        assert p.is_let_go(a)
        for i in range(20):
            clock[0] += 1.0
            m.put(key(f"x{i}"), data(i))
            clock[0] += 1.0
            assert m.get(S).found, f"S lost after {i + 1} puts"
    finally:
        m.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_head_the_session_never_reads_is_not_credited_to_it(policy):
    """An engine whose own cache holds the head X of a session's prefix reads only the tail
    L from the store, turn after turn, and hints [X, L] each turn; plain traffic reads X
    12 times meanwhile. The session explains none of those reads: X keeps its place."""
    m, table, clock = manager(policy)
    try:
        X, L = key("X"), key("L")
        for k in (X, L):
            clock[0] += 1.0
            m.put(k, data(len(k)))
        table.apply(SessionHint("A", "continues", (X, L), expected_back_s=30.0), clock[0])
        for _ in range(12):                                           # plain traffic
            clock[0] += 1.0
            assert m.get(X).found
        for _ in range(12):                                           # the session's turns
            clock[0] += 10.0
            assert m.get(L).found
            table.apply(SessionHint("A", "continues", (X, L), expected_back_s=30.0), clock[0])
        clock[0] += 10.0
        table.apply(SessionHint("A", "finished", (X, L)), clock[0])
        p = m.policies[0]
        assert not p.is_let_go(X)
        assert p.is_let_go(L)
    finally:
        m.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_session_hinting_every_turn_lets_all_its_own_blocks_go(policy):
    """Each turn reads the session's stored prefix, puts one block and names the whole
    prefix: every use of the session's blocks is explained, so all of them go at its end."""
    m, table, clock = manager(policy, blocks=16)
    try:
        own: list[bytes] = []
        for t in range(5):
            clock[0] += 1.0
            for k in own:
                assert m.get(k).found
            own.append(key(f"t{t}"))
            m.put(own[-1], data(t))
            table.apply(SessionHint("T", "continues", tuple(own), expected_back_s=5.0), clock[0])
        clock[0] += 1.0
        table.apply(SessionHint("T", "finished", tuple(own)), clock[0])
        p = m.policies[0]
        assert all(p.is_let_go(k) for k in own)
    finally:
        m.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_an_evict_edit_of_a_range_lets_the_sessions_own_blocks_there_go(policy):
    """A framework cut blocks 1-2 of a session's context (a kv_hints evict edit of that
    range): those the session alone used go first, one another client read keeps its
    place, and the rest of the session keeps its hint."""
    from kvstore.agent.kv_hints import session_hints
    m, table, clock = manager(policy, blocks=16)
    try:
        ks = [key(f"r{i}") for i in range(4)]
        for i, k in enumerate(ks):
            clock[0] += 1.0
            m.put(k, data(i))
        table.apply(SessionHint("R", "continues", tuple(ks), expected_back_s=30.0), clock[0])
        clock[0] += 1.0
        assert m.get(ks[2]).found                                     # another client reads block 2
        clock[0] += 1.0
        for k in ks:                                                  # the session's next request ...
            assert m.get(k).found
        env = {"protocol_version": "0.1", "actions": [{"action_id": "e", "action_type": "agent_hint",
               "action_version": "1.0", "payload": {"session_id": "R", "context_management": {
                   "edits": [{"type": "evict", "block_start": 1, "block_end": 3}]}}}]}
        (hint,), _ = session_hints(env, ks, clock[0])                 # ... cut blocks 1 and 2
        table.apply(hint, clock[0])
        p = m.policies[0]
        assert p.is_let_go(ks[1])
        assert not p.is_let_go(ks[2])                                 # somebody else used it
        assert not p.is_let_go(ks[0]) and not p.is_let_go(ks[3])
        assert table.get("R").keys == (ks[0], ks[3])
        assert table.stats.released_blocks == 1
    finally:
        m.close()


def test_through_the_daemon_a_finished_session_keeps_the_shared_block(tmp_path):
    import numpy as np

    from support.daemon import daemon_config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))   # 8 blocks of 128 KiB
    try:
        block = np.zeros((1, 128 << 10), dtype=np.uint8)
        S = key("daemon-S")
        own = [key(f"daemon-a{i}") for i in range(3)]
        with KVStoreClient(d.address, timeout=30) as session, KVStoreClient(d.address, timeout=30) as other:
            session.put_from([S] + own, np.zeros((4, 128 << 10), dtype=np.uint8))
            assert len(other.get([S])) == 1                                # another client reads S
            assert session.session_hint("agent-a", "finished", [S] + own) == float("inf")
            for i in range(40):
                other.put_from([key(f"daemon-x{i}")], block)
                assert other.lookup([S]).hit_blocks == 1, f"S lost after {i + 1} puts"
                other.get([S])
            assert session.lookup(own[:1]).hit_blocks == 0               # the session's blocks went
    finally:
        d.stop(0)
