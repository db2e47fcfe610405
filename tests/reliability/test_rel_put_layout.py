"""A put message that cannot finish the blocks it starts is refused before any of them
reserves room (a reservation evicts other blocks for bytes that never come: one PutInline
chunk claiming a 15 MiB block emptied a full NVMe tier); a raw frame's record lengths are
whole numbers (one of 2**64 - 64 passed as -64 and moved the payload cursor back); a put the
client cancels ends without an error logged; a Get's chunks are at least 4 KiB."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common.wire import HEADER, MAGIC, RECORD, FrameError, decode, encode
from kvstore.service.server import MIN_CHUNK_BYTES
from rel_support import key

INVALID = grpc.StatusCode.INVALID_ARGUMENT
MiB = 1 << 20
DATA = "/kvstore.v1.KVStoreData/"


@pytest.fixture
def node(tmp_path):
    from kvstore.service.startup import start_server
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="16MiB"))
    ch = grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 64 << 20)])
    yield d, pb_grpc.KVStoreStub(ch), ch
    ch.close()
    d.stop(0)


def stored(d) -> list[bytes]:
    with d.manager.lock:
        return sorted(d.manager.catalogue.keys())


def fill(d) -> dict[bytes, bytes]:
    """14 blocks of 1 MiB: the host tier and most of the NVMe tier hold them."""
    blocks = {key(i, "fill"): bytes([i]) * MiB for i in range(14)}
    with KVStoreClient(d.address, shared_memory=False) as c:
        assert c.put(list(blocks.items())).stored == len(blocks)
    assert set(blocks) <= set(stored(d))
    return blocks


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == INVALID, e.value
    return e.value


def chunk(k: bytes, total: int, offset: int, data: bytes) -> pb.PutChunk:
    return pb.PutChunk(key=k, total_size=total, offset=offset, data=data)


def unchanged(d, before: list[bytes], blocks: dict[bytes, bytes]) -> None:
    assert stored(d) == before
    with KVStoreClient(d.address, shared_memory=False) as c:
        got = c.get(list(blocks))
    assert [bytes(g.data) for g in got] == list(blocks.values())


def test_put_inline_of_a_block_it_does_not_hold_evicts_nothing(node):
    d, stub, _ = node
    blocks = fill(d)
    before = stored(d)
    err = refused(lambda: stub.PutInline(pb.PutBatch(chunks=[chunk(key(99), 15 * MiB, 0, b"x")]), timeout=30))
    assert "ends inside block" in err.details()
    # the first block complete, the second one not: neither is stored
    err = refused(lambda: stub.PutInline(pb.PutBatch(chunks=[chunk(key(98), 3, 0, b"abc"),
                                                             chunk(key(99), 15 * MiB, 0, b"x")]), timeout=30))
    unchanged(d, before, blocks)


@pytest.mark.parametrize("raw", [False, True])
def test_a_stream_message_that_leaves_a_block_unfinished_evicts_nothing(node, raw):
    d, stub, ch = node
    blocks = fill(d)
    done = key(1, "done")
    first = [(done, 3, 0, b"abc")]
    # a 15 MiB block begun with one byte, then another block in the same message
    bad = [(key(2, "big"), 15 * MiB, 0, b"x"), (key(3, "next"), 3, 0, b"def")]
    if raw:
        call = ch.stream_unary(DATA + "PutRaw")
        frames = [encode([(k, 0, 0, t, o, v) for k, t, o, v in m]) for m in (first, bad)]
        err = refused(lambda: call(iter(frames), timeout=30))
    else:
        msgs = [pb.PutBatch(chunks=[chunk(*c) for c in m]) for m in (first, bad)]
        err = refused(lambda: stub.Put(iter(msgs), timeout=30))
    assert "ends after 1 of its" in err.details(), err.details()
    assert done in stored(d)                 # complete in an earlier message: stored
    unchanged(d, sorted(set(stored(d))), blocks)
    assert set(stored(d)) == set(blocks) | {done}


@pytest.mark.parametrize("raw", [False, True])
def test_a_block_spanning_messages_is_stored(node, raw):
    d, stub, ch = node
    k, data = key(7, "span"), bytes(range(256)) * 40
    parts = [data[:1000], data[1000:7000], data[7000:]]
    offsets = [0, 1000, 7000]
    other = key(8, "span")
    if raw:
        frames = [encode([(k, 0, 0, len(data), o, p)]) for o, p in zip(offsets, parts)]
        frames[-1] = encode([(k, 0, 0, len(data), 7000, parts[2]), (other, 0, 0, 2, 0, b"zz")])
        pb.PutReply.FromString(ch.stream_unary(DATA + "PutRaw")(iter(frames), timeout=30))
    else:
        msgs = [pb.PutBatch(chunks=[chunk(k, len(data), o, p)]) for o, p in zip(offsets, parts)]
        msgs[-1].chunks.append(chunk(other, 2, 0, b"zz"))
        assert stub.Put(iter(msgs), timeout=30).stored == 2
    with KVStoreClient(d.address, shared_memory=False) as c:
        assert [bytes(g.data) for g in c.get([k, other])] == [data, b"zz"]


def test_a_record_length_past_the_frame_is_refused(node):
    d, _, ch = node
    k1, k2 = key(1, "wrap"), key(2, "wrap")
    payload = b"0123456789"
    records = [(k1, 0, 0, 10, 0, (1 << 64) - 64), (k2, 0, 0, 74, 0, 74)]
    frame = bytearray(HEADER.pack(MAGIC, 2))
    for kk, flags, tier, total, offset, n in records:
        frame += RECORD.pack(kk, flags, tier, 0, 0, total, offset, n)
    frame += payload
    with pytest.raises(FrameError, match="records say"):
        decode(bytes(frame))
    before = stored(d)
    refused(lambda: ch.stream_unary(DATA + "PutRaw")(iter([bytes(frame)]), timeout=30))
    assert stored(d) == before


def test_a_cancelled_put_logs_no_error(node, caplog):
    d, stub, _ = node
    caplog.set_level(logging.INFO)
    sent, hold = threading.Event(), threading.Event()

    def messages():
        yield pb.PutBatch(chunks=[chunk(key(5, "cancel"), 2 * MiB, 0, b"x" * MiB)])
        sent.set()
        hold.wait(60)

    def ended() -> int:
        return sum("ended in the transport" in r.getMessage() for r in caplog.records)
    for i in range(3):
        sent.clear()
        fut = stub.Put.future(messages(), timeout=60)
        assert sent.wait(60)
        fut.cancel()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and ended() <= i:
            time.sleep(0.05)
        assert ended() == i + 1
    hold.set()
    time.sleep(0.5)                           # grpc logs a failed reply after the handler returns
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert key(5, "cancel") not in stored(d)


def test_get_chunks_are_at_least_4_kib(node):
    d, stub, _ = node
    data = bytes(range(256)) * 40           # 10,240 bytes
    with KVStoreClient(d.address, shared_memory=False) as c:
        c.put([(key(6, "chunks"), data)])
    for asked in (1, 100, MIN_CHUNK_BYTES, 5000):
        chunks = [c for b in stub.Get(pb.GetRequest(keys=[key(6, "chunks")], max_chunk_bytes=asked), timeout=30)
                  for c in b.chunks]
        step = max(asked, MIN_CHUNK_BYTES)
        assert [len(c.data) for c in chunks] == [min(step, len(data) - o) for o in range(0, len(data), step)]
        assert b"".join(c.data for c in chunks) == data


def test_the_chunk_floor_keeps_frames_within_a_small_clients_limit(node):
    """The floor raises pieces, not the frame limit: a client whose messages are limited to
    17 KiB (chunk_bytes 1 KiB) still gets every block (frames of several small blocks had
    grown to the floor plus framing, past its limit)."""
    d, _, _ = node
    blocks = [(key(i, "small-limit"), bytes([i]) * 3000) for i in range(8)] + [(key(99, "small-limit"), b"z" * 9000)]
    with KVStoreClient(d.address, shared_memory=False) as c:
        assert c.put(blocks).stored == len(blocks)
    with KVStoreClient(d.address, shared_memory=False, max_message_bytes=17 << 10) as c:
        assert [bytes(g.data) for g in c.get([k for k, _ in blocks])] == [v for _, v in blocks]
