"""What the engines still hold, from their KV events: prefetch pages back only the blocks an
engine would load, and pages a block back once its engine drops it (issue 20, item 5)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kvstore.agent.engine_holdings import EngineHoldings, event_hash
from kvstore.agent.prefetch import PrefetchScheduler
from kvstore.common.errors import ConfigError
from kvstore.common.types import BlockMeta
from kvstore.config import loads
from kvstore.config.node import PrefetchConfig
from kvstore.policy import make_policy
from kvstore.store.manager import TierManager
from tiers.base import TierKind
from tiers.null import NullTier

BLOCK = 100
DEADLINE_S = 30.0


def ehash(i: int) -> bytes:
    """A vLLM-style 32-byte block hash."""
    return bytes([i]) * 24 + i.to_bytes(8, "big")


def batch(*events, ts: float = 0.0) -> bytes:
    return msgpack.packb([ts, list(events)])


def stored(*ids, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": [event_hash(ehash(i)) for i in ids], "parent_block_hash": None,
            "token_ids": [], "block_size": 16, "lora_id": None, "medium": medium}


def removed(*ids, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": [event_hash(ehash(i)) for i in ids], "medium": medium}


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {DEADLINE_S} s waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ the event stream


def test_event_hash_is_the_low_64_bits_as_vllm_publishes_them():
    h = bytes(range(32))
    assert event_hash(h) == int.from_bytes(h[-8:], "big") == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert event_hash(-1) == (1 << 64) - 1 and event_hash(5) == 5


def test_stored_removed_cleared_and_media():
    h = EngineHoldings(["tcp://127.0.0.1:1"])
    h.apply(0, 0, batch(stored(1, 2, 3), stored(4, medium="STORAGE")))
    assert [h.holds(ehash(i)) for i in (1, 2, 3, 4)] == [True, True, True, False]   # STORAGE is not its cache
    assert h.holds(b"") is False and h.holds(None) is False
    h.apply(0, 1, batch(removed(2)))
    assert not h.holds(ehash(2)) and h.take_removed() == ([event_hash(ehash(2))], False)
    assert h.take_removed() == ([], False)
    h.apply(0, 2, batch(stored(5, medium="CPU"), stored(5), removed(5)))   # in two of its caches
    assert h.holds(ehash(5))                                             # still in one
    h.apply(0, 3, batch({"type": "AllBlocksCleared"}))
    assert h.held_count() == 0 and h.take_removed() == ([], True)
    assert h.batches == 4 and h.gaps == 0


def test_a_gap_a_restart_or_garbage_never_leaves_a_wrong_held_block():
    h = EngineHoldings(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    h.apply(0, 10, batch(stored(1)))
    h.apply(1, 0, batch(stored(2)))
    h.apply(0, 13, batch(stored(3)))          # batches 11 and 12 were lost: engine 0 is forgotten
    assert h.gaps == 2 and not h.holds(ehash(1)) and h.holds(ehash(3)) and h.holds(ehash(2))
    assert h.take_removed()[1] is True
    h.apply(1, 0, batch(stored(4)))           # engine 1 restarted: what it held before is gone
    assert not h.holds(ehash(2)) and h.holds(ehash(4))
    for junk in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([0, "x"])):
        h.apply(1, 1, junk)
    assert h.malformed == 3 and h.holds(ehash(4))
    h.apply(1, 1, batch(["BlockStored", [event_hash(ehash(6))]], 7, {"type": "BlockStored", "block_hashes": "x"}))
    assert h.holds(ehash(6))                  # vLLM's array form; odd events skipped


def test_endpoints_are_checked():
    with pytest.raises(ValueError, match="scheme://address"):
        EngineHoldings(["localhost:5557"])
    assert loads('[engines]\nkv_events = ["tcp://127.0.0.1:5557", "ipc:///tmp/e.sock"]').engines.kv_events == (
        "tcp://127.0.0.1:5557", "ipc:///tmp/e.sock")
    for bad in ('kv_events = "tcp://127.0.0.1:5557"', 'kv_events = ["http://x"]', 'kv_events = ["tcp://"]',
                'kv_events = ["tcp://a:1", "tcp://a:1"]'):
        with pytest.raises(ConfigError, match="engines.kv_events"):
            loads("[engines]\n" + bad)


def test_over_zmq_and_a_disconnected_engine_is_forgotten(tmp_path):
    endpoint = f"ipc://{tmp_path}/vllm-events.sock"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    h = EngineHoldings([endpoint], topic="vllm")
    h.start()
    try:
        seq = 0

        def send(*events):
            nonlocal seq
            pub.send_multipart([b"vllm", seq.to_bytes(8, "big"), batch(*events)])
            seq += 1
        deadline = time.monotonic() + DEADLINE_S
        while not h.holds(ehash(1)):          # a SUB joins after a while: send until it hears
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            seq = 0
            h.forget(0, "test restart")
            send(stored(1, 2))
            time.sleep(0.05)
        send(removed(1))
        wait_for(lambda: not h.holds(ehash(1)), "the removal")
        assert h.holds(ehash(2))
        pub.close(0)                          # the engine goes away
        wait_for(lambda: not h.holds(ehash(2)), "the disconnected engine to be forgotten")
    finally:
        h.close()
        pub.close(0)


# ------------------------------------------------------------------ prefetch with holdings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def put_meta(m: TierManager, name: str, i: int) -> bytes:
    k = name.encode().ljust(32, b".")
    out = m.begin_put(k, BLOCK, meta=BlockMeta(engine_hash=ehash(i)))
    m.write_chunk(out.pending, 0, bytes(BLOCK))
    m.commit_put(out.pending)
    return k


def make(engines):
    clock = Clock()
    tiers = [NullTier(TierKind.HBM, 4 * BLOCK), NullTier(TierKind.HOST, 1000 * BLOCK)]
    m = TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], clock=clock)
    s = PrefetchScheduler(m, PrefetchConfig(enabled=True, quantile=0.5, lead_time_s=0.1, window=8),
                          clock=clock, measure_bandwidth=False, engines=engines, confidence=0.0)
    for i in range(5):                                      # teach the predictor: "search" takes 10 s
        s.tool_call_start(f"warm-{i}", "search", 1.0, [])
        s.resume(f"warm-{i}", 11.0)
    s.stats.__init__()
    return m, s, clock


@pytest.mark.parametrize("known", [True, False])
def test_page_back_leaves_out_what_the_engine_holds_and_brings_it_once_dropped(known):
    engines = EngineHoldings(["tcp://127.0.0.1:1"]) if known else None
    m, s, clock = make(engines)
    clock.t = 100.0
    t_keys = [put_meta(m, f"t{i}", i) for i in range(4)]
    if known:
        engines.apply(0, 0, batch(stored(0, 1)))           # the engine still has blocks 0 and 1
    s.tool_call_start("T", "search", 100.0, t_keys)          # back at ~110
    clock.t = 101.0
    for i in range(4):
        put_meta(m, f"other{i}", 50 + i)                     # other work pushes T out of HBM
    assert not any(k in m.tiers[0] for k in t_keys)
    clock.t = s.next_due()
    s.tick(clock.t)
    in_hbm = [k in m.tiers[0] for k in t_keys]
    assert in_hbm == ([False, False, True, True] if known else [True] * 4)
    assert s.stats.engine_held_skipped == (2 if known else 0)
    assert s.ready_prefix(t_keys, clock.t + 1.0) == 4        # held or in HBM: nothing to load slowly
    if not known:
        return
    engines.apply(0, 1, batch(removed(1)))                   # the engine drops block 1 while T waits
    s.tick(clock.t + 0.01)
    assert [k in m.tiers[0] for k in t_keys] == [False, True, True, True]
    assert s.stats.engine_drop_page_backs == 1
    assert s.ready_prefix(t_keys, clock.t + 1.0) == 4
    engines.apply(0, 2, batch(removed(0)))
    s.resume("T", clock.t + 0.5)                             # resumed before the next tick
    s.tick(clock.t + 0.6)
    assert t_keys[0] not in m.tiers[0] and s.stats.engine_drop_page_backs == 1   # its wait is over
    assert s.pager.dropped_by_engines() == set()


def test_a_held_block_in_hbm_at_the_page_back_is_watched_and_paged_back_once_dropped():
    """A block the engine holds that is in HBM at the page back is a first victim while the
    engine holds it; when the engine then drops it, it is paged back (it was left out once,
    on the blocks in HBM, and stayed on the slower tier until the resume)."""
    engines = EngineHoldings(["tcp://127.0.0.1:1"])
    m, s, clock = make(engines)
    clock.t = 100.0
    t_keys = [put_meta(m, f"t{i}", i) for i in range(3)]
    engines.apply(0, 0, batch(stored(0, 1, 2)))             # the engine holds all of T
    s.tool_call_start("T", "search", 100.0, t_keys)
    clock.t = s.next_due()
    s.tick(clock.t)
    assert all(k in m.tiers[0] for k in t_keys)              # in HBM at the page back: nothing moved
    clock.t += 0.01
    for i in range(3):
        put_meta(m, f"other{i}", 50 + i)                     # T's copies in HBM go
    assert [k in m.tiers[0] for k in t_keys].count(False) == 2
    engines.apply(0, 1, batch(removed(0, 1, 2)))             # the engine drops T while it waits
    s.tick(clock.t + 0.01)
    assert all(k in m.tiers[0] for k in t_keys)
    assert s.stats.engine_drop_page_backs == 1


def test_a_drop_of_a_block_left_to_the_engine_wakes_the_prefetch_thread():
    """The page back after an engine's drop runs at once, not at the next poll (here 1 h)."""
    engines = EngineHoldings(["tcp://127.0.0.1:1"])
    clock = Clock()
    tiers = [NullTier(TierKind.HBM, 4 * BLOCK), NullTier(TierKind.HOST, 1000 * BLOCK)]
    m = TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], clock=clock)
    s = PrefetchScheduler(m, PrefetchConfig(enabled=True, quantile=0.5, lead_time_s=0.1, window=8),
                          clock=clock, measure_bandwidth=False, engines=engines, confidence=0.0, poll_s=3600.0,
                          refresh_s=3600.0)
    for i in range(5):
        s.tool_call_start(f"warm-{i}", "search", 1.0, [])
        s.resume(f"warm-{i}", 1001.0)                         # "search" takes 1000 s: nothing else due
    clock.t = 10000.0
    t_keys = [put_meta(m, f"t{i}", i) for i in range(2)]
    engines.apply(0, 0, batch(stored(0, 1)))
    for i in range(4):
        put_meta(m, f"other{i}", 50 + i)                     # T leaves HBM
    s.tool_call_start("T", "search", 10000.0 - 1005.0, t_keys)   # its page back is due now
    passes = []
    tick = s.tick
    s.tick = lambda now=None: (passes.append(1), tick(now))
    s.start()
    try:
        wait_for(lambda: s.stats.engine_held_skipped == 2, "the page back that leaves T to the engine")
        time.sleep(0.2)                                      # the thread sleeps its hour now
        n = len(passes)
        engines.apply(0, 1, batch(removed(5)))               # a block no page back left: no wake
        time.sleep(0.2)
        assert len(passes) == n
        engines.apply(0, 2, batch(removed(0)))
        wait_for(lambda: t_keys[0] in m.tiers[0], "the page back after the engine's drop")
        assert s.stats.engine_drop_page_backs == 1 and t_keys[1] not in m.tiers[0]
    finally:
        s.stop()


