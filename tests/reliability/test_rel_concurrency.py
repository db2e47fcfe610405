"""Races through the real daemon (in-process, unix socket, real host arena and NVMe files):
the same key written by many clients at once, reads during an in-flight write, delete and
eviction during a slow read, cancelled streams, and put/demote/evict/delete cycles whose
used bytes must return exactly to zero.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import SizeConflict
from kvstore.service.startup import start_server
from rel_support import key, payload, run_in_thread
from tiers.base import TierKind

DEADLINE = 60.0

LAYOUTS = {
    "host": dict(host="64MiB", nvme=None),
    "nvme": dict(host="64MiB", nvme="256MiB", extra={"tiers": {"host": {"enabled": False}}}),
    "host+nvme": dict(host="1MiB", nvme="256MiB"),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout_daemon(request, tmp_path):
    d = start_server(daemon_config(tmp_path, **LAYOUTS[request.param]))
    yield d
    d.stop(0)


def usage(d) -> list[tuple[int, int]]:
    return [(t.used_bytes, len(t)) for t in d.manager.tiers]


def settle(d, expected, what: str) -> None:
    """Wait (bounded) for background transfers, then compare tier usage with ``expected``."""
    deadline = time.monotonic() + DEADLINE
    while usage(d) != expected and time.monotonic() < deadline:
        d.manager.drain(DEADLINE)
        time.sleep(0.01)
    assert usage(d) == expected, what


def test_same_key_written_concurrently_by_many_clients(layout_daemon):
    d = layout_daemon
    baseline = usage(d)
    writers = 8
    keys = [key(i, "same") for i in range(8)]
    # even keys: every writer sends the same bytes; odd keys: each writer its own bytes and size
    def variant(k, w):
        same = keys.index(k) % 2 == 0
        n = 300_000 if same else 200_000 + 7_919 * w
        return payload(k, n, variant=0 if same else w)

    clients = [KVStoreClient(d.address, timeout=DEADLINE, chunk_bytes=32 << 10) for _ in range(writers)]
    try:
        results: dict[tuple[int, int], object] = {}
        barrier = threading.Barrier(writers, timeout=DEADLINE)

        def write(w):
            for i, k in enumerate(keys):
                barrier.wait()
                try:
                    results[(i, w)] = clients[w].put([(k, variant(k, w))])
                except Exception as e:  # noqa: BLE001 - reported below
                    results[(i, w)] = e

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE * 2)
            assert not t.is_alive(), "a writer hung"
        # first writer wins: a put of the same size is a no-op; of another size, refused
        failed = {ik: r for ik, r in results.items()
                  if isinstance(r, Exception) and not isinstance(r, SizeConflict)}
        assert not failed, f"{len(failed)} concurrent puts failed, e.g. {next(iter(failed.values()))}"
        assert len(results) == len(keys) * writers
        c = clients[0]
        for i, k in enumerate(keys):
            outcomes = [results[(i, w)] for w in range(writers)]
            ok = [r for r in outcomes if not isinstance(r, SizeConflict)]
            assert sum(r.stored for r in ok) == 1, f"key {i}: {outcomes}"
            got = c.get([k])[0]
            winner = next(w for w in range(writers) if not isinstance(outcomes[w], SizeConflict)
                          and outcomes[w].stored)
            assert got.found and got.data == variant(k, winner), f"key {i}: mixed bytes"
            same_size = [w for w in range(writers) if len(variant(k, w)) == len(got.data)]
            assert sum(r.already_present for r in ok) == len(same_size) - 1
            assert len(outcomes) - len(ok) == writers - len(same_size)   # every other size refused
            assert c.lookup([k]).hit_blocks == 1
            again = c.put([(k, got.data)])                       # identical re-put: idempotent
            assert (again.stored, again.already_present) == (0, 1)
        assert c.delete(keys) == len(keys)
        settle(d, baseline, "no reservation or copy is left behind")
    finally:
        for c in clients:
            c.close()


class PausedStream:
    """Chunks of one block for a streamed Put that stops after the first ``pause_after``
    chunks until ``resume`` is set (``abort``: the stream then ends, incomplete)."""

    def __init__(self, k: bytes, data: bytes, chunk: int, pause_after: int):
        self.key, self.data, self.chunk, self.pause_after = k, data, chunk, pause_after
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.abort = False

    def __iter__(self):
        for n, off in enumerate(range(0, len(self.data), self.chunk)):
            if n == self.pause_after:
                self.paused.set()
                assert self.resume.wait(DEADLINE)
                if self.abort:
                    return
            yield pb.PutBatch(chunks=[pb.PutChunk(key=self.key, total_size=len(self.data), offset=off,
                                                  data=self.data[off:off + self.chunk])])


def test_get_during_an_in_flight_write_never_sees_a_partial_block(layout_daemon):
    d = layout_daemon
    baseline = usage(d)
    k, data = key(1, "inflight"), payload(key(1, "inflight"), 1 << 20)
    stream = PausedStream(k, data, 64 << 10, pause_after=8)
    with grpc.insecure_channel(d.address) as ch, KVStoreClient(d.address, timeout=DEADLINE) as c:
        fut = pb_grpc.KVStoreStub(ch).Put.future(iter(stream), timeout=DEADLINE)
        assert stream.paused.wait(DEADLINE)
        for _ in range(3):                                      # half written: a miss, never bytes
            got = c.get([k])[0]
            assert not got.found and got.data == b""
            assert c.lookup([k]).hit_blocks == 0
        stream.resume.set()
        assert fut.result(DEADLINE).stored == 1
        got = c.get([k])[0]
        assert got.found and got.data == data
        assert c.delete([k]) == 1
    settle(d, baseline, "used bytes back to the start")


@pytest.mark.parametrize("how", ["stream ends early", "client cancels"])
def test_abandoned_put_stream_releases_its_reservation(layout_daemon, how):
    d = layout_daemon
    baseline = usage(d)
    k, data = key(2, "abandon"), payload(key(2, "abandon"), 1 << 20)
    stream = PausedStream(k, data, 64 << 10, pause_after=4)
    with grpc.insecure_channel(d.address) as ch, KVStoreClient(d.address, timeout=DEADLINE) as c:
        fut = pb_grpc.KVStoreStub(ch).Put.future(iter(stream), timeout=DEADLINE)
        assert stream.paused.wait(DEADLINE)
        if how == "client cancels":
            fut.cancel()
            stream.resume.set()
        else:
            stream.abort = True
            stream.resume.set()
            with pytest.raises(grpc.RpcError) as e:
                fut.result(DEADLINE)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        settle(d, baseline, "the reservation of the abandoned block is released")
        assert c.lookup([k]).hit_blocks == 0
        assert c.put([(k, data)]).stored == 1                   # the key is not stuck "being written"
        assert c.get([k])[0].data == data


def gate_reads(tier, gate: threading.Event, entered: threading.Event):
    """Make ``tier.read_into`` wait on ``gate`` before reading (a slow medium)."""
    real = tier.read_into

    def slow_read(k, out, ranges=None):
        entered.set()
        assert gate.wait(DEADLINE)
        return real(k, out, ranges)

    tier.read_into = slow_read


@pytest.mark.parametrize("tier_name", ["host", "nvme"])
def test_delete_and_reuse_during_a_slow_read_serve_the_old_bytes(tmp_path, tier_name):
    """A block deleted while a Get reads it stays allocated until the read ends; the space is
    not reused under the reader, so it gets the old block whole, never another block's bytes."""
    extra = {"tiers": {"host": {"enabled": False}}} if tier_name == "nvme" else None
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="8MiB", extra=extra))
    try:
        tier = d.manager.tiers[0]
        assert tier.kind == (TierKind.NVME if tier_name == "nvme" else TierKind.HOST)
        victim = key(0, "slow")
        old = payload(victim, 256 << 10)
        gate, entered = threading.Event(), threading.Event()
        with KVStoreClient(d.address, timeout=DEADLINE) as c, KVStoreClient(d.address, timeout=DEADLINE) as c2:
            c.put([(victim, old)])
            gate_reads(tier, gate, entered)
            reader, box = run_in_thread(c2.get, [victim])
            assert entered.wait(DEADLINE)
            assert c.delete([victim]) == 1
            assert c.lookup([victim]).hit_blocks == 0
            # fill the tier with blocks of the same size: the deleted block's room must stay taken
            others = [key(i, "fill") for i in range(1, 12)]
            for k in others:
                try:
                    c.put([(k, payload(k, 256 << 10))])
                except Exception as e:  # noqa: BLE001 - a full tier is a fine answer
                    assert "RESOURCE_EXHAUSTED" in str(e), e
            gate.set()
            reader.join(DEADLINE)
            assert not reader.is_alive()
            got = box["result"][0]
            assert got.found and got.data == old
            for k in others:
                g = c.get([k])[0]
                assert not g.found or g.data == payload(k, 256 << 10)
            assert c.lookup([victim]).hit_blocks == 0
            c.delete(others)
        settle(d, [(0, 0)] * len(d.manager.tiers), "all space returned")
    finally:
        d.stop(0)


