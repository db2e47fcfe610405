"""Fuzzing the gRPC API (hypothesis) against one running daemon.

Inputs: wrong key lengths, empty and oversized payloads, payload/size mismatches, chunk
offsets anywhere in uint64, byte ranges out of bounds or overlapping, request bytes that
do not decode, unknown fields, garbage bytes on the socket.

Each case checks: the status is one of the documented answers (never INTERNAL or
UNKNOWN), the daemon still serves, the sentinel blocks stored before the fuzzing are
unchanged, and a model of the fuzz keys agrees with the store (a block appears only
with the complete bytes of a block sent for it, and never changes afterwards).
"""

from __future__ import annotations

import os
import socket
import threading

import grpc
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.service.startup import start_server
from kvstore.service.server import MIN_CHUNK_BYTES
from rel_support import key, payload

FUZZ = settings(max_examples=int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "250")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                derandomize=True, database=None)
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
U64 = (1 << 64) - 1
SENTINELS = [(key(i, "sentinel"), payload(key(i, "sentinel"), 1000 + 997 * i)) for i in range(6)]
FUZZ_KEYS = [key(i, "fuzz") for i in range(12)]

CASES = {"n": 0}


class Store:
    """The daemon under fuzz, a stub, and the model of what the fuzz keys hold."""

    def __init__(self, tmp_path):
        self.daemon = start_server(daemon_config(tmp_path, host="32MiB", nvme="128MiB"))
        self.channel = grpc.insecure_channel(self.daemon.address)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.model: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.stub.PutInline(pb.PutBatch(chunks=[pb.PutChunk(key=k, total_size=len(v), data=v)
                                                for k, v in SENTINELS]), timeout=10)

    def close(self):
        self.channel.close()
        self.daemon.stop(0)

    def get_all(self, keys) -> dict[bytes, bytes]:
        """Whole blocks for ``keys`` (absent ones left out), reassembled from the stream."""
        out, parts = {}, {}
        for batch in self.stub.Get(pb.GetRequest(keys=keys), timeout=10):
            for c in batch.chunks:
                if not c.found:
                    continue
                parts.setdefault(c.key, []).append(c.data)
                if c.offset + len(c.data) >= c.total_size:
                    out[c.key] = b"".join(parts.pop(c.key))
        return out

    def check(self) -> None:
        """The daemon serves; sentinels unchanged; the fuzz keys hold what the model says."""
        CASES["n"] += 1
        got = self.get_all([k for k, _ in SENTINELS])
        assert got == dict(SENTINELS), "a sentinel block changed"
        now = self.get_all(FUZZ_KEYS)
        for k, v in self.model.items():
            assert now.get(k) == v, f"fuzz block {FUZZ_KEYS.index(k)} changed or vanished"
        unexpected = set(now) - set(self.model)
        assert not unexpected, "a fuzz block appeared that the model did not expect"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("fuzz"))
    yield s
    print(f"\nAPI fuzz: {CASES['n']} cases checked")
    s.close()


def code_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.details(), "an error without a message"
        return e.code()


# ---------------------------------------------------------------------------- strategies

any_key = st.one_of(st.sampled_from(FUZZ_KEYS), st.binary(max_size=40), st.just(b""),
                    st.binary(min_size=31, max_size=33))
good_key = st.sampled_from(FUZZ_KEYS)
sizes = st.one_of(st.integers(0, 9000), st.sampled_from([1 << 40, 1 << 63, U64]), st.integers(0, U64))


@st.composite
def chunk(draw):
    data = draw(st.binary(max_size=3000))
    total = draw(st.one_of(sizes, st.just(len(data)), st.just(len(data) + 1), st.just(max(len(data) - 1, 0))))
    offset = draw(st.one_of(st.just(0), st.integers(0, 9000), st.integers(0, U64)))
    return pb.PutChunk(key=draw(any_key), total_size=total, offset=offset, data=data)


@st.composite
def block_chunks(draw):
    """A well-formed block (1-4 chunks), sometimes damaged in one field."""
    k = draw(good_key)
    data = draw(st.binary(min_size=1, max_size=6000))
    cuts = sorted(set(draw(st.lists(st.integers(1, len(data)), max_size=3))) | {len(data)})
    out, start = [], 0
    for end in cuts:
        out.append(pb.PutChunk(key=k, total_size=len(data), offset=start, data=data[start:end]))
        start = end
    damage = draw(st.sampled_from(["none", "none", "drop", "size", "offset", "key", "swap"]))
    i = draw(st.integers(0, len(out) - 1))
    if damage == "drop" and len(out) > 1:
        del out[i]
    elif damage == "size":
        out[i].total_size = draw(sizes)
    elif damage == "offset":
        out[i].offset = draw(st.integers(0, U64))
    elif damage == "key":
        out[i].key = draw(any_key)
    elif damage == "swap" and len(out) > 1:
        out[0], out[-1] = out[-1], out[0]
    return out


