"""The store core's cluster level (kvstore/cluster/cluster.py) over an in-memory cluster: lookups
that ask the cluster, page-in into the host arena, demotion and publishing to the
cluster, and the failure rules (a dead, stalled or corrupting cluster costs only remote
hits and never fails or delays a local put or get beyond its deadline)."""

import threading
import time

import numpy as np
import pytest

from support.fake_cluster import FakeCluster, FakeRemoteTier
from support.fake_tiers import MemTier

from kvstore.store.manager import TierManager
from tiers.host import HostTier
from kvstore.policy import make_policy
from kvstore.cluster.cluster import ClusterOptions
from tiers.base import TierKind

BLOCK = 128
made = []


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i, n=BLOCK):
    return bytes([i % 251]) * n


@pytest.fixture
def cluster():
    yield FakeCluster(timeout_s=0.5)
    for m in made:
        m.close()
    made.clear()


def node(cluster, host_blocks=100, nvme_blocks=None, remote_blocks=1000, publish="demoted", write="write_back",
         async_moves=True, lookup_timeout_s=0.3):
    """A store with a shared host arena, an optional NVMe tier and the cluster, last."""
    tiers = [HostTier(host_blocks * BLOCK, pinned=False, shared=True)]
    if nvme_blocks:
        tiers.append(MemTier(TierKind.NVME, nvme_blocks * BLOCK))
    tiers.append(FakeRemoteTier(cluster, remote_blocks * BLOCK))
    policies = [make_policy("lru", t.capacity_bytes) for t in tiers]
    m = TierManager(tiers, policies, write_policy=write, async_moves=async_moves, watermarks=(1.0, 1.0),
                    cluster=ClusterOptions(publish=publish, lookup_timeout_s=lookup_timeout_s))
    made.append(m)
    return m


