"""The leased read of an engine step served from the daemon's block table (issue 21): an
engine step whose blocks are all in the host arena makes no round trip at all.

:class:`kvstore.client.leased_read.LeasedRead` copies the longest prefix of its keys found
in the block table stage by stage, with no Lookup, Lease or Release (every asking call of
the client is made to fail here), and leases the rest once, after leaving the table (the
lease's promotions may need the space the announced read holds back). After each stage the table must
still vouch for every block copied; a block it no longer vouches for (deleted while the
engine computes a layer, a daemon that stopped) is read again by gRPC from that stage on,
so what is published is always the stored bytes or a miss. Every byte is compared with what
was stored.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.common.errors import StoreUnavailable
from tiers.base import TierKind
from tiers.block_table import READER_SLOTS, supported

from support.store_checks import only_on_nvme, rpcs
from test_arena_control import wait_for
from test_block_table_reads import no_round_trips
from test_leased_read import STAGES, blocks, expected, stage_ranges, start
from kvstore.client.leased_read import ReadStage

pytestmark = pytest.mark.skipif(not supported(), reason="the block table is offered on x86-64 only")


@pytest.fixture
def started(tmp_path):
    """``started(**kw)``: :func:`start` a daemon under ``tmp_path``, stopped after the test."""
    daemons = []

    def make(**kw):
        daemons.append(start(tmp_path, **kw))
        return daemons[-1]
    yield make
    for d in daemons:
        d.stop(0)


def stages_for(n: int) -> tuple[list[ReadStage], list[np.ndarray]]:
    outs = [np.zeros((n, 4096), dtype=np.uint8) for _ in range(STAGES)]
    return [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)], outs


def table_of(c: KVStoreClient):
    return c.arena().table


def test_a_step_found_whole_in_the_table_makes_no_round_trip_and_is_bit_exact(started):
    d = started()
    keys, data = blocks(10, 7)
    short = b"s" * 32
    with KVStoreClient(d.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 10
        c.put([(short, b"\x02" * (2048 + 100))])          # long enough for stage 0's K only
        asked = keys[:4] + [short] + keys[4:]
        assert c.arena() is not None and table_of(c) is not None
        made = no_round_trips(c)
        stages, outs = stages_for(len(asked))
        order: list[tuple[int, list[int]]] = []
        r = c.leased_read(asked, stages)
        r.run(lambda s, sizes: order.append((s, list(sizes))))
        assert made == []
        assert (r.calls, r.leases, r.gets, r.table_blocks) == (0, 0, 0, 11)
        assert [s for s, _ in order] == list(range(STAGES))
        for s, sizes in order:                          # the sizes each stage was published with
            assert sizes == [0 if k == short else 4096 for k in asked]
        real = [i for i, k in enumerate(asked) if k != short]
        for s in range(STAGES):
            assert np.array_equal(outs[s][real], expected(data, s))
        assert r.bytes_copied == 10 * STAGES * 4096
        wait_for(lambda: d.manager.counters.get("table_read_blocks", 0) == 11, "the TOUCH notes (11 blocks)")
        assert len(table_of(c)._free) == READER_SLOTS  # the read left its reader slot


def test_blocks_past_the_table_are_leased_once_promoted_once_with_the_table_left(started):
    """A full arena: the Lease's promotions evict, and the space they free must not wait
    for this read, so no reader slot of the session is announced while the Lease is sent."""
    d = started(host="1MiB", nvme="64MiB")     # 32 blocks of 32 KiB
    keys, data = blocks(16, 8)
    filler, filler_data = blocks(40, 12)
    with KVStoreClient(d.address, shared_memory=True) as c:
        assert c.put_from(keys[8:], data[8:]).stored == 8
        only_on_nvme(d, c, keys[8:])                    # 8-15 on NVMe only
        c.put_from(filler, filler_data)                 # the arena full of other blocks
        assert c.put_from(keys[:8], data[:8]).stored == 8
        d.manager.drain()
        assert c.lookup(keys[:8]).tiers == (TierKind.HOST,) * 8
        promotions = d.manager.counters.get("promotions", 0)
        leases = rpcs(d, "Lease")
        table, lease, announced = table_of(c), c.lease, []

        def watched_lease(*a, **kw):
            announced.append(int(np.count_nonzero(table._reader)))
            return lease(*a, **kw)
        c.lease = watched_lease
        stages, outs = stages_for(16)
        order: list[int] = []
        r = c.leased_read(keys, stages)
        r.run(lambda s, sizes: order.append(s))
        assert (r.table_blocks, r.leases, r.parts, r.gets) == (8, 1, 1, 0)
        assert announced == [0]
        assert rpcs(d, "Lease", leases + 1) - leases == 1
        d.manager.drain()
        assert d.manager.counters.get("promotions", 0) - promotions == 8     # once each, not per stage
        assert order == list(range(STAGES))
        for s in range(STAGES):
            assert r.sizes[s] == [4096] * 16
            assert np.array_equal(outs[s], expected(data, s))


def test_a_block_deleted_while_a_layer_is_computed_is_a_miss_from_then_on_never_wrong_bytes(started):
    d = started()
    keys, data = blocks(8, 9)
    with KVStoreClient(d.address, shared_memory=True) as c, \
            KVStoreClient(d.address, shared_memory=False) as other:
        assert c.put_from(keys, data).stored == 8
        stages, outs = stages_for(8)
        published: list[tuple[int, list[int]]] = []

        def publish(s, sizes):
            published.append((s, list(sizes)))
            if s == 2:                                  # the engine computes layer 2 meanwhile
                assert other.delete([keys[3]]) == 1

        table, get, announced = table_of(c), c.get, []

        def watched_get(*a, **kw):                      # the table is left before the gRPC get
            announced.append(int(np.count_nonzero(table._reader)))
            return get(*a, **kw)
        c.get = watched_get
        r = c.leased_read(keys, stages)
        r.run(publish)
        assert announced == [0]
        assert [s for s, _ in published] == list(range(STAGES))
        for s, sizes in published:
            assert sizes == [4096 if (i != 3 or s <= 2) else 0 for i in range(8)]
            want = expected(data, s)
            for i in range(8):
                if sizes[i]:
                    assert np.array_equal(outs[s][i], want[i]), (s, i)
        # block 3 and the blocks after it, from stage 3 on, by one gRPC get; 0-2 stay in the table
        assert (r.table_blocks, r.leases, r.gets, r.grpc_blocks) == (3, 0, 1, 5)


def test_a_daemon_that_stops_mid_read_publishes_no_later_stage_and_frees_the_reader_slot(started):
    d = started()
    keys, data = blocks(6, 10)
    with KVStoreClient(d.address, shared_memory=True, timeout=3.0) as c:
        assert c.put_from(keys, data).stored == 6
        table = table_of(c)
        stages, outs = stages_for(6)
        published: list[int] = []

        def publish(s, sizes):
            published.append(s)
            if s == 1:
                d.stop(0)                               # its table is marked closed

        r = c.leased_read(keys, stages)
        with pytest.raises(StoreUnavailable):
            r.run(publish)                              # stage 2 on needs the daemon: gone
        assert published == [0, 1]
        for s in published:
            assert np.array_equal(outs[s], expected(data, s))
        assert all(r.sizes[s] == [0] * 6 for s in range(2, STAGES))
        assert len(table._free) == READER_SLOTS


def test_a_cancelled_read_stops_and_frees_the_reader_slot(started):
    d = started()
    keys, data = blocks(4, 11)
    with KVStoreClient(d.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 4
        stages, outs = stages_for(4)
        published: list[int] = []
        r = c.leased_read(keys, stages)
        r.run(lambda s, sizes: published.append(s), cancelled=lambda: len(published) >= 3)
        assert published == [0, 1, 2]
        assert np.array_equal(outs[2], expected(data, 2))
        assert not outs[3].any()
        assert len(table_of(c)._free) == READER_SLOTS


def test_a_read_cancelled_while_it_copies_the_tables_blocks_leases_nothing(started):
    d = started(nvme="64MiB")
    keys, data = blocks(8, 13)
    with KVStoreClient(d.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 8
        only_on_nvme(d, c, keys[4:])                    # 0-3 in the table, 4-7 to lease
        stages, outs = stages_for(8)
        asked: list[int] = []
        r = c.leased_read(keys, stages)
        r.run(lambda s, sizes: None, cancelled=lambda: (asked.append(1), len(asked) > 2)[1])
        assert (r.leases, r.gets) == (0, 0)             # stopped before stage 2: no store call
        assert np.array_equal(outs[1][:4], expected(data, 1)[:4]) and not outs[2].any()
        assert len(table_of(c)._free) == READER_SLOTS