def held_blocks(enabled: bool = True, **options):
    """An HBM tier of 4 blocks over a host tier (write-through, LRU), a scheduler reading one
    engine's holdings (their clock the test's), and blocks b0..b3 put at t = 0..3."""
    engines = EngineHoldings(["tcp://127.0.0.1:1"])
    clock = Clock()
    engines.clock = clock
    tiers = [NullTier(TierKind.HBM, 4 * BLOCK), NullTier(TierKind.HOST, 1000 * BLOCK)]
    m = TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], clock=clock,
                    write_policy="write_through")
    s = PrefetchScheduler(m, PrefetchConfig(enabled=enabled), clock=clock, measure_bandwidth=False, engines=engines,
                          **options)
    keys = []
    for i in range(4):
        clock.t = float(i)
        keys.append(put_meta(m, f"b{i}", i))
    return engines, clock, m, s, keys


def test_a_clean_block_the_engine_holds_is_the_first_victim_and_never_the_only_copy():
    engines, clock, m, _, keys = held_blocks()
    engines.apply(0, 0, batch(stored(2)))        # the engine holds b2; b0 is the least recently used
    clock.t = 10.0
    new = put_meta(m, "new", 9)
    assert [k in m.tiers[0] for k in keys] == [True, True, False, True] and new in m.tiers[0]
    assert keys[2] in m.tiers[1]                 # its copy below is kept
    clock.t = 11.0
    put_meta(m, "new2", 10)                      # nothing held left: the policy's own victim (b0)
    assert keys[0] not in m.tiers[0] and keys[1] in m.tiers[0]