def wait_until(pred, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_remote_tier_must_be_last(cluster):
    tiers = [FakeRemoteTier(cluster), MemTier(TierKind.HOST, 1000, host=True)]
    with pytest.raises(ValueError, match="last tier"):
        TierManager(tiers, [make_policy("lru", 1000) for _ in tiers])


def test_a_prefix_put_on_one_node_is_found_and_paged_in_on_another(cluster):
    a, b = node(cluster, publish="all"), node(cluster)
    for i in range(5):
        a.put(K(i), payload(i))
    assert a.cluster.wait_published()
    assert a.counters["remote_published"] == 5 and len(cluster.objects) == 5
    res = b.lookup([K(i) for i in range(7)])
    assert res.hit_blocks == 5 and res.tiers == (TierKind.REMOTE,) * 5
    assert b.counters["remote_lookups"] == 1 and b.counters["remote_lookup_hit_blocks"] == 5
    got = list(b.get_many([K(i) for i in range(7)], stop_at_miss=True))
    assert [bytes(r.data) for r in got[:5]] == [payload(i) for i in range(5)] and not got[5].found
    assert b.counters["remote_pulled_blocks"] == 5 and b.counters["remote_pulled_bytes"] == 5 * BLOCK
    assert b.tier_of(K(0)) is TierKind.HOST                       # paged into the arena, committed there
    assert b.lookup([K(i) for i in range(5)]).tiers == (TierKind.HOST,) * 5
    calls = b.tiers[-1].calls
    assert bytes(b.get(K(3)).data) == payload(3) and b.tiers[-1].calls == calls   # a local hit: no call


def test_lookup_mixes_local_and_cluster_blocks_in_one_call(cluster):
    a, b = node(cluster, publish="all"), node(cluster)
    a.put(K(1), payload(1))
    assert a.cluster.wait_published()
    b.put(K(0), payload(0))
    b.put(K(2), payload(2))
    calls = b.tiers[-1].calls
    res = b.lookup([K(0), K(1), K(2), K(3)])
    assert res.tiers == (TierKind.HOST, TierKind.REMOTE, TierKind.HOST)
    assert b.tiers[-1].calls == calls + 1
    assert b.lookup([K(0)]).hit_blocks == 1 and b.tiers[-1].calls == calls + 1   # all local: no call


def test_demotion_from_the_last_local_tier_goes_to_the_cluster(cluster):
    a, b = node(cluster, host_blocks=4, nvme_blocks=4), node(cluster)
    for i in range(12):
        a.put(K(i), payload(i))
    a.drain()
    assert a.counters["demotions"] >= 8 and a.counters["blocks_dropped"] == 0
    assert a.tier_of(K(0)) is TierKind.REMOTE and set(cluster.objects) == {K(i) for i in range(4)}
    assert bytes(a.get(K(0)).data) == payload(0)                  # paged back into the arena
    assert a.tier_of(K(0)) is TierKind.HOST
    assert b.lookup([K(i) for i in range(4)]).hit_blocks == 4     # the others see what A demoted


def test_publish_demoted_keeps_puts_local(cluster):
    a = node(cluster)
    a.put(K(1), payload(1))
    a.drain()
    assert cluster.objects == {} and a.counters["remote_published"] == 0


def test_write_through_acknowledges_once_the_cluster_holds_the_block(cluster):
    a, b = node(cluster, write="write_through"), node(cluster)
    a.put(K(1), payload(1))
    assert K(1) in cluster.objects                                # before put() returned
    assert b.lookup([K(1)]).hit_blocks == 1


def test_a_put_never_goes_straight_to_the_cluster(cluster):
    from kvstore.common.errors import TierFull

    a = node(cluster, host_blocks=1)
    a.put(K(0), payload(0))
    with a.reader(K(0)):                                          # pinned: the arena cannot make room
        with pytest.raises(TierFull):
            a.put(K(1), payload(1))
    assert K(1) not in cluster.objects


def test_a_lease_pages_cluster_blocks_into_the_arena(cluster):
    a, b = node(cluster, publish="all"), node(cluster)
    for i in range(3):
        a.put(K(i), payload(i))
    assert a.cluster.wait_published()
    grant = b.lease([K(i) for i in range(4)], ttl_s=10)
    assert [blk.found for blk in grant.blocks] == [True, True, True, False]
    host = b.tiers[0]
    for i, blk in enumerate(grant.blocks[:3]):
        assert blk.tier is TierKind.HOST and bytes(host.view(K(i))) == payload(i)
    b.release(grant.lease_id)


def test_concurrent_page_ins_of_one_prefix_fetch_it_once(cluster):
    a, b = node(cluster, publish="all"), node(cluster)
    for i in range(20):
        a.put(K(i), payload(i))
    assert a.cluster.wait_published()
    keys = [K(i) for i in range(20)]
    results = []

    def rank():
        results.append([bytes(r.data) for r in b.get_many(keys, stop_at_miss=True)])
    threads = [threading.Thread(target=rank) for _ in range(4)]       # four TP ranks
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [[payload(i) for i in range(20)]] * 4
    assert b.counters["remote_pulled_blocks"] == 20


def test_a_corrupt_cluster_copy_is_a_miss_never_wrong_bytes(cluster):
    a, b = node(cluster, publish="all"), node(cluster)
    a.put(K(1), payload(1))
    assert a.cluster.wait_published()
    cluster.corrupt.add(K(1))
    assert b.lookup([K(1)]).hit_blocks == 1                       # existence is only a hint ...
    r = b.get(K(1))
    assert not r.found                                            # ... the get verifies
    assert b.counters["remote_pull_misses"] == 1 and K(1) not in cluster.objects
    assert b.lookup([K(1)]).hit_blocks == 0
    assert b.put(K(1), payload(1)) is True                        # recovery: stored again


def test_dead_cluster_costs_only_remote_hits(cluster):
    a, b = node(cluster, host_blocks=4, publish="all"), node(cluster)
    a.put(K(0), payload(0))
    assert a.cluster.wait_published()
    cluster.down = True
    t0 = time.monotonic()
    for i in range(1, 12):                                        # demotions fail: the blocks are dropped
        assert a.put(K(i), payload(i)) is True
    assert a.cluster.wait_published()
    assert bytes(a.get(K(11)).data) == payload(11)
    res = b.lookup([K(0), K(1)])
    assert res.hit_blocks == 0 and b.counters["remote_lookup_failures"] == 1
    assert not b.get(K(0)).found and b.counters["remote_pull_failures"] >= 1
    assert time.monotonic() - t0 < 10
    assert a.counters["demotions_failed"] >= 1 and a.counters["remote_publish_failed"] >= 1
    assert b.tiers[-1].problem()
    cluster.down = False                                          # recovery
    a.put(K(50), payload(50))
    assert a.cluster.wait_published()
    assert b.lookup([K(50)]).hit_blocks == 1 and bytes(b.get(K(50)).data) == payload(50)


def test_stalled_cluster_answers_lookups_within_their_deadline(cluster):
    a, b = node(cluster, publish="all"), node(cluster, lookup_timeout_s=0.2)
    a.put(K(1), payload(1))
    assert a.cluster.wait_published()
    b.put(K(0), payload(0))
    cluster.stall_s = 5.0
    t0 = time.monotonic()
    res = b.lookup([K(0), K(1)])
    took = time.monotonic() - t0
    assert res.hit_blocks == 1 and res.tiers == (TierKind.HOST,)
    assert 0.15 < took < 3.0
    t0 = time.monotonic()
    assert b.put(K(2), payload(2)) is True and bytes(b.get(K(0)).data) == payload(0)
    assert time.monotonic() - t0 < 0.5                            # local puts and hits do not wait


def test_persist_on_stop_does_not_push_blocks_to_the_cluster(cluster):
    a = node(cluster)
    a.put(K(1), payload(1))
    assert a.persist(timeout=5) == 0 and cluster.objects == {}


def test_page_in_without_room_in_the_arena_is_a_miss(cluster):
    a, b = node(cluster, publish="all"), node(cluster, host_blocks=1)
    a.put(K(1), payload(1))
    a.put(K(2), payload(2))
    assert a.cluster.wait_published()
    b.put(K(0), payload(0))
    with b.reader(K(0)):                                          # the arena's only block is pinned
        assert not b.get(K(1)).found
    assert bytes(b.get(K(2)).data) == payload(2)


def test_get_stream_reports_paged_in_blocks_as_remote(cluster):
    from kvstore.service.get_stream import GetPlan, pieces

    a, b = node(cluster, publish="all"), node(cluster)
    a.put(K(1), payload(1, 3000))
    assert a.cluster.wait_published()
    b.put(K(0), payload(0, 3000))
    plan = GetPlan(b, [K(0), K(1), K(2)], lambda k: k, None, True, 1024, 1 << 20)
    got = list(pieces(plan))
    tiers = [(p.key, p.tier) for p in got if p.total]
    assert {t for k, t in tiers if k == K(0)} == {int(TierKind.HOST)}
    assert {t for k, t in tiers if k == K(1)} == {int(TierKind.REMOTE)}
    data = b"".join(np.asarray(p.data).tobytes() for p in got if p.key == K(1))
    assert data == payload(1, 3000) and b.tiers[-1].calls <= 3    # sizes + one batch get (+ lookup-free)


def test_prefetch_pages_a_waiting_trajectory_in_from_the_cluster(cluster):
    from kvstore.config.node import PrefetchConfig
    from kvstore.agent.page_back import DEFAULT_HOP_BANDWIDTH
    from kvstore.agent.prefetch import PrefetchScheduler

    a, b = node(cluster, publish="all"), node(cluster)
    keys = [K(i) for i in range(6)]
    for i, k in enumerate(keys):
        a.put(k, payload(i))
    assert a.cluster.wait_published()
    now = [1000.0]
    sched = PrefetchScheduler(b, PrefetchConfig(enabled=True), clock=lambda: now[0], confidence=0.0)   # no tool history
    sched.tool_call_start("t1", "search", now[0], keys)     # the trajectory ran on node A
    now[0] += 5.0                                             # past its promotion time, before its expiry
    sched.tick()
    assert wait_until(lambda: all(b.tier_of(k) is TierKind.HOST for k in keys))
    assert [bytes(b.get(k).data) for k in keys] == [payload(i) for i in range(6)]
    assert b.counters["remote_pulled_blocks"] == 6
    hop = (TierKind.REMOTE, TierKind.HOST)
    assert wait_until(lambda: sched.bandwidth[hop] != DEFAULT_HOP_BANDWIDTH[hop])   # measured
