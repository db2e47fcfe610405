"""The client checks its buffers, slots, ranges and metas alike on every call (a newcomer's test).

1. A non-contiguous payload (a transposed or strided view) is refused with the same
   InvalidRequest by ``put``, ``put_from`` and ``get_into``, on the raw gRPC path and the
   shared-memory path, before anything is sent; ``put`` failed with the bare
   ``UNKNOWN: Exception iterating requests!`` (raised inside gRPC's request iterator). No
   exception raised while a put's messages are built loses its cause.
2. ``get_into`` refuses destination slots that overlap (equal offsets, a block longer than
   the room up to the next offset, buffers sharing memory) instead of letting one block
   overwrite another; ``put_from`` sources may overlap (only read).
3. A range past the end of a block is a miss for that block, as the daemon documents, and
   the docstrings of ``get`` and ``get_into`` say so.
4. Every put path refuses a meta list whose length is not the number of blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.client.leased_read import ReadStage
from kvstore.common.errors import InvalidRequest, KVStoreError
from kvstore.common.types import BlockMeta
from kvstore.service.startup import start_server
from support.daemon import daemon_config

A, B, C = b"a" * 100, b"b" * 100, bytes(range(200))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def fresh(client, i: int) -> bytes:
    """A key that no other test, nor this test with the other client, stores."""
    return key(1000 * (1 + client.shared_memory) + i)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = start_server(daemon_config(tmp_path_factory.mktemp("inputs"), host="16MiB", nvme=None))
    with KVStoreClient(d.address, timeout=20, shared_memory=False) as c:
        assert c.put([(key(1), A), (key(2), B), (key(3), C)]).stored == 3
    yield d
    d.stop(0)


@pytest.fixture(params=[True, False], ids=["shared", "grpc"])
def client(node, request):
    with KVStoreClient(node.address, timeout=20, shared_memory=request.param) as c:
        assert c.shared_memory is request.param
        yield c


def stored(d) -> list[bytes]:
    with d.manager.lock:
        return sorted(d.manager.catalogue.keys())


# ------------------------------------------------------------------ 1: non-contiguous buffers

def test_a_non_contiguous_buffer_is_the_same_invalid_request_on_every_call(node, client):
    view = np.arange(100, dtype=np.uint8).reshape(10, 10)[:, ::2]      # a column slice: not contiguous
    assert not view.flags.c_contiguous
    before = stored(node)
    for call, needle in (
            (lambda: client.put([(key(10), view)]), "the payload of item 0: numpy arrays passed"),
            (lambda: client.put([(key(10), b"x"), (key(11), view.T)]), "the payload of item 1: numpy arrays"),
            (lambda: client.put([(key(10), memoryview(view))]), "the payload of item 0: buffers passed"),
            (lambda: client.put_from([key(10)], view[None]), "^numpy arrays passed"),
            (lambda: client.put_from([key(10)], [view]), "^buffer 0: numpy arrays passed"),
            (lambda: client.get_into([key(1)], view[None]), "^numpy arrays passed"),
            (lambda: client.get_into([key(1), key(2)], [np.zeros(100, np.uint8), view]), "^buffer 1: numpy")):
        with pytest.raises(InvalidRequest, match=needle) as e:
            call()
        assert type(e.value) is InvalidRequest
        assert "must be C-contiguous (a transposed or strided view is not; np.ascontiguousarray" in str(e.value)
    assert stored(node) == before
    assert view.sum() == sum(range(0, 100, 2))                          # nothing was written into it
    # the same bytes made contiguous are stored as they are
    assert client.put([(fresh(client, 12), np.ascontiguousarray(view))]).stored == 1
    assert client.get([fresh(client, 12)])[0].data == bytes(range(0, 100, 2))


def test_a_0_d_payload_is_refused_by_put_as_by_put_from(node, client):
    for call in (lambda: client.put([(key(13), np.array(5, np.uint8))]),
                 lambda: client.put_from([key(13)], np.array(5, np.uint8))):
        with pytest.raises(InvalidRequest, match="0-d ndarray"):
            call()
    assert key(13) not in stored(node)


def test_an_error_while_a_put_builds_its_messages_keeps_its_cause(node):
    """The frames are packed on gRPC's thread; a limit too small for one frame raised there."""
    with KVStoreClient(node.address, timeout=20, shared_memory=False) as c:
        c.max_message_bytes = 50                                        # the setter takes any int
        with pytest.raises(InvalidRequest, match="could not be built: ValueError: frame limit 50") as e:
            c.put([(key(14), b"x" * 10)])
    assert type(e.value.__cause__) is ValueError
    assert "Exception iterating requests" not in str(e.value)
    assert key(14) not in stored(node)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "grpc"])