@pytest.mark.parametrize("exclusive_after_s", [2.0, 0.0])
def test_a_held_block_needed_soon_keeps_its_copy(exclusive_after_s):
    """Of the blocks an engine holds, only those predicted to be used more than
    ``exclusive_after_s`` from now are first victims: an engine short of room may drop one
    needed sooner just before its use (0: every held block, as plain exclusive caching)."""
    engines, clock, m, s, keys = held_blocks()
    predicted = {keys[1]: 0.5, keys[2]: 10.0}              # seconds to the next use
    s.port.distance = lambda key, now: predicted.get(key)
    s.port.evict_engine_held_first(exclusive_after_s, clock)
    engines.apply(0, 0, batch(stored(1), stored(2)))       # the engine holds b1 (needed soon) and b2
    clock.t = 10.0
    put_meta(m, "new", 9)
    soon_kept = exclusive_after_s > 0.5
    assert [k in m.tiers[0] for k in keys] == [True, soon_kept, not soon_kept, True]
    assert keys[1] in m.tiers[1] and keys[2] in m.tiers[1]


def test_a_block_the_engine_has_just_stored_keeps_its_copy():
    """A block an engine announced within the last ``exclusive_after_s`` belongs to a request
    that is running (its agent is back soon): not a first victim until then."""
    engines, clock, m, _, keys = held_blocks(exclusive_after_s=2.0)
    engines.apply(0, 0, batch(stored(1)))                  # long ago
    clock.t = 9.5
    engines.apply(0, 1, batch(stored(2)))                  # just now: its request runs
    assert engines.held_for(ehash(2)) == 0.0 and engines.held_for(ehash(1)) == 6.5
    assert engines.held_for(ehash(3)) is None
    clock.t = 10.0
    put_meta(m, "new", 9)
    assert [k in m.tiers[0] for k in keys] == [True, False, True, True]
    clock.t = 12.0
    put_meta(m, "new2", 10)                                # b2 stored 2.5 s ago: now a first victim
    assert [k in m.tiers[0] for k in keys] == [True, False, False, True]
    engines.apply(0, 2, batch(removed(2)))
    assert engines.held_for(ehash(2)) is None