put_streams = st.lists(st.one_of(block_chunks(), st.lists(chunk(), min_size=1, max_size=3)),
                       min_size=1, max_size=3).map(lambda parts: [c for p in parts for c in p])


def complete_blocks(chunks) -> dict[bytes, set[bytes]]:
    """For each key, the payloads of the complete, in-order chunk runs sent for it."""
    out: dict[bytes, set[bytes]] = {}
    for i, c in enumerate(chunks):
        if c.offset != 0 or c.total_size == 0:
            continue
        buf, total = bytearray(), c.total_size
        for d in chunks[i:]:
            if d.key != c.key or d.offset != len(buf) or d.total_size != total:
                break
            buf += d.data
            if len(buf) >= total:
                break
        if len(buf) == total:
            out.setdefault(c.key, set()).add(bytes(buf))
    return out


# ---------------------------------------------------------------------------- tests


@FUZZ
@given(chunks=put_streams, streamed=st.booleans())
def test_fuzz_put(store, chunks, streamed):
    if streamed:
        call = lambda: store.stub.Put(iter([pb.PutBatch(chunks=[c]) for c in chunks]), timeout=10)  # noqa: E731
    else:
        call = lambda: store.stub.PutInline(pb.PutBatch(chunks=chunks), timeout=10)  # noqa: E731
    code = code_of(call)
    event(code.name)
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.ALREADY_EXISTS}, code        # ALREADY_EXISTS: a key put with another size
    if any(len(c.key) != 32 for c in chunks[:1]):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    candidates = complete_blocks(chunks)
    now = store.get_all(FUZZ_KEYS)
    for k, v in now.items():
        if k in store.model:
            continue
        assert v in candidates.get(k, ()), "a block became visible without a complete payload sent for it"
        store.model[k] = v
    store.check()


@FUZZ
@given(keys=st.lists(st.one_of(any_key, st.sampled_from([k for k, _ in SENTINELS])), max_size=6),
       ranges=st.lists(st.tuples(st.one_of(st.integers(0, 5000), st.integers(0, U64)),
                                 st.one_of(st.integers(0, 3000), st.integers(0, U64))), max_size=4),
       stop_at_miss=st.booleans(),
       max_chunk=st.one_of(st.just(0), st.integers(256, 1 << 20), st.just(U64)))
def test_fuzz_get(store, keys, ranges, stop_at_miss, max_chunk):
    req = pb.GetRequest(keys=keys, ranges=[pb.ByteRange(offset=o, length=n) for o, n in ranges],
                        stop_at_miss=stop_at_miss, max_chunk_bytes=max_chunk)
    out = []

    def call():
        out.extend(store.stub.Get(req, timeout=10))

    code = code_of(call)
    event(code.name)
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, code
    if any(len(k) != 32 for k in keys):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    if code == grpc.StatusCode.OK:
        known = {**dict(SENTINELS), **store.model}
        blocks, parts = [], {}
        for batch in out:
            for c in batch.chunks:
                if max_chunk:
                    assert len(c.data) <= max_chunk
                if not c.found:
                    blocks.append((c.key, None))
                    continue
                parts.setdefault(c.key, []).append(c.data)
                if c.offset + len(c.data) >= c.total_size:
                    blocks.append((c.key, b"".join(parts.pop(c.key))))
        assert [k for k, _ in blocks] == keys[:len(blocks)]
        for k, v in blocks:
            if v is None:                   # not stored, or too short for the ranges
                assert k not in known or any(o + n > len(known[k]) for o, n in ranges)
                continue
            full = known[k]
            want = b"".join(full[o:o + n] for o, n in ranges) if ranges else full
            assert v == want
    store.check()


@FUZZ
@given(keys=st.lists(any_key, max_size=8), op=st.sampled_from(["lookup", "delete"]))
def test_fuzz_lookup_delete(store, keys, op):
    bad = any(len(k) != 32 for k in keys)
    if op == "lookup":
        reply = {}
        code = code_of(lambda: reply.setdefault("r", store.stub.Lookup(pb.LookupRequest(keys=keys), timeout=10)))
        if code == grpc.StatusCode.OK:
            hit = 0
            for k in keys:
                if k not in store.model:
                    break
                hit += 1
            assert reply["r"].hit_blocks == hit
    else:
        reply = {}
        code = code_of(lambda: reply.setdefault("r", store.stub.Delete(pb.DeleteRequest(keys=keys), timeout=10)))
        if code == grpc.StatusCode.OK:
            present = {k for k in keys if k in store.model}
            assert reply["r"].deleted == len(present)
            for k in present:
                del store.model[k]
    assert code == (grpc.StatusCode.INVALID_ARGUMENT if bad else grpc.StatusCode.OK), code
    store.check()