def test_a_meta_that_cannot_be_sent_is_refused_before_anything_is_sent(node, shared):
    huge = BlockMeta(engine_hash=b"e", token_ids=(300,) * 70_000)      # 140,000 bytes encoded
    with KVStoreClient(node.address, timeout=20, shared_memory=False, max_message_bytes=64 << 10) as c:
        with pytest.raises(InvalidRequest, match=r"the meta of block 0 is 14\d{4} bytes encoded: more than one "
                                                 r"65536-byte message holds"):
            c.put([(key(15), b"x" * 10)], meta=[huge])
    with KVStoreClient(node.address, timeout=20, shared_memory=shared) as c:
        for call in (lambda: c.put([(key(15), b"x")], meta=[{"engine_hash": b"e"}]),
                     lambda: c.put_from([key(15)], b"x", meta=[{"engine_hash": b"e"}])):
            with pytest.raises(InvalidRequest, match=r"meta\[0\] is not a BlockMeta or None \(AttributeError") as e:
                call()
            assert type(e.value.__cause__) is AttributeError
        with pytest.raises(InvalidRequest, match=r"meta\[0\] is not a BlockMeta or None \(TypeError"):
            c.put_from([key(15)], b"x", meta=[BlockMeta(engine_hash="not bytes")])
    assert key(15) not in stored(node)


# ------------------------------------------------------------------ 2: overlapping destinations

def test_get_into_refuses_overlapping_offsets_before_anything_is_read(client):
    out = np.zeros(150, np.uint8)
    with pytest.raises(InvalidRequest, match=r"^block 0 \(100 bytes at offset 0\) does not fit its 50-byte slot "
                                             r"of the 150-byte buffer \(it ends where the block at the next"):
        client.get_into([key(1), key(2)], out, offsets=[0, 50])
    assert not out.any()                                                # block 0 was never written
    with pytest.raises(InvalidRequest, match=r"^offsets\[1\] is 0, as offsets\[0\]: two blocks cannot"):
        client.get_into([key(1), key(2)], out, offsets=[0, 0])
    with pytest.raises(InvalidRequest, match=r"^offsets\[2\] is 7, as offsets\[0\]"):
        client.get_into([key(1), key(2), key(3)], np.zeros(300, np.uint8), offsets=[7, 200, 7])
    with pytest.raises(InvalidRequest, match=r"^block 0 \(60 bytes at offset 0\) does not fit its 50-byte slot"):
        client.get_into([key(1), key(2)], out, offsets=[0, 50], ranges=[(0, 60)])     # sizes known: checked first
    assert not out.any()
    with pytest.raises(InvalidRequest, match=r"^block 1 \(100 bytes at offset 0\) does not fit its 50-byte slot"):
        client.get_into([key(1), key(2)], out, offsets=[50, 0])         # block 1 would overwrite block 0
    assert not out[:50].any()
    out[:] = 0
    r = client.get_into([key(2), key(1)], out, offsets=[0, 50], ranges=[(10, 40)])
    assert (r.found, r.sizes) == (2, [40, 40])
    assert out.tobytes() == B[10:50] + bytes(10) + A[10:50] + bytes(60)
    # put_from's sources at the same overlapping (and repeated) offsets are fine: only read
    keys = [fresh(client, 20), fresh(client, 21), fresh(client, 22)]
    assert client.put_from(keys, np.frombuffer(C, np.uint8), sizes=100, offsets=[0, 50, 0]).stored == 3
    assert [g.data for g in client.get(keys)] == [C[:100], C[50:150], C[:100]]


def test_get_into_places_blocks_at_unordered_offsets_exactly(client):
    out = np.zeros(250, np.uint8)
    r = client.get_into([key(1), key(2)], out, offsets=[150, 20])
    assert (r.found, r.sizes) == (2, [100, 100])
    assert out.tobytes() == bytes(20) + B + bytes(30) + A
    with pytest.raises(InvalidRequest, match=r"^block 1 \(100 bytes at offset 20\) does not fit its 80-byte slot"):
        client.get_into([key(1), key(2)], np.zeros(250, np.uint8), offsets=[100, 20])


