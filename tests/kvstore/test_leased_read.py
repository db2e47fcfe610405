"""The leased read of an engine step (:mod:`kvstore.client.leased_read`): many byte ranges of
the same blocks for one store round trip, each block leased once.

Round trips are counted at the daemon (its ``kvstore:request_seconds`` histogram counts
every RPC by method), promotions by its ``promotions`` counter, and every byte read is
compared with what was stored. A stall of the client is simulated by its clock jumping.
The block table is off here (every block leased); reads from it: ``test_leased_read_table.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import leased_read as leased_mod
from kvstore.client.arena import ArenaChanged
from kvstore.client.client import KVStoreClient
from kvstore.client.leased_read import LeasedRead, ReadStage
from kvstore.common.errors import InvalidRequest, StoreUnavailable
from kvstore.service.startup import start_server
from support.daemon import daemon_config
from support.store_checks import only_on_nvme, rpcs

BLOCK = 32 << 10
STAGES = 8                                  # 8 stages of 4 KiB: two 2 KiB ranges each, far apart
HALF = BLOCK // 2


def stage_ranges(s: int) -> list[tuple[int, int]]:
    """Stage ``s``: 2 KiB at ``s * 2 KiB`` and 2 KiB at ``HALF + s * 2 KiB`` (as a layer's K and V)."""
    return [(s * 2048, 2048), (HALF + s * 2048, 2048)]


def expected(data: np.ndarray, s: int) -> np.ndarray:
    return np.concatenate([data[:, o:o + n] for o, n in stage_ranges(s)], axis=1)


def start(tmp_path, host: str = "16MiB", nvme: str | None = None):
    return start_server(daemon_config(tmp_path, host=host, nvme=nvme, extra={"metrics": {"listen": "127.0.0.1:0"}}))


def blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(n)], rng.integers(0, 256, (n, BLOCK), dtype=np.uint8)


