"""Faults of the cluster seen through two daemons (issue 14's acceptance): the master killed
mid-replay, a peer killed while it serves, a corrupted copy in the cluster. Each costs
remote hits only: every call ends within a deadline, no byte is ever wrong, the daemons
keep serving, and cross-node hits come back once the cluster does. Skips, naming the
missing package, without the Mooncake wheel or libibverbs1."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from support.daemon import CONVERSATION_TRACE
from support.cluster_nodes import Timed, mooncake_master, node_config, stop_all, wait_connected  # noqa: F401

from kvstore.client.client import KVStoreClient
from kvstore.tools.replay import replay
from kvstore.service.startup import start_server

DEADLINE_S = 1.0          # [tiers.remote] timeout_s of these daemons
ALLOWANCE_S = 4.0         # scheduling delay allowed on a loaded 2-core machine
CALL_BOUND_S = 2 * DEADLINE_S + 1.0 + ALLOWANCE_S   # a call meets at most two cluster deadlines, + min_throughput
BLOCK = 64 << 10


def K(p, i):
    return p.to_bytes(4, "big") + i.to_bytes(4, "big") + bytes(24)


def block(p, i):
    return np.random.default_rng(p * 1000 + i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def until(pred, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


_fresh = itertools.count(10**6)


def shares(a, b, n=3) -> bool:
    """True when a new prefix put through client ``a`` now is paged back exact by ``b``."""
    p = next(_fresh)
    keys = [K(p, i) for i in range(n)]
    try:
        a.put([(k, block(p, i)) for i, k in enumerate(keys)])
        got = b.get(keys, stop_at_miss=True)
    except Exception:  # noqa: BLE001 - the cluster is still coming back
        return False
    return [bytes(r.data) if r.found else None for r in got] == [block(p, i) for i in range(n)]


@pytest.fixture
def two_nodes(tmp_path, mooncake_master):
    made = []

    def start(**remote):
        daemons = [start_server(node_config(tmp_path / n, mooncake_master, write="write_through",
                                            timeout_s=DEADLINE_S, **remote)) for n in "ab"]
        made.extend(daemons)
        wait_connected(*daemons)
        return daemons
    yield start
    stop_all(made)


@pytest.mark.slow
@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason=f"trace not found: {CONVERSATION_TRACE}")
def test_master_killed_mid_replay(two_nodes, mooncake_master):
    from kvstore.tools.trace import read_mooncake_trace

    requests = read_mooncake_trace(CONVERSATION_TRACE)[:900]
    daemons = two_nodes()
    raw = [KVStoreClient(d.address, timeout=60) for d in daemons]
    clients = [Timed(c) for c in raw]
    try:
        before = replay(requests[:300], clients, bytes_per_token=1, progress=False)
        assert before.hits_by_tier.get("remote", 0) > 0
        # Phase 2: the master is killed once this phase has made 150 calls.
        calls0 = sum(len(c.seconds) for c in clients)
        problems: list[str] = []
        killed = threading.Event()

        def killer():
            until(lambda: sum(len(c.seconds) for c in clients) >= calls0 + 150, 120)
            mooncake_master.kill()
            killed.set()
            for _ in range(50):
                problems.extend(p for d in daemons for p in d.monitor.problems)
                time.sleep(0.1)
        k = threading.Thread(target=killer)
        k.start()
        marks = [len(c.seconds) for c in clients]
        during = replay(requests[300:600], clients, bytes_per_token=1, progress=False)
        k.join(60)
        assert killed.is_set()
        slowest = max((s for c, m in zip(clients, marks) for _, s in c.seconds[m:]), default=0.0)
        print(f"\nmaster killed mid-replay: slowest call {slowest:.2f}s (bound {CALL_BOUND_S:.1f}s); hit rate "
              f"{before.token_hit_rate:.4f} before, {during.token_hit_rate:.4f} during")
        assert slowest < CALL_BOUND_S
        assert all(d.monitor.serving for d in daemons)                 # local tiers keep serving
        assert any(p.startswith("remote:") for p in problems), problems  # ... and say the cluster is down
        # A new (empty) master on the same ports: the daemons reconnect by themselves.
        t0 = time.monotonic()
        mooncake_master.start()
        assert until(lambda: shares(raw[0], raw[1]), 90)
        print(f"cross-node hits back {time.monotonic() - t0:.1f}s after the master restarted")
        after = replay(requests[600:], clients, bytes_per_token=1, progress=False)
        for rep in (before, during, after):
            assert rep.error == "" and rep.corrupt_blocks == 0
        assert after.hits_by_tier.get("remote", 0) > 0
    finally:
        for c in raw:
            c.close()


@pytest.mark.slow
def test_peer_killed_while_serving(two_nodes, mooncake_master):
    from tiers.mooncake.local_cluster import LocalSegment

    peer = LocalSegment(mooncake_master, 256 << 20).start()
    try:
        a, b = two_nodes(segment=0)                                    # pure clients: the peer holds every copy
        with KVStoreClient(a.address, timeout=60) as ca, KVStoreClient(b.address, timeout=60) as cb:
            prefixes = range(1, 41)
            for p in prefixes:                                         # written through to the peer
                assert ca.put([(K(p, i), block(p, i)) for i in range(4)]).stored == 4
            assert a.manager.counters["remote_published"] == 160
            results, wrong, times = [], [], []
            killed_at = [None]

            def serve():
                for n, p in enumerate(prefixes):
                    if n == 10:
                        peer.kill()                                    # while B is paging blocks in
                        killed_at[0] = n
                    t0 = time.monotonic()
                    got = cb.get([K(p, i) for i in range(4)], stop_at_miss=True)
                    times.append(time.monotonic() - t0)
                    wrong.extend((p, i) for i, r in enumerate(got) if r.found and bytes(r.data) != block(p, i))
                    results.append(sum(r.found for r in got))
            t = threading.Thread(target=serve)
            t.start()
            t.join(300)
            assert not t.is_alive()
            print(f"\npeer killed while serving: slowest get {max(times):.2f}s (bound {CALL_BOUND_S:.1f}s), "
                  f"blocks served per prefix {results}")
            assert wrong == []
            assert max(times) < CALL_BOUND_S
            assert results[:10] == [4] * 10 and sum(results[11:]) == 0   # misses once the peer is gone
            assert b.monitor.serving and cb.stats()["serving"]
            # the master drops the dead peer's segment (client_ttl 3 s): plain misses
            assert until(lambda: cb.lookup([K(40, 0)]).hit_blocks == 0)
            peer = LocalSegment(mooncake_master, 256 << 20).start()     # a new peer brings memory
            assert until(lambda: shares(ca, cb), 90)
    finally:
        peer.kill()


def test_corrupted_remote_copy_is_a_miss_then_repaired(two_nodes, mooncake_master):
    from tiers.mooncake.client import store_class
    from tiers.mooncake.object_format import HEADER_BYTES

    a, b = two_nodes()
    keys = [K(7, i) for i in range(4)]
    raw = store_class()()
    assert raw.setup({"local_hostname": "127.0.0.1", "metadata_server": mooncake_master.metadata_server,
                      "global_segment_size": 0, "local_buffer_size": 16 << 20, "protocol": "tcp",
                      "master_server_addr": mooncake_master.address}) == 0
    try:
        with KVStoreClient(a.address, timeout=60) as ca, KVStoreClient(b.address, timeout=60) as cb:
            assert ca.put([(k, block(7, i)) for i, k in enumerate(keys)]).stored == 4
            name = "kvstore/" + keys[2].hex()
            good = raw.get(name)
            assert len(good) == HEADER_BYTES + BLOCK
            bad = bytearray(good)
            bad[HEADER_BYTES + 1234] ^= 0x40                           # one flipped bit in the payload
            assert raw.remove(name, True) == 0 and raw.put(name, bytes(bad)) == 0
            assert cb.lookup(keys).hit_blocks == 4                     # existence is only a hint
            t0 = time.monotonic()
            got = cb.get(keys, stop_at_miss=True)
            took = time.monotonic() - t0
            print(f"\ncorrupted cluster copy: the get took {took * 1000:.1f} ms (bound {CALL_BOUND_S:.1f} s)")
            assert took < CALL_BOUND_S
            assert [r.found for r in got] == [True, True, False]       # the bad copy is a miss ...
            assert [bytes(r.data) for r in got[:2]] == [block(7, 0), block(7, 1)]
            counters = cb.stats()["counters"]
            assert counters["remote_corrupt_copies"] == 1 and counters["remote_pull_misses"] >= 1
            assert raw.is_exist(name) == 0                             # ... and gone from the cluster
            assert cb.lookup(keys).hit_blocks == 2
            # repaired as a serving engine would: the missed blocks are put again
            assert cb.put([(keys[2], block(7, 2))]).stored == 1
            assert raw.get(name) == good                               # a good copy is back in the cluster
            got = cb.get(keys, stop_at_miss=True)
            assert [bytes(r.data) for r in got] == [block(7, i) for i in range(4)]
    finally:
        raw.close()