def test_get_into_refuses_buffers_that_share_memory(client):
    buf = np.zeros(200, np.uint8)
    for bufs, needle in (([buf[:100], buf[50:150]], "buffers 0 and 1 overlap"),
                         ([buf[100:], buf[:100], buf[:100]], "buffers 1 and 2 overlap"),
                         ([buf[:150], buf[150:], buf[10:20]], "buffers 0 and 2 overlap")):
        with pytest.raises(InvalidRequest, match=f"^{needle}: each block is written into memory of its own"):
            client.get_into([key(1), key(2), key(3)][:len(bufs)], bufs)
        assert not buf.any()
    r = client.get_into([key(1), key(2)], [buf[100:], buf[:100]])       # touching, not overlapping
    assert r.found == 2 and buf.tobytes() == B + A


def test_a_leased_read_refuses_overlapping_slots_in_any_stage(client):
    out = np.zeros(150, np.uint8)
    with pytest.raises(InvalidRequest, match=r"^block 0 \(100 bytes at offset 0\) does not fit its 50-byte slot"):
        client.leased_read([key(1), key(2)], [ReadStage([(0, 100)], out, offsets=[0, 50])])
    with pytest.raises(InvalidRequest, match=r"^block 2 \(100 bytes at offset 100\) does not fit its 50-byte slot"):
        client.leased_read([key(1), key(2), key(3)], [ReadStage([(0, 100)], np.zeros(300, np.uint8),
                                                                offsets=[0, 150, 100])])
    with pytest.raises(InvalidRequest, match="buffers 0 and 1 overlap"):
        client.leased_read([key(1), key(2)], [ReadStage([(0, 10)], [out[:20], out[10:30]])])
    read = client.leased_read([key(1), key(2)], [ReadStage([(0, 50)], out, offsets=[50, 0])])
    assert read.run() == [[50, 50]] and out.tobytes() == B[:50] + A[:50] + bytes(50)


# ------------------------------------------------------------------ 3: a range past a block's end

def test_a_range_past_the_end_of_a_block_is_a_miss_for_that_block_alone(client):
    got = client.get([key(1), key(3)], ranges=[(90, 20)])               # 100 and 200 bytes
    assert [(g.found, g.data) for g in got] == [(False, b""), (True, C[90:110])]
    out = np.zeros((2, 20), np.uint8)
    r = client.get_into([key(1), key(3)], out, ranges=[(90, 20)], stop_at_miss=False)
    assert (r.found, r.sizes) == (1, [0, 20]) and out[1].tobytes() == C[90:110]
    assert client.get_into([key(1), key(3)], out, ranges=[(90, 20)]).found == 0
    for doc in (KVStoreClient.get.__doc__, KVStoreClient.get_into.__doc__):
        assert "range outside a block" not in doc
        assert "block too short for ``ranges`` (a range past its end) is a miss, not an error" in doc


# ------------------------------------------------------------------ 4: one meta per block

def test_every_put_path_refuses_a_meta_count_other_than_the_blocks(node, client):
    k = [fresh(client, i) for i in range(30, 34)]
    before = stored(node)
    for call, needle in (
            (lambda: client.put([(k[0], b"x")], meta=[None, None]), "^2 block metas for 1 keys$"),
            (lambda: client.put([(k[0], b"x"), (k[1], b"y")], meta=[None]), "^1 block metas for 2 keys$"),
            (lambda: client.put([(k[0], b"x")], meta=[]), "^0 block metas for 1 keys$"),
            (lambda: client.put([], meta=[None]), "^1 block metas for 0 keys$"),
            (lambda: client.put([(k[0], b"x")], meta=BlockMeta()), "^meta: a list of block metas"),
            (lambda: client.put_from([k[0]], b"x", meta=[None, None]), "^2 block metas for 1 keys$"),
            (lambda: client.put_from([], b"", meta=[None]), "^1 block metas for 0 keys$")):
        with pytest.raises(InvalidRequest, match=needle):
            call()
    assert stored(node) == before
    metas = [BlockMeta(engine_hash=b"e30"), None]
    assert client.put([(k[0], b"x"), (k[1], b"y")], meta=iter(metas)).stored == 2
    assert client.put_from(k[2:], b"zw", meta=metas).stored == 2
    with node.manager.lock:
        assert [node.manager.catalogue.raw(x).meta.engine_hash for x in (k[0], k[2])] == [b"e30", b"e30"]


def test_a_refused_put_is_never_the_base_store_error(client):
    with pytest.raises(KVStoreError) as e:
        client.put([(key(40), np.zeros((4, 4), np.uint8)[:, 1])])
    assert type(e.value) is InvalidRequest
