"""Numbers and sizes from clients (issue 9, items 1 and 2).

Every numeric field the daemon accepts is checked before anything changes: a number that
is not finite, negative, out of range or absurdly far from now gets INVALID_ARGUMENT and
the store, the leases, the reservations and the prefetch tables are exactly as before.
A put of a stored key with another size is refused (first writer wins) on every path:
the protobuf Put and PutInline, the raw-frame PutRaw and the shared-memory put_from.
"""

from __future__ import annotations

import logging
import math
import time

import grpc
import pytest

from support.daemon import daemon_config
from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.agent.tool_durations import LogNormalFit, ToolPredictor, WindowQuantile
from kvstore.service.startup import start_server
from kvstore.service.put_assembly import PUT_REPLY_TRAILER
from kvstore.service.validate import MAX_BLOCK_BYTES, MAX_CLOCK_SKEW_S, MAX_RANGES
from rel_support import key

BAD_TIMES = [math.nan, math.inf, -math.inf, -1.0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="16MiB", extra={"prefetch": {"enabled": True}}))
    ch = grpc.insecure_channel(d.address)
    yield d, pb_grpc.KVStoreStub(ch)
    ch.close()
    d.stop(0)


def code(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, timeout=20, **kwargs)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def snapshot(d) -> dict:
    """Everything a refused call must leave as it was."""
    m, h = d.manager, d.service.hints
    with m.lock:
        return {
            "blocks": sorted(m.catalogue.keys()),
            "used": [u.used_bytes for u in m.usage()],
            "claims": len(m.catalogue._claims),
            "leases": m.catalogue.num_leases,
            "waiting": sorted(h.waits),
            "due": len(h.timeline),
            "tool_calls": h.stats.tool_calls,
            "resumes": h.stats.resumes + h.stats.resumes_unknown,
            "tools": h.predictor.tools(),
        }


# ------------------------------------------------------------------ item 1: numbers

def test_tool_call_start_with_a_bad_time_is_refused_and_changes_nothing(node):
    d, stub = node
    now = time.time()
    before = snapshot(d)
    for t in BAD_TIMES + [now + MAX_CLOCK_SKEW_S + 60, now - MAX_CLOCK_SKEW_S - 60]:
        req = pb.ToolCallStartRequest(trajectory_id="T", tool="search", start_time=t, keys=[key(1)])
        assert code(stub.ToolCallStart, req) == INVALID, t
    assert snapshot(d) == before
    # the heap holds no NaN: a good call is still scheduled and answered with a finite time
    reply = stub.ToolCallStart(pb.ToolCallStartRequest(trajectory_id="T", tool="search", keys=[key(1)]), timeout=20)
    assert math.isfinite(reply.predicted_resume_time) and abs(reply.predicted_resume_time - now) < 3600
    assert math.isfinite(d.service.hints.next_due())


def test_resume_with_a_bad_time_is_refused_and_the_call_stays_open(node):
    d, stub = node
    stub.ToolCallStart(pb.ToolCallStartRequest(trajectory_id="T", tool="search", keys=[key(1)]), timeout=20)
    before = snapshot(d)
    for t in BAD_TIMES + [time.time() + MAX_CLOCK_SKEW_S + 60]:
        assert code(stub.Resume, pb.ResumeRequest(trajectory_id="T", time=t)) == INVALID, t
    assert code(stub.Resume, pb.ResumeRequest(trajectory_id="", time=0)) == INVALID
    assert snapshot(d) == before
    reply = stub.Resume(pb.ResumeRequest(trajectory_id="T"), timeout=20)
    assert reply.known and 0 <= reply.observed_seconds < 3600
    assert math.isfinite(d.service.hints.predictor.predict("search"))


def test_lease_with_a_bad_ttl_releases_nothing_and_pins_nothing(node):
    d, stub = node
    with KVStoreClient(d.address) as c:          # open: its lease ends with it
        c.put([(key(1), b"x" * 4096)])
        held = c.lease([key(1)])
        before = snapshot(d)
        for ttl in BAD_TIMES + [601.0]:
            req = pb.LeaseRequest(keys=[key(1)], ttl_seconds=ttl, release=[held.lease_id])
            assert code(stub.Lease, req) == INVALID, ttl
        assert snapshot(d) == before
        assert stub.Release(pb.ReleaseRequest(lease_ids=[held.lease_id]), timeout=20).released == 1