def read(c, keys, **kw) -> tuple[LeasedRead, list[np.ndarray], list[int]]:
    """A leased read of every stage of ``keys``; returns it, the stages' outputs, the publish order."""
    outs = [np.zeros((len(keys), 4096), dtype=np.uint8) for _ in range(STAGES)]
    order: list[int] = []
    r = c.leased_read(keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
    r.run(lambda s, sizes: order.append(s), **kw)
    return r, outs, order


@pytest.fixture(autouse=True)
def leases_only(monkeypatch):
    """Every block leased: leases are what these tests count (blocks in the daemon's block
    table take none: ``test_leased_read_table.py``)."""
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")


@pytest.fixture
def daemon(tmp_path):
    d = start(tmp_path)
    yield d
    d.stop(0)


def test_every_stage_of_every_block_in_one_lease_bit_exact(daemon):
    keys, data = blocks(12, 1)
    missing, short = b"m" * 32, b"s" * 32
    with KVStoreClient(daemon.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 12
        c.put([(short, b"\x01" * (HALF + 100))])               # long enough for stage 0's K only
        asked = keys[:5] + [missing, short] + keys[5:]
        before = {m: rpcs(daemon, m) for m in ("Lease", "GetRaw")}
        r, outs, order = read(c, asked)
        assert (rpcs(daemon, "Lease", before["Lease"] + 1) - before["Lease"], rpcs(daemon, "GetRaw") - before["GetRaw"]) == (1, 0)
    assert (r.leases, r.gets, r.parts, r.calls) == (1, 0, 1, 1)
    assert order == list(range(STAGES))
    hit = [i for i, k in enumerate(asked) if k not in (missing, short)]
    for s in range(STAGES):
        assert r.sizes[s] == [4096 if i in hit else 0 for i in range(len(asked))]
        assert np.array_equal(outs[s][hit], expected(data, s))
        assert not outs[s][[5, 6]].any()                     # a miss and a short block: nothing copied
    assert r.bytes_copied == 12 * STAGES * 4096


def test_a_read_larger_than_one_lease_goes_in_parts_and_promotes_each_nvme_block_once(tmp_path):
    d = start(tmp_path, host="1MiB", nvme="64MiB")        # a lease holds at most 256 KiB: 8 blocks
    try:
        keys, data = blocks(40, 2)                        # 1.25 MiB: more than the whole host tier
        with KVStoreClient(d.address, shared_memory=True) as c:
            assert c.put_from(keys, data).stored == 40
            only_on_nvme(d, c, keys)
            promotions = d.manager.counters.snapshot().get("promotions", 0)
            leases = rpcs(d, "Lease")
            r, outs, order = read(c, keys)
            d.manager.drain()
            assert d.manager.counters.snapshot().get("promotions", 0) - promotions == 40
            assert rpcs(d, "Lease", leases + 5) - leases == r.leases == r.parts == 5     # 40 blocks, 8 a lease
            assert (r.gets, r.releases) == (0, 4)                            # a Release between parts
        assert order == list(range(STAGES))
        for s in range(STAGES):
            assert r.sizes[s] == [4096] * 40 and np.array_equal(outs[s], expected(data, s))
    finally:
        d.stop(0)


def test_without_an_arena_every_stage_goes_in_one_grpc_get(daemon):
    keys, data = blocks(6, 3)
    with KVStoreClient(daemon.address, shared_memory=False) as c:
        assert c.put_from(keys, data).stored == 6
        asked = keys[:2] + [b"m" * 32] + keys[2:]
        before = {m: rpcs(daemon, m) for m in ("Lease", "GetRaw")}
        r, outs, order = read(c, asked)
        assert (rpcs(daemon, "Lease") - before["Lease"], rpcs(daemon, "GetRaw", before["GetRaw"] + 1) - before["GetRaw"]) == (0, 1)
    assert (r.leases, r.gets, r.grpc_blocks) == (0, 1, 7) and order == list(range(STAGES))
    for s in range(STAGES):
        assert r.sizes[s][2] == 0 and np.array_equal(np.delete(outs[s], 2, axis=0), expected(data, s))


class JumpingClock:
    """Real time, plus an hour from the ``after``-th reading on (a client that stalled)."""

    def __init__(self, after: int):
        self.after, self.readings = after, 0

    def __call__(self) -> float:
        self.readings += 1
        return leased_mod.time.monotonic() + (3600.0 if self.readings > self.after else 0.0)


def test_stages_copied_after_the_lease_grew_too_old_are_read_again_by_grpc(daemon, monkeypatch):
    keys, data = blocks(6, 4)
    with KVStoreClient(daemon.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 6
        # readings: the Lease sent, stage 0 copied (in time), stage 1 copied (an hour later)
        monkeypatch.setattr(leased_mod, "_clock", JumpingClock(after=2))
        published: list[tuple[int, list[int]]] = []
        outs = [np.zeros((6, 4096), dtype=np.uint8) for _ in range(STAGES)]
        r = c.leased_read(keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
        r.run(lambda s, sizes: published.append((s, list(sizes))))
    assert (r.leases, r.gets, r.grpc_blocks) == (1, 1, 6)     # stages 1-7 of every block in one Get
    assert [s for s, _ in published] == list(range(STAGES))
    for s in range(STAGES):
        assert published[s][1] == [4096] * 6 and np.array_equal(outs[s], expected(data, s))


class Wrapped:
    """The real client with its ``lease`` replaced by ``lease(client, *args, **kw)``."""

    def __init__(self, client, lease):
        self.client, self._lease = client, lease

    def lease(self, *args, **kw):
        return self._lease(self.client, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_an_arena_that_grants_nothing_sends_the_rest_by_grpc(daemon):
    keys, data = blocks(6, 5)
    with KVStoreClient(daemon.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 6
        busy = Wrapped(c, lambda client, keys, **kw: pb.LeaseReply(resume_at=0, complete=False))
        outs = [np.zeros((6, 4096), dtype=np.uint8) for _ in range(STAGES)]
        r = LeasedRead(busy, keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
        r.run()
    assert (r.leases, r.gets, r.grpc_blocks) == (1, 1, 6)
    assert all(np.array_equal(outs[s], expected(data, s)) for s in range(STAGES))


def test_a_daemon_serving_a_new_arena_is_read_from_it(daemon):
    keys, data = blocks(6, 6)
    with KVStoreClient(daemon.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 6
        changed = []

        def lease(client, *args, **kw):
            if not changed:
                changed.append(1)
                raise ArenaChanged("the daemon serves another arena")
            return client.lease(*args, **kw)
        outs = [np.zeros((6, 4096), dtype=np.uint8) for _ in range(STAGES)]
        r = LeasedRead(Wrapped(c, lease), keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
        r.run()
    assert (r.leases, r.parts, r.gets) == (2, 1, 0)
    assert all(np.array_equal(outs[s], expected(data, s)) for s in range(STAGES))


def test_a_cancelled_read_publishes_nothing_more_and_releases_its_lease(daemon):
    keys, data = blocks(4, 7)
    with KVStoreClient(daemon.address, shared_memory=True) as c:
        assert c.put_from(keys, data).stored == 4
        stop = threading.Event()
        outs = [np.zeros((4, 4096), dtype=np.uint8) for _ in range(STAGES)]
        order: list[int] = []

        def publish(s, sizes):
            order.append(s)
            stop.set()                                     # cancelled once stage 0 is in place
        r = c.leased_read(keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
        r.run(publish, stop.is_set)
        assert order == [0] and not outs[1].any()
        c.close()                                          # sends the release waiting in the background
    deadline = time.monotonic() + 60                       # a RELEASE frame gets no answer: the daemon
    while daemon.manager.catalogue.num_leases and time.monotonic() < deadline:   # applies it soon after
        time.sleep(0.01)
    assert daemon.manager.catalogue.num_leases == 0


def test_bad_stages_are_refused_before_any_call(daemon):
    keys, _ = blocks(2, 8)
    with KVStoreClient(daemon.address) as c:
        with pytest.raises(InvalidRequest, match="at least one stage"):
            c.leased_read(keys, [])
        with pytest.raises(InvalidRequest, match="length > 0"):
            c.leased_read(keys, [ReadStage([(0, 0)], np.zeros((2, 8), np.uint8))])
        with pytest.raises(InvalidRequest, match="does not fit"):
            c.leased_read(keys, [ReadStage([(0, 16)], np.zeros((2, 8), np.uint8))])
        with pytest.raises(InvalidRequest, match="bytes"):
            c.leased_read([b"short"], [ReadStage([(0, 8)], np.zeros((1, 8), np.uint8))])


def test_a_daemon_that_is_not_there_raises_store_unavailable(tmp_path):
    with KVStoreClient(f"unix:{tmp_path}/absent.sock", timeout=0.5) as c:
        r = c.leased_read([b"k" * 32], [ReadStage([(0, 8)], np.zeros((1, 8), np.uint8))])
        with pytest.raises(StoreUnavailable):
            r.run()


@pytest.mark.parametrize("path", ["lease", "block_table", "grpc"])
def test_nothing_is_written_after_a_cancel_made_under_the_write_lock(tmp_path, monkeypatch, path):
    """A caller that cancels, then takes ``write_lock`` (an engine giving its cache blocks back),
    finds no later stage written, whichever way the blocks are read: stages after the
    cancel stay as they were and are never published."""
    from tiers.block_table import supported

    if path == "block_table" and not supported():
        pytest.skip("the block table is offered on x86-64 only")
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "1" if path == "block_table" else "0")
    d = start(tmp_path)
    try:
        keys, data = blocks(6, 9)
        with KVStoreClient(d.address, shared_memory=path != "grpc") as c:
            assert c.put_from(keys, data).stored == 6
            lock, stop = threading.Lock(), threading.Event()
            outs = [np.zeros((6, 4096), dtype=np.uint8) for _ in range(STAGES)]
            order: list[int] = []
            at_cancel: list[np.ndarray] = []

            def publish(s, sizes):
                order.append(s)
                if s == 2:                       # the engine gives up after stage 2
                    stop.set()
                    with lock:
                        at_cancel.extend(o.copy() for o in outs)

            r = c.leased_read(keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
            r.run(publish, stop.is_set, write_lock=lock)
            assert order == [0, 1, 2]
            for s in range(3):
                assert np.array_equal(outs[s], expected(data, s))
            for s in range(STAGES):
                assert np.array_equal(outs[s], at_cancel[s]), f"stage {s} written after the cancel"
            if path != "grpc":                   # (one gRPC get fills every stage before the first is published)
                assert not any(outs[s].any() for s in range(3, STAGES))
    finally:
        d.stop(0)


@pytest.mark.parametrize("path", ["lease", "block_table"])
def test_a_cancel_during_a_stage_copy_waits_for_it_and_nothing_follows(tmp_path, monkeypatch, path):
    """Another thread cancels while stage 3 is being copied: taking ``write_lock`` then waits
    for that copy to end, and no byte lands in any stage afterwards."""
    from tiers.block_table import supported

    if path == "block_table" and not supported():
        pytest.skip("the block table is offered on x86-64 only")
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "1" if path == "block_table" else "0")
    real, copying = leased_mod.LeasedRead._copy_blocks, threading.Event()

    def copy_blocks(self, s, *args):
        if s == 3:                               # stage 3's copy (of every block)
            copying.set()
            time.sleep(0.2)                     # the canceller arrives mid-copy
        real(self, s, *args)

    monkeypatch.setattr(leased_mod.LeasedRead, "_copy_blocks", copy_blocks)
    d = start(tmp_path)
    try:
        keys, data = blocks(6, 10)
        with KVStoreClient(d.address, shared_memory=True) as c:
            assert c.put_from(keys, data).stored == 6
            lock, stop = threading.Lock(), threading.Event()
            outs = [np.zeros((6, 4096), dtype=np.uint8) for _ in range(STAGES)]
            at_cancel: list[np.ndarray] = []

            order: list[int] = []
            published: list[int] = []

            def cancel():
                assert copying.wait(60)
                stop.set()
                with lock:
                    at_cancel.extend(o.copy() for o in outs)
                    published.append(len(order))

            canceller = threading.Thread(target=cancel)
            canceller.start()
            r = c.leased_read(keys, [ReadStage(stage_ranges(s), outs[s]) for s in range(STAGES)])
            r.run(lambda s, sizes: order.append(s), stop.is_set, write_lock=lock)
            canceller.join(60)
            assert len(at_cancel) == STAGES
            for s in range(STAGES):
                assert np.array_equal(outs[s], at_cancel[s]), f"stage {s} written after the cancel"
            assert len(order) == published[0] < STAGES              # none published after the cancel
            assert np.array_equal(outs[3], expected(data, 3))        # the copy under way was finished
    finally:
        d.stop(0)