def test_without_prefetch_the_engines_holdings_change_no_eviction():
    engines, clock, m, _, keys = held_blocks(enabled=False)
    engines.apply(0, 0, batch(stored(2)))
    clock.t = 10.0
    put_meta(m, "new", 9)
    assert [k in m.tiers[0] for k in keys] == [False, True, True, True]     # plain LRU


def test_the_daemon_reads_its_engines_events_from_the_config(tmp_path):
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server
    from support.daemon import daemon_config

    endpoint = f"ipc://{tmp_path}/engine.sock"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    d = start_server(daemon_config(tmp_path, extra={"prefetch": {"enabled": True},
                                                    "engines": {"kv_events": [endpoint], "kv_events_topic": "e"}}))
    try:
        engines = [b for b in d.background if isinstance(b, EngineHoldings)]
        assert len(engines) == 1 and engines[0].endpoints == [endpoint]
        k = b"k" * 32
        with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
            c.put([(k, bytes(4096))], meta=[BlockMeta(engine_hash=ehash(7))])
        port = d.service.hints.port
        deadline = time.monotonic() + DEADLINE_S
        while not port.engine_holds(k):
            assert time.monotonic() < deadline, "the daemon never saw the engine's BlockStored"
            engines[0].forget(0, "test resend")
            pub.send_multipart([b"e", (0).to_bytes(8, "big"), batch(stored(7))])
            time.sleep(0.05)
        assert d.manager.room.redundant is not None
    finally:
        d.stop(0)
        pub.close(0)
    assert not engines[0].running                # stopped with the daemon
