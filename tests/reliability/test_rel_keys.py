"""Keys of the wrong length and requests listing more keys than the daemon takes (issue 19,
items 13 and 14).

A block key is exactly 32 bytes. The raw frames of PutRaw have a fixed 32-byte key field:
before, ``put()`` padded an 8-byte key with NULs and cut a 33-byte one, so both were
stored under another key and two 33-byte keys sharing their first 32 bytes collided.
Now every client call that carries keys refuses such a key with InvalidRequest before
anything is sent, and the daemon refuses them (INVALID_ARGUMENT) on every RPC, for
clients that do not check; the store is unchanged either way.

A request may list at most 1,048,576 keys (``MAX_KEYS_PER_REQUEST``); the client splits
longer Lookups, Deletes, Gets, Leases and Reserves by that cap as well as by message bytes.
"""

from __future__ import annotations

import hashlib
import time

import grpc
import numpy as np
import pytest

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common import errors
from kvstore.common.transport import MAX_KEYS_PER_REQUEST
from kvstore.common.wire import FOUND, encode
from kvstore.service import validate
from kvstore.service.startup import start_server
from rel_support import key

BAD_LENGTHS = [0, 8, 31, 33]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def bad_key(n: int, tag: bytes = b"b") -> bytes:
    return hashlib.sha256(tag).digest()[:min(n, 32)] + b"\x07" * max(0, n - 32)


@pytest.fixture
def node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None, extra={"prefetch": {"enabled": True}}))
    yield d
    d.stop(0)


def stored(d) -> list[bytes]:
    m = d.manager
    with m.lock:
        return sorted(m.catalogue.keys())


def client_calls(c: KVStoreClient, k: bytes) -> dict:
    """Every client entry point that carries keys, called with the key ``k`` next to a good key."""
    good = key(1)
    block = np.full(64, 5, np.uint8)
    return {
        "put": lambda: c.put([(good, block.tobytes()), (k, block.tobytes())]),
        "put_from": lambda: c.put_from([good, k], np.stack([block, block])),
        "get": lambda: c.get([good, k]),
        "get_into": lambda: c.get_into([good, k], np.zeros((2, 64), np.uint8)),
        "lookup": lambda: c.lookup([good, k]),
        "delete": lambda: c.delete([good, k]),
        "lease": lambda: c.lease([good, k]),
        "tool_call_start": lambda: c.tool_call_start("traj", "search", [good, k]),
        "session_hint": lambda: c.session_hint("sess", "continues", [good, k]),
        "explain": lambda: c.explain([good, k]),
    }


@pytest.mark.parametrize("n", BAD_LENGTHS)
def test_the_client_refuses_a_key_of_the_wrong_length_before_sending(tmp_path, n):
    """No daemon listens: a call that sent anything would fail StoreUnavailable."""
    with KVStoreClient(f"unix:{tmp_path}/nobody.sock", timeout=5) as c:
        for name, call in client_calls(c, bad_key(n)).items():
            with pytest.raises(errors.InvalidRequest, match=rf"keys?\[1\] has {n} bytes|\[1\] has {n} bytes") as e:
                call()
            assert "32 bytes" in str(e.value), name


@pytest.mark.parametrize("n", BAD_LENGTHS)
def test_a_key_of_the_wrong_length_changes_nothing_stored(node, n):
    k = bad_key(n)
    with KVStoreClient(node.address, timeout=20) as c:
        c.put([(key(2), b"x" * 100)])
        before = stored(node)
        for name, call in client_calls(c, k).items():
            with pytest.raises(errors.InvalidRequest):
                call()
        assert stored(node) == before
        padded = (k + b"\0" * 32)[:32]          # what the fixed 32-byte frame field made of it
        assert c.lookup([padded]).hit_blocks == 0 and c.lookup([key(1)]).hit_blocks == 0


def test_two_33_byte_keys_that_share_32_bytes_never_collide(node):
    a, b = b"\x01" * 32 + b"A", b"\x01" * 32 + b"B"
    with KVStoreClient(node.address, timeout=20) as c:
        for k in (a, b):
            with pytest.raises(errors.InvalidRequest):
                c.put([(k, b"payload of " + k)])
        assert c.lookup([a[:32]]).hit_blocks == 0
    assert stored(node) == []