def test_eviction_during_a_slow_read_skips_the_pinned_block(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="2MiB"))
    try:
        nvme = d.manager.tiers[1]
        gate, entered = threading.Event(), threading.Event()
        with KVStoreClient(d.address, timeout=DEADLINE) as c, KVStoreClient(d.address, timeout=DEADLINE) as c2:
            blocks = [(key(i, "ev"), payload(key(i, "ev"), 200_000)) for i in range(8)]
            c.put(blocks)                                       # some end up only on NVMe (which: the cleaner's choice)

            def only_on_nvme():
                return next((b for b in blocks if d.manager.tier_of(b[0]) == TierKind.NVME), None)
            settle_until = time.monotonic() + DEADLINE
            while only_on_nvme() is None and time.monotonic() < settle_until:
                time.sleep(0.01)
            slow = only_on_nvme()
            assert slow is not None, [d.manager.tier_of(k) for k, _ in blocks]
            gate_reads(nvme, gate, entered)
            reader, box = run_in_thread(c2.get, [slow[0]])
            assert entered.wait(DEADLINE)
            more = [(key(i, "ev2"), payload(key(i, "ev2"), 200_000)) for i in range(20)]
            for b in more:                                      # NVMe pressure: evicts others
                c.put([b])
            gate.set()
            reader.join(DEADLINE)
            assert box["result"][0].found and box["result"][0].data == slow[1]
            for k, v in blocks + more:
                g = c.get([k])[0]
                assert not g.found or g.data == v
            assert d.manager.counters["evictions_nvme"] > 0
    finally:
        d.stop(0)


