"""The same-node read without gRPC (issue 21): Lookup, Lease and Release as control frames
on the arena session, their results, and the fallbacks to gRPC.

A mapped client of a daemon that serves control frames makes no gRPC call on a lookup +
get_into (the stub's Lookup, Lease and Release are replaced by failures here); its answers
are the gRPC path's. A daemon that does not know hello version 3, or serves no control
frames, is used through gRPC; a channel busy with another thread's call, or a call whose
answer comes after its deadline, costs a gRPC call or a StoreUnavailable, never a wrong
block or a stuck lease.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvstore.client import arena as client_arena
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import StoreUnavailable
from kvstore.service import arena_server
from kvstore.service.startup import start_server
from support.daemon import daemon_config
from tiers.base import TierKind

BLOCK = 32 << 10
DEADLINE_S = 30.0


def key(i: int, tag: str = "c") -> bytes:
    return (f"{tag}:{i}:".encode() * 32)[:32]


def payloads(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def wait_for(condition, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def forbid_grpc(c: KVStoreClient, *names: str) -> None:
    """Make the client's gRPC calls ``names`` fail the test (the data path must not use them)."""
    stub = c._connection.stub

    def forbidden(name):
        def call(*a, **kw):
            raise AssertionError(f"gRPC {name} called on the same-node hot path")
        return call
    for name in names:
        setattr(stub, name, forbidden(name))


def arena_server_of(d) -> arena_server.ArenaServer:
    return next(b for b in d.background if isinstance(b, arena_server.ArenaServer))


@pytest.fixture(autouse=True)
def frames_only(monkeypatch):
    """These tests are of the control frames: clients here read no block table (its reads:
    ``tests/kvstore/test_block_table_reads.py``)."""
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")



@pytest.fixture
def d(tmp_path):
    daemon = start_server(daemon_config(tmp_path, host="16MiB", nvme=None))
    yield daemon
    daemon.stop(0)


def test_lookup_and_get_into_make_no_grpc_call_and_match_the_grpc_path(d):
    data = payloads(40)
    keys = [key(i) for i in range(40)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as g:
        c.put_from(keys[:32], data[:32])
        assert c.arena().control is not None                    # the daemon serves control frames
        forbid_grpc(c, "Lookup", "Lease", "Release")
        asked = keys[:30] + [key(99, "miss")] + keys[31:32]
        assert c.lookup(asked) == g.lookup(asked)
        assert c.lookup(asked).hit_blocks == 30 and c.lookup(asked).tiers[0] == TierKind.HOST
        assert c.lookup([]).hit_blocks == 0
        out, ref = np.zeros((32, BLOCK), np.uint8), np.zeros((32, BLOCK), np.uint8)
        got, want = c.get_into(asked, out), g.get_into(asked, ref)
        assert (got.found, got.sizes, got.tier_codes) == (want.found, want.sizes, want.tier_codes) == \
            (30, [BLOCK] * 30 + [0, 0], bytes([TierKind.HOST] * 30 + [0, 0]))
        assert np.array_equal(out[:30], data[:30]) and not out[30:].any()
        got = c.get_into(asked, out, stop_at_miss=False)          # every hit, the miss skipped
        assert got.found == 31 and np.array_equal(out[31], data[31])
        ranges = [(0, 100), (BLOCK - 50, 50)]
        small = [np.zeros(150, np.uint8) for _ in range(3)]
        r = c.get_into(keys[:3], small, ranges=ranges)
        assert r.found == 3 and all(np.array_equal(small[i], np.concatenate([data[i][:100], data[i][-50:]]))
                                    for i in range(3))
        sized = np.zeros(32 * BLOCK + 7, np.uint8)                # slots of BLOCK bytes and a tail
        assert c.get_into(keys[:32], sized, offsets=[i * BLOCK for i in range(32)]).found == 32
        assert np.array_equal(sized[:32 * BLOCK].reshape(32, BLOCK), data[:32])
        wait_for(lambda: d.manager.catalogue.num_leases == 0, "the background releases (control frames)")
    counters = d.manager.counters
    assert counters["leases_granted"] >= 4 and counters.get("leases_expired", 0) == 0


def test_lease_and_release_of_the_client_go_on_the_session(d):
    data = payloads(4, seed=1)
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from([key(i) for i in range(4)], data)
        arena = c.arena()
        forbid_grpc(c, "Lease", "Release")
        reply = c.lease([key(i) for i in range(4)] + [key(9, "m")], ttl_s=20.0)
        assert reply.lease_id and reply.complete and reply.ttl_seconds == 20.0
        assert list(reply.tier_codes) == [TierKind.HOST] * 4 + [0]
        for i, (off, size) in enumerate(zip(reply.offsets[:4], reply.sizes[:4])):
            assert size == BLOCK and np.array_equal(arena.array[off:off + size], data[i])
        assert d.manager.catalogue.num_leases == 1
        assert c.release([reply.lease_id, "not-a-lease-id"]) == 1
        assert c.release([reply.lease_id]) == 0                  # released once
        assert d.manager.catalogue.num_leases == 0
        budget = c.lease([key(i) for i in range(4)], max_bytes=BLOCK)   # the budget stops the grant
        assert not budget.complete and budget.resume_at == 1
        c.release([budget.lease_id])


def test_a_daemon_that_does_not_know_version_3_is_used_through_grpc(tmp_path, monkeypatch):
    monkeypatch.setattr(arena_server, "HELLO_CONTROL", b"KVSTORE-ARENA 9 ")   # an older daemon
    old = start_server(daemon_config(tmp_path, host="16MiB", nvme=None))
    try:
        with KVStoreClient(old.address, timeout=DEADLINE_S) as c:
            c.put_from([key(i) for i in range(8)], payloads(8))
            arena = c.arena()
            assert arena.session and arena.control is None        # version 2: a session, no frames
            out = np.zeros((8, BLOCK), np.uint8)
            assert c.lookup([key(i) for i in range(8)]).hit_blocks == 8
            assert c.get_into([key(i) for i in range(8)], out).found == 8
            assert np.array_equal(out, payloads(8))
        assert arena_server_of(old).refused >= 1                  # the version-3 hello it did not know
    finally:
        old.stop(0)


def test_a_daemon_serving_no_control_frames_is_used_through_grpc(d):
    arena_server_of(d).control = None                             # answers "control 0"
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from([key(i) for i in range(8)], payloads(8))
        assert c.arena().session and c.arena().control is None
        out = np.zeros((8, BLOCK), np.uint8)
        assert c.get_into([key(i) for i in range(8)], out).found == 8 and np.array_equal(out, payloads(8))
        lease = c.lease([key(0)])
        assert lease.lease_id and c.release([lease.lease_id]) == 1


def test_a_busy_channel_sends_the_other_threads_call_by_grpc(d):
    c = KVStoreClient(d.address, timeout=DEADLINE_S)
    keys = [key(i) for i in range(8)]
    c.put_from(keys, payloads(8))
    control = arena_server_of(d).control
    entered, go = threading.Event(), threading.Event()
    answer = control.answer

    def held_answer(frame, *a):
        entered.set()
        assert go.wait(DEADLINE_S)
        return answer(frame, *a)
    control.answer = held_answer
    out = np.zeros((8, BLOCK), np.uint8)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("get", c.get_into(keys, out)))
    t.start()
    try:
        assert entered.wait(DEADLINE_S)                           # the channel waits for that answer
        assert c.lookup(keys).hit_blocks == 8                    # meanwhile: by gRPC, same answer
        other = np.zeros((8, BLOCK), np.uint8)
        control.answer = answer
        assert c.get_into(keys, other).found == 8 and np.array_equal(other, payloads(8))
    finally:
        go.set()
        t.join(DEADLINE_S)
    assert results["get"].found == 8 and np.array_equal(out, payloads(8))
    c.close()
    wait_for(lambda: d.manager.catalogue.num_leases == 0, "every lease to end with the client")


