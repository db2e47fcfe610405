"""A zero-copy put's Reserve and Commit as control frames on the arena session (issue 21).

A mapped client of a daemon that takes them makes no gRPC call on ``put_from``; what it
stores (bytes, sizes, router metadata) is what the gRPC path stores. The frames keep the
gRPC calls' guarantees: a Commit is all or none, a reservation is committed only by the
session that made it, a malformed frame is refused and the session goes on. A daemon that
does not take them is put through gRPC.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.common import arena_wire as w
from kvstore.common.errors import BlockNotFound, InvalidRequest
from kvstore.common.types import BlockMeta, ReserveStatus
from kvstore.service.startup import start_server
from support.daemon import daemon_config
from test_arena_control import BLOCK, DEADLINE_S, key, payloads


def forbid_grpc_puts(c: KVStoreClient) -> None:
    """Make the zero-copy put's gRPC Reserve and Commit (and the raw gRPC put it falls back
    to) fail the test."""
    put = c._arena_path._put

    def forbidden(*a, **kw):
        raise AssertionError("a zero-copy put went by gRPC")
    put.reserve = put.commit = put.raw_put = forbidden


@pytest.fixture(params=["table", "frames only"])
def d(request, tmp_path, monkeypatch):
    """Clients that read the block table (hello version 4) and clients that do not (version 3)."""
    if request.param == "frames only":
        monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")
    daemon = start_server(daemon_config(tmp_path, host="16MiB", nvme=None))
    yield daemon
    daemon.stop(0)


def test_put_from_makes_no_grpc_call_and_stores_what_the_grpc_path_stores(d):
    data = payloads(40, seed=3)
    keys = [key(i, "p") for i in range(40)]
    meta = [BlockMeta(engine_hash=bytes([i]) * 8, parent_engine_hash=bytes([i - 1]) * 8 if i else b"",
                      token_ids=(i, i + 1), block_tokens=2) if i % 2 else None for i in range(40)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as g:
        c.arena()
        assert c.arena().control is not None and c.arena().control.puts
        forbid_grpc_puts(c)
        r = c.put_from(keys, data, meta=meta)
        assert (r.stored, r.already_present, r.bytes_stored) == (40, 0, 40 * BLOCK)
        again = c.put_from(keys, data, meta=meta)
        assert (again.stored, again.already_present) == (0, 40)
        sizes = [100, 4096, 50_000]                           # sizes other than the slot's
        r = c.put_from([key(i, "s") for i in range(3)], data[:3].reshape(-1)[:sum(sizes)], sizes=sizes)
        assert r.stored == 3 and r.bytes_stored == sum(sizes)
        got = g.get(keys + [key(i, "s") for i in range(3)])
        assert [bytes(x.data) for x in got[:40]] == [bytes(row) for row in data]
        flat = data[:3].reshape(-1)
        assert [bytes(x.data) for x in got[40:]] == [bytes(flat[:100]), bytes(flat[100:4196]),
                                                     bytes(flat[4196:54196])]
    for i, k in enumerate(keys):
        stored = d.manager.catalogue.raw(k).meta
        if meta[i] is None:
            assert stored is None
        else:
            assert (stored.engine_hash, stored.parent_engine_hash) == (meta[i].engine_hash,
                                                                       meta[i].parent_engine_hash)


def test_a_commit_frame_is_all_or_none_and_belongs_to_its_session(d):
    data = payloads(3, seed=4)
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, KVStoreClient(d.address, timeout=DEADLINE_S) as other:
        arena, ch = c.arena(), c.arena().control
        ks = [key(i, "a") for i in range(3)]
        got = ch.reserve(ks[:2], [BLOCK, BLOCK], 0.0, None, DEADLINE_S)
        assert list(got.status) == [ReserveStatus.RESERVED] * 2 and got.detail == ""
        for i, off in enumerate(got.offsets):
            arena.array[off:off + BLOCK] = data[i]
        with pytest.raises(BlockNotFound):                       # ks[2] was never reserved: none stored
            ch.commit(ks, False, DEADLINE_S)
        assert c.lookup(ks).hit_blocks == 0
        got = ch.reserve(ks[:2], [BLOCK, BLOCK], 0.0, None, DEADLINE_S)     # the room is free again
        assert list(got.status) == [ReserveStatus.RESERVED] * 2
        with pytest.raises(BlockNotFound):                       # another session cannot commit them
            other.arena().control.commit(ks[:2], False, DEADLINE_S)
        for i, off in enumerate(got.offsets):
            arena.array[off:off + BLOCK] = data[i]
        assert ch.commit(ks[:2], False, DEADLINE_S) == (2, 2 * BLOCK)
        out = np.zeros((2, BLOCK), np.uint8)
        assert c.get_into(ks[:2], out).found == 2 and np.array_equal(out, data[:2])
        got = ch.reserve([ks[2]], [BLOCK], 0.0, None, DEADLINE_S)
        assert ch.commit([ks[2]], True, DEADLINE_S) == (0, 0)   # an abort
        assert c.lookup([ks[2]]).hit_blocks == 0
        again = ch.reserve([ks[0], ks[2]], [BLOCK, BLOCK], 0.0, None, DEADLINE_S)
        assert list(again.status) == [ReserveStatus.ALREADY_PRESENT, ReserveStatus.RESERVED]
        ch.commit([ks[2]], True, DEADLINE_S)


def raw_frame(op: int, flags: int, count: int, payload: bytes, key_bytes: int = 32):
    return lambda seq: w.HEADER.pack(w.HEADER_BYTES - w.LENGTH.size + len(payload), op, flags, key_bytes, 0,
                                     seq, count) + payload


def test_malformed_put_frames_are_refused_and_the_session_goes_on(d):
    k = key(1, "m")
    ttl = w.RESERVE_ARGS.pack(0.0)
    bad = {
        "count larger than the keys": raw_frame(w.RESERVE, 0, 2, ttl + struct.pack("<2Q", BLOCK, BLOCK) + k),
        "keys of 31 bytes": raw_frame(w.RESERVE, 0, 1, ttl + struct.pack("<Q", BLOCK) + k[:31], key_bytes=31),
        "a size of 0": raw_frame(w.RESERVE, 0, 1, ttl + struct.pack("<Q", 0) + k),
        "a TTL that is not a number": raw_frame(w.RESERVE, 0, 1, struct.pack("<d", float("nan"))
                                                + struct.pack("<Q", BLOCK) + k),
        "metadata cut short": raw_frame(w.RESERVE, w.META, 1, ttl + struct.pack("<Q", BLOCK) + k
                                        + struct.pack("<I", 100) + b"x"),
        "metadata that does not decode": raw_frame(w.RESERVE, w.META, 1, ttl + struct.pack("<Q", BLOCK) + k
                                                   + struct.pack("<I", 3) + b"\xff\xff\xff"),
        "bytes after the metadata": raw_frame(w.RESERVE, w.META, 1, ttl + struct.pack("<Q", BLOCK) + k
                                              + struct.pack("<I", 0) + b"zz"),
        "a commit naming a key twice": raw_frame(w.COMMIT, 0, 2, k + k),
        "a commit of 31-byte keys": raw_frame(w.COMMIT, 0, 1, k[:31], key_bytes=31),
    }
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        ch = c.arena().control
        for what, frame in bad.items():
            with pytest.raises(InvalidRequest):
                ch._call(frame, w.RESERVE if frame(0)[4] == w.RESERVE else w.COMMIT, DEADLINE_S)
            assert ch.usable(), what
        assert c.lookup([k]).hit_blocks == 0
        data = payloads(4, seed=5)
        forbid_grpc_puts(c)
        assert c.put_from([key(i, "m") for i in range(4)], data).stored == 4


def test_a_daemon_that_takes_no_put_frames_is_put_through_grpc(d):
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        ch = c.arena().control
        ch.puts = False                                          # as a daemon of the previous release says

        def refuse(*a, **kw):
            raise AssertionError("a put frame sent to a daemon that takes none")
        ch.reserve = ch.commit = refuse
        data = payloads(6, seed=6)
        keys = [key(i, "o") for i in range(6)]
        assert c.put_from(keys, data).stored == 6
        out = np.zeros((6, BLOCK), np.uint8)
        assert c.get_into(keys, out).found == 6 and np.array_equal(out, data)


@pytest.mark.parametrize("metas", [None, [b""], [b"m" * 5, b"", b"x" * 300]])
def test_the_reserve_frame_length_the_client_checks_is_the_frames(metas):
    n = len(metas) if metas else 3
    frame = w.reserve_frame(7, [key(i) for i in range(n)], [BLOCK] * n, 5.0, metas)
    assert w.reserve_frame_length(n, metas) == w.LENGTH.unpack_from(frame)[0] == len(frame) - w.LENGTH.size