@pytest.mark.parametrize("sizes,ttl", [
    ([4096, 0], 10.0), ([4096, MAX_BLOCK_BYTES + 1], 10.0), ([4096], 10.0),
    ([4096, 4096], math.nan), ([4096, 4096], math.inf), ([4096, 4096], -5.0), ([4096, 4096], 601.0),
])
def test_reserve_with_a_bad_size_or_ttl_reserves_nothing(node, sizes, ttl):
    d, stub = node
    before = snapshot(d)
    req = pb.ReserveRequest(keys=[key(1), key(2)], sizes=sizes, ttl_seconds=ttl)
    assert code(stub.Reserve, req) == INVALID
    assert snapshot(d) == before


def test_get_ranges_and_chunk_sizes_out_of_range_are_refused(node):
    d, stub = node
    with KVStoreClient(d.address) as c:
        c.put([(key(1), b"y" * 1000)])

    def get(timeout=20, **kw):
        return list(stub.Get(pb.GetRequest(keys=[key(1)], **kw), timeout=timeout))
    before = snapshot(d)
    for ranges in ([(0, 10), (5, 10)], [(1 << 63, 1 << 63)], [(i, 0) for i in range(MAX_RANGES + 1)]):
        assert code(get, ranges=[pb.ByteRange(offset=o, length=n) for o, n in ranges]) == INVALID, ranges[:2]
    assert snapshot(d) == before
    # a range past the end of this block is a miss for the block (others may be long enough)
    replies = get(ranges=[pb.ByteRange(offset=990, length=20)])
    chunks = [c for b in replies for c in b.chunks]
    assert [(c.key, c.found, c.data) for c in chunks] == [(key(1), False, b"")]
    assert snapshot(d) == before
    assert b"".join(c.data for b in get(max_chunk_bytes=1) for c in b.chunks) == b"y" * 1000
    assert b"".join(c.data for b in get(max_chunk_bytes=(1 << 64) - 1) for c in b.chunks) == b"y" * 1000


@pytest.mark.parametrize("total,offset", [(0, 0), (MAX_BLOCK_BYTES + 1, 0), (4, 1), (3, 0)])
def test_put_chunk_sizes_and_offsets_out_of_range_store_nothing(node, total, offset):
    d, stub = node
    before = snapshot(d)
    chunk = pb.PutChunk(key=key(5), total_size=total, offset=offset, data=b"abcd")
    assert code(stub.PutInline, pb.PutBatch(chunks=[chunk])) == INVALID
    assert code(stub.Put, iter([pb.PutBatch(chunks=[chunk])])) == INVALID
    assert snapshot(d) == before


@pytest.mark.parametrize("kind", [WindowQuantile, LogNormalFit])
def test_estimators_refuse_non_finite_and_negative_durations(kind):
    est = kind(8)
    est.observe(2.0)
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        with pytest.raises(ValueError):
            est.observe(bad)
    assert est.count == 1 and est.quantile(0.5) == pytest.approx(2.0)


def test_tool_predictor_refuses_non_finite_durations_and_keeps_its_predictions():
    p = ToolPredictor("quantile", window=8, min_samples=1)
    p.observe("search", 4.0)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError):
            p.observe("search", bad)
    assert p.predict("search", 0.5) == 4.0 and p.tools() == {"search": 1}


def test_tool_predictor_keeps_a_bounded_number_of_tools():
    p = ToolPredictor("quantile", window=4, min_samples=1, max_tools=16)
    for i in range(1000):
        p.observe(f"tool-{i}", 1.0 + i)
    assert len(p.tools()) == 16 and "tool-999" in p.tools() and "tool-0" not in p.tools()
    assert math.isfinite(p.predict("tool-0"))          # a forgotten tool uses the pooled estimate


# ------------------------------------------------------------------ item 2: same key, other size

def stored_bytes(d, k) -> bytes:
    return bytes(d.manager.get(k).data)


def test_size_conflict_on_the_protobuf_put(node, caplog):
    d, stub = node
    first = pb.PutChunk(key=key(1), total_size=1024, offset=0, data=b"a" * 1024)
    assert stub.PutInline(pb.PutBatch(chunks=[first]), timeout=20).stored == 1
    bigger = pb.PutChunk(key=key(1), total_size=2048, offset=0, data=b"b" * 2048)
    other = pb.PutChunk(key=key(2), total_size=100, offset=0, data=b"c" * 100)
    with caplog.at_level(logging.WARNING, logger="kvstore.store.manager"):
        for call, arg in ((stub.Put, iter([pb.PutBatch(chunks=[bigger, other])])),
                          (stub.PutInline, pb.PutBatch(chunks=[bigger]))):
            with pytest.raises(grpc.RpcError) as info:
                call(arg, timeout=20)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "stored with 1024 bytes" in info.value.details()
            trailer = dict(info.value.trailing_metadata())[PUT_REPLY_TRAILER]
            assert pb.PutReply.FromString(trailer).size_conflicts == 1
    assert stored_bytes(d, key(1)) == b"a" * 1024                       # first writer wins
    assert stored_bytes(d, key(2)) == b"c" * 100                        # the rest of the call was stored
    assert d.manager.counters["puts_size_conflict"] == 2
    assert sum("first writer wins" in r.getMessage() for r in caplog.records) == 1    # logged once