def answer_next_frame_late(d) -> threading.Event:
    """Make the daemon answer its next control frame only once the returned event is set
    (the frames after it as usual)."""
    control = arena_server_of(d).control
    gave_up = threading.Event()
    answer = control.answer

    def late_answer(frame, *a):
        control.answer = answer                                   # only the first frame is late
        assert gave_up.wait(DEADLINE_S)
        return answer(frame, *a)
    control.answer = late_answer
    return gave_up


def test_an_answer_after_the_deadline_is_skipped_and_its_lease_released(d):
    c = KVStoreClient(d.address, timeout=DEADLINE_S)
    keys = [key(i) for i in range(8)]
    c.put_from(keys, payloads(8))
    c.arena()
    gave_up = answer_next_frame_late(d)
    c.timeout = 0.5
    with pytest.raises(StoreUnavailable, match="did not answer"):
        c.get_into(keys, np.zeros((8, BLOCK), np.uint8))
    gave_up.set()
    wait_for(lambda: d.manager.catalogue.num_leases == 1, "the late lease to be granted")
    c.timeout = DEADLINE_S
    out = np.zeros((8, BLOCK), np.uint8)
    assert c.get_into(keys, out).found == 8 and np.array_equal(out, payloads(8))
    assert c.arena().control.usable()                             # the channel is still in step
    wait_for(lambda: d.manager.catalogue.num_leases == 0, "the late lease and the new one to be released")
    c.close()


def test_a_restarted_daemon_is_never_read_through_the_old_session(tmp_path):
    cfg = daemon_config(tmp_path, host="16MiB", nvme=None)
    first = start_server(cfg)
    c = KVStoreClient(first.address, timeout=DEADLINE_S)
    try:
        keys = [key(i) for i in range(8)]
        c.put_from(keys, payloads(8, seed=1))
        old = c.arena()
        lease = c.lease(keys[:2])
        assert lease.lease_id and old.control is not None
        first.stop(0)
        second = start_server(cfg)                                # the same socket, a new arena
        try:
            with KVStoreClient(second.address, shared_memory=False) as g:
                g.put([(k, payloads(8, seed=2)[i]) for i, k in enumerate(keys)])
            with pytest.raises(client_arena.ArenaChanged):
                c.lease(keys)                                     # the old session ended with its daemon
            out = np.zeros((8, BLOCK), np.uint8)
            r = c.get_into(keys, out)                             # maps the new arena
            assert r.found == 8 and np.array_equal(out, payloads(8, seed=2))
            new = c.arena()
            assert new is not old and new.identity != old.identity and new.control is not None
            assert c.lookup(keys).hit_blocks == 8
        finally:
            c.close()
            second.stop(0)
    finally:
        first.stop(0)