def test_put_demote_evict_delete_cycles_return_used_bytes_to_baseline(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="4MiB"))
    try:
        baseline = usage(d)
        nvme_dir = tmp_path / "nvme" / "blocks"
        with KVStoreClient(d.address, timeout=DEADLINE) as c:
            for cycle in range(25):
                blocks = [(key(i, f"cyc{cycle}"), payload(key(i, f"cyc{cycle}"), 4 * (4096 + 9_973 * i)))
                          for i in range(24)]
                for b in blocks:
                    c.put([b])
                for k, v in blocks[::3]:                        # some promotions back to host
                    g = c.get([k])[0]
                    assert not g.found or g.data == v
                c.delete([k for k, _ in blocks])
                settle(d, baseline, f"cycle {cycle}: used bytes per tier back to the start")
            stats = c.stats()
        assert [t["used_bytes"] for t in stats["tiers"]] == [0, 0]
        counters = stats["counters"]     # blocks went down to NVMe (by a put's demotion or ahead of it)
        assert counters.get("demotions", 0) + counters.get("precleaned", 0) > 0 and counters["evictions_nvme"] > 0
        assert [p for p in nvme_dir.rglob("*") if p.is_file()] == []
        spare = tmp_path / "nvme" / "spare"
        assert sum(p.stat().st_size for p in spare.iterdir()) <= d.manager.tiers[1].capacity_bytes   # blocks + spares
    finally:
        d.stop(0)