@pytest.mark.parametrize("n", BAD_LENGTHS)
def test_the_daemon_refuses_a_key_of_the_wrong_length_on_every_rpc(node, n):
    """A raw stub, bypassing the client's check: INVALID_ARGUMENT, and nothing changes."""
    k, good = bad_key(n), key(3)
    ch = grpc.insecure_channel(node.address)
    stub = pb_grpc.KVStoreStub(ch)
    get_raw = ch.unary_stream("/kvstore.v1.KVStoreData/GetRaw", request_serializer=pb.GetRequest.SerializeToString)
    chunk = [pb.PutChunk(key=good, total_size=4, offset=0, data=b"good"),
             pb.PutChunk(key=k, total_size=4, offset=0, data=b"bad!")]
    with KVStoreClient(node.address, timeout=20) as c:
        c.put([(key(4), b"y" * 50)])
        arena = c.arena()
    meta = ((("kvstore-arena", arena.identity),) if arena is not None else ())
    before = stored(node)
    calls = {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(keys=[good, k]), timeout=20),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(keys=[key(4), k]), timeout=20),
        "Get": lambda: list(stub.Get(pb.GetRequest(keys=[good, k]), timeout=20)),
        "GetRaw": lambda: list(get_raw(pb.GetRequest(keys=[good, k]), timeout=20)),
        "Put": lambda: stub.Put(iter([pb.PutBatch(chunks=chunk)]), timeout=20),
        "PutInline": lambda: stub.PutInline(pb.PutBatch(chunks=chunk), timeout=20),
        "Lease": lambda: stub.Lease(pb.LeaseRequest(keys=[key(4), k], ttl_seconds=5), timeout=20, metadata=meta),
        "Reserve": lambda: stub.Reserve(pb.ReserveRequest(keys=[good, k], sizes=[8, 8], ttl_seconds=5),
                                        timeout=20, metadata=meta),
        "Commit": lambda: stub.Commit(pb.CommitRequest(keys=[k]), timeout=20, metadata=meta),
        "ToolCallStart": lambda: stub.ToolCallStart(pb.ToolCallStartRequest(trajectory_id="T", tool="t",
                                                                            keys=[good, k]), timeout=20),
        "SessionHint": lambda: stub.SessionHint(pb.SessionHintRequest(session_id="S", keys=[good, k]), timeout=20),
        "Explain": lambda: stub.Explain(pb.ExplainRequest(keys=[good, k]), timeout=20),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == INVALID, (name, e.value.code(), e.value.details())
            assert "32 bytes" in e.value.details(), name
        assert stored(node) == before
        m = node.manager
        with m.lock:
            assert m.catalogue.num_leases == 0 and len(m.catalogue._claims) == 0
        hints = node.service.hints
        assert hints.stats.tool_calls == 0
    finally:
        ch.close()


def test_a_raw_frame_always_carries_32_key_bytes():
    """PutRaw's key field is fixed: a key of another length cannot reach the daemon through
    it, which is why the client checks keys before building frames."""
    frame = encode([(b"\x01" * 32, FOUND, 0, 3, 0, b"abc")])
    assert len(frame) == 8 + 64 + 3


# ------------------------------------------------------------------ item 13: keys per request

@pytest.mark.slow
def test_lookup_and_delete_of_more_keys_than_the_daemon_cap(node):
    """1.2 M keys, 4 stored at the front: one call each, split by the 1,048,576-key cap."""
    n = MAX_KEYS_PER_REQUEST + 150_000
    keys = [i.to_bytes(32, "little") for i in range(n)]
    with KVStoreClient(node.address, timeout=120) as c:
        c.put([(k, b"z" * 16) for k in keys[:4]])
        t0 = time.perf_counter()
        assert c.lookup(keys[:4] + keys[4:]).hit_blocks == 4
        # a prefix that crosses the cap: the first request is all hits, the second goes on
        many = keys[:4] * (MAX_KEYS_PER_REQUEST // 4) + keys[:4] + keys[4:8]
        assert c.lookup(many).hit_blocks == MAX_KEYS_PER_REQUEST + 4
        assert c.delete(keys) == 4
        print(f"\nlookup x2 + delete of {n:,} keys: {time.perf_counter() - t0:.1f} s")
        assert c.lookup(keys[:4]).hit_blocks == 0


def test_every_call_that_lists_keys_splits_by_the_daemon_cap(node, monkeypatch):
    """A daemon that takes 1,000 keys per request (the cap made small) and a client that
    knows it: lookup, delete, get, get_into (leases) and put_from (reserve, commit) of
    2,500 blocks give the right results in several requests each."""
    cap = 1000
    monkeypatch.setattr(validate, "MAX_KEYS", cap)
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")     # get_into by leases, which are split (the table needs none)
    keys = [key(i, "cap") for i in range(2500)]
    rows = np.stack([np.full(32, i % 251, np.uint8) for i in range(2500)])
    with KVStoreClient(node.address, timeout=60, shared_memory=False) as g:
        with pytest.raises(errors.InvalidRequest, match="at most 1000"):
            g.lookup(keys)                          # the daemon's cap on a Lookup RPC, before the client knows it
    with KVStoreClient(node.address, timeout=60) as c:  # (same node: lookups go as control frames, split)
        c._connection.max_keys_per_request = cap
        assert c.put_from(keys, rows).stored == 2500
        assert c.lookup(keys + [key(9999, "cap")]).hit_blocks == 2500
        out = np.zeros_like(rows)
        got = c.get_into(keys, out)
        assert got.found == 2500 and np.array_equal(out, rows)
        res = c.get(keys[1200:2300])
        assert all(r.found for r in res) and [r.data for r in res] == [rows[i].tobytes() for i in range(1200, 2300)]
        assert c.delete(keys[:2100]) == 2100
        assert c.lookup(keys[2100:]).hit_blocks == 400
        with pytest.raises(errors.InvalidRequest, match="at most 1000"):
            c.lease(keys[:1001])                    # one request cannot be split: refused before sending
    assert node.manager.counters["leases_granted"] >= 3    # get_into went through the arena, in parts