METHODS = {"Put": "stream_unary", "PutInline": "unary_unary", "Get": "unary_stream", "Lookup": "unary_unary",
           "Delete": "unary_unary", "Stats": "unary_unary", "ToolCallStart": "unary_unary",
           "Resume": "unary_unary", "Lease": "unary_unary", "Release": "unary_unary"}
ALLOWED_RAW = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}


def raw_call(store, method, messages: list[bytes]):
    kind = METHODS[method]
    call = getattr(store.channel, kind)(f"/kvstore.v1.KVStore/{method}", request_serializer=None,
                                        response_deserializer=None)
    if kind == "stream_unary":
        return code_of(lambda: call(iter(messages), timeout=10))
    if kind == "unary_stream":
        return code_of(lambda: list(call(messages[0], timeout=10)))
    return code_of(lambda: call(messages[0], timeout=10))


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), messages=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_fuzz_request_bytes(store, method, messages):
    """Arbitrary bytes as request messages: those that do not decode get INVALID_ARGUMENT."""
    assume(not any(k in m for m in messages for k, _ in SENTINELS))
    code = raw_call(store, method, messages)
    event(code.name)
    assert code in ALLOWED_RAW, (method, code)
    # blocks that random bytes managed to store are outside the fuzz keys (32 random bytes)
    store.check()


def test_undecodable_request_is_invalid_argument(store):
    for method in METHODS:
        code = raw_call(store, method, [b"\xff\xff\xff\xff"])   # a truncated varint field
        assert code == grpc.StatusCode.INVALID_ARGUMENT, method
    store.check()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@FUZZ
@given(field=st.integers(5, 1 << 20), value=st.integers(0, U64), wire=st.sampled_from([0, 2]))
def test_unknown_fields_and_enum_values_are_ignored(store, field, value, wire):
    """A newer client's fields (or enum numbers this daemon does not know) do not change
    what an otherwise valid request does."""
    extra = _varint(field << 3 | wire) + (_varint(value) if wire == 0 else _varint(3) + b"abc")
    k, v = SENTINELS[0]
    req = pb.GetRequest(keys=[k]).SerializeToString() + extra
    call = store.channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=None,
                                      response_deserializer=pb.GetBatch.FromString)
    batches = list(call(req, timeout=10))
    assert b"".join(c.data for b in batches for c in b.chunks) == v
    lookup = store.channel.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=None,
                                       response_deserializer=pb.LookupReply.FromString)
    assert lookup(pb.LookupRequest(keys=[k]).SerializeToString() + extra, timeout=10).hit_blocks == 1
    store.check()


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=4096), preface=st.booleans())
def test_garbage_bytes_on_the_socket(store, garbage, preface):
    path = store.daemon.address[len("unix:"):]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            if preface:                                   # a valid HTTP/2 start, then junk frames
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            s.sendall(garbage)
            s.recv(1024)
        except OSError:
            pass                                          # the server may drop us: that is fine
    store.check()


def test_tiny_and_huge_max_chunk_bytes(store):
    k, v = SENTINELS[-1]
    for m in (1, 7, U64):
        batches = list(store.stub.Get(pb.GetRequest(keys=[k], max_chunk_bytes=m), timeout=30))
        chunks = [c for b in batches for c in b.chunks]
        assert b"".join(c.data for c in chunks) == v
        assert all(len(c.data) <= max(m, MIN_CHUNK_BYTES) for c in chunks)   # below 4 KiB: taken as 4 KiB
    store.check()


def test_ranges_that_overlap_or_are_too_many_are_refused(store):
    k, v = SENTINELS[0]
    overlap = pb.GetRequest(keys=[k], ranges=[pb.ByteRange(offset=0, length=10), pb.ByteRange(offset=5, length=10)])
    assert code_of(lambda: list(store.stub.Get(overlap, timeout=10))) == grpc.StatusCode.INVALID_ARGUMENT
    many = pb.GetRequest(keys=[k], ranges=[pb.ByteRange(offset=i, length=1) for i in range(5000)])
    assert code_of(lambda: list(store.stub.Get(many, timeout=10))) == grpc.StatusCode.INVALID_ARGUMENT
    # disjoint, out of order, zero-length: fine and returned in the order asked
    ok = pb.GetRequest(keys=[k], ranges=[pb.ByteRange(offset=20, length=5), pb.ByteRange(offset=0, length=3),
                                         pb.ByteRange(offset=3, length=0)])
    data = b"".join(c.data for b in store.stub.Get(ok, timeout=10) for c in b.chunks)
    assert data == v[20:25] + v[0:3]
    store.check()