def test_size_conflict_on_the_raw_put(node):
    d, _ = node
    with KVStoreClient(d.address, shared_memory=False) as c:
        c.put([(key(1), b"a" * 1024)])
        with pytest.raises(errors.SizeConflict, match="stored with 1024 bytes") as info:
            c.put([(key(3), b"d" * 10), (key(1), b"b" * 2048)])
        assert (info.value.result.stored, info.value.result.size_conflicts) == (1, 1)
        assert c.get([key(1)])[0].data == b"a" * 1024
        assert c.put([(key(1), b"z" * 1024)]).already_present == 1        # same size: a no-op
        assert c.stats()["counters"]["puts_size_conflict"] == 1
    assert stored_bytes(d, key(1)) == b"a" * 1024


def test_size_conflict_on_the_shared_memory_put(node):
    d, _ = node
    with KVStoreClient(d.address, shared_memory=True) as c:
        assert c.shared_memory
        c.put_from([key(1)], [b"a" * 1024])
        with pytest.raises(errors.SizeConflict, match="stored with 1024 bytes") as info:
            c.put_from([key(4), key(1)], [b"e" * 64, b"b" * 2048])
        assert (info.value.result.stored, info.value.result.size_conflicts) == (1, 1)
        assert c.stats()["counters"]["puts_size_conflict"] == 1
    assert stored_bytes(d, key(1)) == b"a" * 1024
    assert stored_bytes(d, key(4)) == b"e" * 64
    assert d.manager.catalogue.claim(key(1)) is None


@pytest.mark.parametrize("shared", [True, False])
def test_a_buffer_with_other_rows_than_keys_is_refused_and_stores_nothing(node, shared):
    """One buffer of blocks shaped ``(rows, block_bytes)`` has a row per key: 3 rows for 4 keys
    was cut into 4 blocks of 3/4 of a row, stored, and a later right-sized put of those keys was
    refused as a size conflict. Now it is refused before anything is sent (same-node and gRPC,
    put_from and get_into), and the right put stores the blocks."""
    import numpy as np
    import torch

    d, _ = node
    keys = [key(40 + i) for i in range(4)]
    with KVStoreClient(d.address, shared_memory=shared) as c:
        assert c.shared_memory is shared
        before = snapshot(d)
        for bad in (np.ones((3, 4096), np.uint8), np.ones((5, 4096), np.uint8), torch.ones(3, 1024),
                    np.ones((3, 2, 2048), np.uint8)):
            with pytest.raises(errors.InvalidRequest, match="rows for 4 keys"):
                c.put_from(keys, bad)
            with pytest.raises(errors.InvalidRequest, match="rows for 4 keys"):
                c.get_into(keys, np.zeros_like(bad) if isinstance(bad, np.ndarray) else torch.zeros_like(bad))
        assert snapshot(d) == before
        src = np.arange(4 * 4096, dtype=np.uint32).astype(np.uint8).reshape(4, 4096)
        assert c.put_from(keys, src).stored == 4
        out = np.zeros((4, 4096), np.uint8)
        assert c.get_into(keys, out).found == 4 and (out == src).all()
        assert c.put_from([key(50), key(51)], np.ones(2 * 100, np.uint8)).stored == 2   # a flat buffer: equal blocks
        assert c.put_from([key(52), key(53)], np.ones((3, 100), np.uint8), sizes=[100, 200]).stored == 2


def test_put_refuses_what_is_not_key_payload_pairs_before_sending(node):
    """``put(keys, payloads)`` (a user's slip for put_from) and a ``str`` payload are refused with
    a typed error that says what put takes, not an unpacking error or gRPC's UNKNOWN."""
    d, _ = node
    with KVStoreClient(d.address) as c:
        before = snapshot(d)
        with pytest.raises(errors.InvalidRequest, match=r"\(key, payload\) pairs; item 0 is a bytes"):
            c.put([key(60), key(61)], [b"a" * 64, b"b" * 64])
        with pytest.raises(errors.InvalidRequest, match="payload of item 1 is a str"):
            c.put([(key(60), b"a" * 64), (key(61), "text")])
        with pytest.raises(errors.InvalidRequest, match="item 0 is a tuple"):
            c.put([(key(60), b"a", b"b")])
        assert snapshot(d) == before
        assert c.put([(key(60), b"a" * 64), (key(61), bytearray(64))]).stored == 2


