"""Transport limits (issue 9, item 3): thousands of tiny blocks and misses at a 64 KiB
message limit, on the protobuf Get/Put RPCs, the raw-frame GetRaw/PutRaw and the shared
arena; a message-size problem is MessageTooLarge, never TierFull.

A Get of 1,900 missing keys is a 64,600-byte request and thousands of 72-byte miss
records in the reply; a Put of 2,000 blocks of 16 or 96 bytes is ~180 KB of frames. Every
message must stay under the limit on both sides.
"""

from __future__ import annotations

import grpc
import pytest

from support.daemon import daemon_config
from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from kvstore.common.transport import channel_options
from rel_support import key

LIMIT = 64 << 10


def tiny(k: bytes) -> bytes:
    """16 or 96 bytes derived from the key."""
    return k * 3 if k[0] % 2 else k[:16]


def stored_keys(n):
    return [key(i, "stored") for i in range(n)]


def missing_keys(n):
    return [key(i, "missing") for i in range(n)]


@pytest.fixture
def small_node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="64MiB", nvme=None,
                                   extra={"server": {"max_message_bytes": "64KiB"}}))
    yield d
    d.stop(0)


def client(d, **kw) -> KVStoreClient:
    return KVStoreClient(d.address, max_message_bytes=LIMIT, timeout=60, **kw)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["raw", "shm"])
def test_put_and_get_thousands_of_tiny_blocks_and_misses(small_node, shared_memory):
    stored, missing = stored_keys(2000), missing_keys(1900)
    with client(small_node, shared_memory=shared_memory) as c:
        assert c.shared_memory is shared_memory
        if shared_memory:
            res = c.put_from(stored, [tiny(k) for k in stored])
        else:
            res = c.put([(k, tiny(k)) for k in stored])
        assert (res.stored, res.bytes_stored) == (2000, sum(len(tiny(k)) for k in stored))

        got = c.get(stored[:1800])
        assert [g.data for g in got] == [tiny(k) for k in stored[:1800]]
        got = c.get(missing)
        assert len(got) == 1900 and not any(g.found for g in got)
        mix = [k for pair in zip(stored, missing) for k in pair]        # 3,800 keys, every other one missing
        got = c.get(mix)
        assert [g.data if g.found else None for g in got] == [tiny(k) if k in set(stored) else None for k in mix]

        out = [bytearray(96) for _ in mix]
        res = c.get_into(mix, out, stop_at_miss=False)
        assert res.sizes == [len(tiny(k)) if i % 2 == 0 else 0 for i, k in enumerate(mix)]
        assert all(bytes(o[:n]) == tiny(k) for o, n, k in zip(out, res.sizes, mix) if n)

        prefix = stored[:1900] + missing[:1] + stored[1900:]              # the miss is past the first request
        res = c.get_into(prefix, [bytearray(96) for _ in prefix])
        assert res.found == 1900 and sum(1 for n in res.sizes if n) == 1900
        assert len(c.get(prefix, stop_at_miss=True)) == 1901


def test_lookup_and_delete_of_thousands_of_keys(small_node):
    stored = stored_keys(3000)
    with client(small_node) as c:
        c.put([(k, tiny(k)) for k in stored])
        assert c.lookup(stored).hit_blocks == 3000
        assert c.lookup(stored[:2500] + missing_keys(1) + stored[2500:]).hit_blocks == 2500
        assert c.delete(stored + missing_keys(1000)) == 3000
        assert c.lookup(stored).hit_blocks == 0


def batches(chunks, limit):
    """PutChunks packed into PutBatch messages of at most ``limit`` bytes."""
    batch, size = [], 0
    for ch in chunks:
        n = ch.ByteSize() + 6
        if batch and size + n > limit:
            yield pb.PutBatch(chunks=batch)
            batch, size = [], 0
        batch.append(ch)
        size += n
    if batch:
        yield pb.PutBatch(chunks=batch)


def test_protobuf_put_and_get_rpcs_at_a_64kib_limit(small_node):
    stored, missing = stored_keys(2000), missing_keys(1900)
    chunks = [pb.PutChunk(key=k, total_size=len(tiny(k)), offset=0, data=tiny(k)) for k in stored]
    with grpc.insecure_channel(small_node.address, options=channel_options(LIMIT)) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        assert stub.Put(batches(chunks[:1000], LIMIT - 1024), timeout=60).stored == 1000
        inline = list(batches(chunks[1000:], LIMIT - 1024))
        assert sum(stub.PutInline(b, timeout=60).stored for b in inline) == 1000

        for keys, found in ((stored[:1800], True), (missing, False)):
            replies = list(stub.Get(pb.GetRequest(keys=keys, max_chunk_bytes=LIMIT - (16 << 10)), timeout=60))
            assert all(r.ByteSize() <= LIMIT for r in replies)
            got = [c for r in replies for c in r.chunks]
            assert [c.key for c in got] == keys and all(c.found is found for c in got)
            if found:
                assert [c.data for c in got] == [tiny(k) for k in keys]


def test_a_client_with_a_smaller_limit_than_the_daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="64MiB", nvme=None))          # 64 MiB messages
    try:
        stored = stored_keys(2500)
        with client(d) as c:
            c.put([(k, tiny(k)) for k in stored])
            keys = [k for pair in zip(stored, missing_keys(2500)) for k in pair]
            got = c.get(keys)
            assert sum(g.found for g in got) == 2500 and len(got) == 5000
    finally:
        d.stop(0)


def test_a_message_over_the_limit_is_message_too_large_never_tier_full(small_node):
    with KVStoreClient(small_node.address, timeout=60) as big:          # 64 MiB client, 64 KiB daemon
        with pytest.raises(errors.MessageTooLarge, match="max_message_bytes"):
            big.put([(key(1), b"x" * (1 << 20))])
    with client(small_node) as c:
        with pytest.raises(errors.MessageTooLarge):                    # one hint with 3,000 prefix keys
            c.tool_call_start("T", "search", stored_keys(3000))
        assert c.put([(key(1), b"x" * (1 << 20))]).stored == 1       # chunked under the limit
        assert c.get([key(1)])[0].data == b"x" * (1 << 20)
        assert c.stats()["counters"].get("puts_rejected_full", 0) == 0


def test_max_chunk_bytes_follows_a_small_message_limit():
    from kvstore import config
    cfg = config.from_dict({"server": {"max_message_bytes": "64KiB"}})
    assert cfg.server.max_chunk_bytes == (64 << 10) - (16 << 10)
    assert config.from_dict({}).server.max_chunk_bytes == 1 << 20
    with pytest.raises(errors.ConfigError, match="max_chunk_bytes"):
        config.from_dict({"server": {"max_message_bytes": "64KiB", "max_chunk_bytes": "1MiB"}})
    assert KVStoreClient("unix:/nonexistent", max_message_bytes=LIMIT).chunk_bytes == LIMIT - (16 << 10)