@pytest.mark.parametrize("shared", [True, False])
def test_byte_ranges_that_are_negative_or_not_integers_are_refused_before_anything_is_read(node, shared):
    """A negative range offset on the same-node path read the neighbouring block's bytes
    out of the arena and counted them found; on gRPC it raised protobuf's ValueError. Both
    paths, ``get_into`` and ``get``, now refuse such ranges with InvalidRequest."""
    import numpy as np

    d, _ = node
    keys = [key(60 + i) for i in range(3)]
    blocks = np.stack([np.full(8192, 10 + i, np.uint8) for i in range(3)])
    with KVStoreClient(d.address, shared_memory=shared) as c:
        assert c.put_from(keys, blocks).stored == 3
        for bad in ([(-4096, 4096)], [(-10, 20)], [(10, -5)], [(0.5, 2)], [("0", 2)], [(True, 2)], [(1, 2, 3)], [5]):
            out = np.zeros(8192 * 3, np.uint8)
            with pytest.raises(errors.InvalidRequest, match="ranges"):
                c.get_into(keys[1:2], out, ranges=bad)
            assert not out.any()
            with pytest.raises(errors.InvalidRequest, match="ranges"):
                c.get(keys[1:2], ranges=bad)
        out = np.zeros(16, np.uint8)                       # a good range still reads the block's own bytes
        assert c.get_into(keys[1:2], out, ranges=[(8176, 16)]).found == 1 and (out == 11).all()
        assert c.get(keys[2:3], ranges=[(0, 4)])[0].data == bytes([12] * 4)


@pytest.mark.parametrize("shared", [True, False])
def test_client_misuse_is_an_invalid_request_and_a_closed_client_says_it_is_closed(node, shared):
    """Found by a hostile test: a negative size raised protobuf's ValueError, a float size
    or a str key a TypeError (or the gRPC put's "Exception iterating requests!"), a 0-d
    tensor was stored as a 4-byte block, and a closed client raised grpc's bare ValueError."""
    import numpy as np
    import torch

    d, _ = node
    keys = [key(70), key(71)]
    c = KVStoreClient(d.address, shared_memory=shared)
    before = snapshot(d)
    buf = np.ones(8192, np.uint8)
    for call, needle in (
            (lambda: c.put_from(keys, buf, sizes=[-5, 100]), r"sizes\[0\] is -5: must be >= 1"),
            (lambda: c.put_from(keys, buf, sizes=[0, 100]), r"sizes\[0\] is 0: must be >= 1"),
            (lambda: c.put_from(keys, buf, sizes=[1.5, 100]), r"sizes\[0\] is 1.5: byte counts are integers"),
            (lambda: c.put_from(keys, buf, sizes=[100, 100], offsets=[-100, 0]), r"offsets\[0\] is -100"),
            (lambda: c.get_into(keys, buf, offsets=[0, -1]), r"offsets\[1\] is -1"),
            (lambda: c.lookup(["a" * 32]), r"keys\[0\] is a str"),
            (lambda: c.put_from(["a" * 32], buf), r"keys\[0\] is a str"),
            (lambda: c.get(keys[0]), "a list of keys is needed"),
            (lambda: c.put_from([key(72)], torch.tensor(5.0)), "0-d Tensor"),
            (lambda: c.get_into([key(72)], np.array(3, np.uint8)), "0-d ndarray")):
        with pytest.raises(errors.InvalidRequest, match=needle):
            call()
    assert snapshot(d) == before
    assert c.lookup([memoryview(keys[0])]).hit_blocks == 0      # bytes-like keys are fine
    assert c.put_from(keys, buf).stored == 2
    rows = np.frombuffer(keys[0] + keys[1], np.uint8).reshape(2, 32)
    assert c.lookup(list(rows)).hit_blocks == 2                  # rows of a (n, 32) uint8 array
    assert c.put([(memoryview(key(74)).cast("Q"), b"q" * 64)]).stored == 1   # 4 items of 8 bytes
    assert c.get([key(74)])[0].data == b"q" * 64
    c.close()
    for call in (lambda: c.lookup(keys), lambda: c.get(keys), lambda: c.get_into(keys, buf),
                 lambda: c.put([(key(73), b"x" * 64)]), lambda: c.put_from(keys, buf), lambda: c.lease(keys)):
        with pytest.raises(errors.StoreUnavailable, match="is closed"):
            call()
