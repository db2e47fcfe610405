"""gRPC daemon: round trips, chunking, error codes, auth, health, restart."""

import os
import pathlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.daemon import daemon_config
from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from tiers.base import TierKind


def K(i):
    return i.to_bytes(4, "big") * 8


def test_put_get_lookup_delete_stats(client):
    blocks = [(K(i), os.urandom(1000 + i)) for i in range(5)]
    res = client.put(blocks)
    assert (res.stored, res.already_present, res.bytes_stored) == (5, 0, sum(len(b) for _, b in blocks))
    assert client.put(blocks[:2]).already_present == 2
    got = client.get([k for k, _ in blocks])
    assert [g.data for g in got] == [b for _, b in blocks]
    assert all(g.tier == TierKind.HOST for g in got)
    lk = client.lookup([K(0), K(1), K(99), K(3)])
    assert lk.hit_blocks == 2 and lk.tiers == (TierKind.HOST, TierKind.HOST)
    assert client.delete([K(0), K(99)]) == 1
    assert client.lookup([K(0)]).hit_blocks == 0
    stats = client.stats()
    assert [t["name"] for t in stats["tiers"]] == ["host", "nvme"]
    assert stats["tiers"][0]["blocks"] == 4
    assert stats["counters"]["blocks_put"] == 5


def test_get_misses_and_stop_at_miss(client):
    client.put([(K(1), b"a" * 10), (K(3), b"c" * 10)])
    res = client.get([K(1), K(2), K(3)])
    assert [r.found for r in res] == [True, False, True]
    res = client.get([K(1), K(2), K(3)], stop_at_miss=True)
    assert [r.found for r in res] == [True, False]


def test_large_block_is_chunked_both_ways(daemon):
    data = os.urandom(3 * (1 << 20) + 17)
    with KVStoreClient(daemon.address, chunk_bytes=1 << 20) as c:
        assert c.put([(K(1), data), (K(2), data[:5])]).stored == 2
        got = c.get([K(1), K(2)])
    assert got[0].data == data and got[1].data == data[:5]


def test_byte_ranges(client):
    data = bytes(range(256)) * 4
    client.put([(K(1), data)])
    got = client.get([K(1)], ranges=[(0, 4), (1000, 24)])[0]
    assert got.data == data[:4] + data[1000:1024]
    # a block too short for the ranges is a miss for that block, not an error for the call
    client.put([(K(2), data * 2)])
    got = client.get([K(1), K(2)], ranges=[(1020, 8)])
    assert [g.found for g in got] == [False, True] and got[1].data == (data * 2)[1020:1028]


def raw_put(address, chunks):
    """Send each chunk as its own streamed batch (exercises the streaming path)."""
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVStoreStub(ch).Put((pb.PutBatch(chunks=[c]) for c in chunks), timeout=10)


@pytest.mark.parametrize("chunks,code", [
    ([pb.PutChunk(key=b"x" * 31, total_size=4, offset=0, data=b"abcd")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=8, offset=0, data=b"abcd")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=2, offset=0, data=b"abcd")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=4, offset=2, data=b"ab")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=0, offset=0, data=b"")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=8, offset=0, data=b"abcd"),
      pb.PutChunk(key=K(2), total_size=4, offset=0, data=b"abcd")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=8, offset=0, data=b"abcd"),
      pb.PutChunk(key=K(1), total_size=9, offset=4, data=b"abcd")], grpc.StatusCode.INVALID_ARGUMENT),
    ([pb.PutChunk(key=K(1), total_size=1 << 40, offset=0, data=b"a")], grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_put_errors_map_to_status_codes(daemon, chunks, code):
    used_before = [t.used_bytes for t in daemon.manager.tiers]
    with pytest.raises(grpc.RpcError) as e:
        raw_put(daemon.address, chunks)
    assert e.value.code() == code
    assert e.value.details()
    assert [t.used_bytes for t in daemon.manager.tiers] == used_before
    # nothing half-written is visible and the daemon still serves
    with KVStoreClient(daemon.address) as c:
        assert c.lookup([K(1)]).hit_blocks == 0
        assert c.put([(K(1), b"ok")]).stored == 1


def test_reservation_released_after_bad_stream(daemon):
    before = daemon.manager.tiers[0].used_bytes
    with pytest.raises(grpc.RpcError):
        raw_put(daemon.address, [pb.PutChunk(key=K(9), total_size=4096, offset=0, data=b"a" * 100)])
    assert daemon.manager.tiers[0].used_bytes == before


def test_bad_keys_in_get_lookup_delete(client):
    for call in (lambda: client.get([b"k"]), lambda: client.lookup([b"k" * 33]), lambda: client.delete([b""])):
        with pytest.raises(errors.InvalidRequest, match="32 bytes"):
            call()


def test_health_service(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unix_socket_is_private(daemon):
    path = pathlib.Path(daemon.address[len("unix:"):])
    assert path.stat().st_mode & 0o077 == 0


def test_bearer_token(tmp_path):
    d = start_server(daemon_config(tmp_path, extra={"server": {"auth_token": "s3cret-of-16-chars"}}))
    try:
        with KVStoreClient(d.address) as c, pytest.raises(errors.Unauthenticated):
            c.lookup([K(1)])
        with KVStoreClient(d.address, auth_token="wrong") as c, pytest.raises(errors.Unauthenticated):
            c.put([(K(1), b"x")])
        with KVStoreClient(d.address, auth_token="wrong") as c, pytest.raises(errors.Unauthenticated):
            c.get([K(1)])
        with KVStoreClient(d.address, auth_token="s3cret-of-16-chars") as c:
            assert c.put([(K(1), b"x")]).stored == 1
            assert c.get([K(1)])[0].data == b"x"
    finally:
        d.stop(0)


def test_restart_serves_nvme_blocks_and_corrupt_file_misses(tmp_path):
    cfg = daemon_config(tmp_path, host="1MiB", nvme="16MiB")
    blocks = [(K(i), os.urandom(128 << 10)) for i in range(20)]
    d = start_server(cfg)
    with KVStoreClient(d.address) as c:
        c.put(blocks)
        on_nvme = [k for k, _ in blocks if d.manager.tier_of(k) == TierKind.NVME]
    d.stop(0)
    assert len(on_nvme) >= 10
    # flip a payload byte in one NVMe block file (the payload starts after the 4 KiB header)
    victim = on_nvme[0]
    files = [p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file() and victim.hex() in p.name]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[4096 + 100] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    d = start_server(cfg)
    try:
        with KVStoreClient(d.address) as c:
            got = c.get(on_nvme)
        expected = dict(blocks)
        assert [g.found for g in got] == [False] + [True] * (len(on_nvme) - 1)
        assert all(g.data == expected[g.key] for g in got[1:])
        assert d.manager.counters["corrupt_blocks"] == 1
    finally:
        d.stop(0)


def test_tool_call_hints_need_prefetch_or_next_use(tmp_path, daemon):
    with KVStoreClient(daemon.address) as c, pytest.raises(errors.KVStoreError, match="FAILED_PRECONDITION"):
        c.tool_call_start("t1", "search", [K(1)])
    d = start_server(daemon_config(tmp_path / "second", extra={"policy": {"eviction": "next_use"}}))
    try:
        with KVStoreClient(d.address) as c:
            c.put([(K(1), b"x" * 10)])
            assert c.lookup([K(1)]).hit_blocks == 1
            predicted = c.tool_call_start("t1", "search", [K(1)])
            assert predicted > 0
            known, observed = c.resume("t1")
            assert known and observed >= 0
            assert c.resume("never-started")[0] is False
    finally:
        d.stop(0)


def test_listen_path_that_is_not_a_socket_is_left_alone(tmp_path):
    keep = tmp_path / "important.txt"
    keep.write_text("data")
    cfg = daemon_config(tmp_path, extra={"server": {"listen": f"unix:{keep}"}})
    with pytest.raises(errors.ConfigError, match="not a socket"):
        start_server(cfg)
    assert keep.read_text() == "data"


def test_second_daemon_on_one_socket_is_refused_and_first_keeps_its_socket(tmp_path):
    first = start_server(daemon_config(tmp_path / "a"))
    try:
        second_cfg = daemon_config(tmp_path / "b", extra={"server": {"listen": first.address}})
        with pytest.raises(errors.ConfigError, match="another daemon"):
            start_server(second_cfg)
        with KVStoreClient(first.address) as c:   # the refused start removed nothing
            assert c.put([(K(1), b"x")]).stored == 1
    finally:
        first.stop(0)
    assert not pathlib.Path(first.address[len("unix:"):]).exists()


def test_tcp_port_in_use_is_a_config_error(tmp_path):
    import socket
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(errors.ConfigError, match="cannot bind"):
            start_server(daemon_config(tmp_path, extra={"server": {"listen": f"127.0.0.1:{port}"}}))
    finally:
        holder.close()


def test_stalled_put_streams_are_cancelled_and_do_not_starve_others(tmp_path):
    import threading
    cfg = daemon_config(tmp_path, extra={"server": {"workers": 2, "stream_idle_timeout_s": 0.5},
                                         "store": {"writer_wait_s": 0.25}})
    d = start_server(cfg)
    release = threading.Event()
    outcomes = []

    def stalled(i):
        def chunks():
            yield pb.PutBatch(chunks=[pb.PutChunk(key=K(100 + i), total_size=8, offset=0, data=b"abcd")])
            release.wait(60)          # the client stops sending mid-block
        try:
            with grpc.insecure_channel(d.address) as ch:
                pb_grpc.KVStoreStub(ch).Put(chunks(), timeout=60)
            outcomes.append("ok")
        except grpc.RpcError as e:
            outcomes.append(e.code())

    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(2)]   # every worker busy
    try:
        for t in threads:
            t.start()
        with KVStoreClient(d.address, timeout=60) as c:
            assert c.stats()["tiers"]                 # answered once the idle streams are cancelled
            assert c.lookup([K(100), K(101)]).hit_blocks == 0
        for _ in range(1200):                          # the second one goes at its own deadline
            if d.service.streams.cancelled == 2:
                break
            threading.Event().wait(0.05)
        assert d.service.streams.cancelled == 2
    finally:
        release.set()
        for t in threads:
            t.join(20)
        d.stop(0)
    assert outcomes == [grpc.StatusCode.CANCELLED] * 2
    assert all(t.used_bytes == 0 for t in d.manager.tiers)


def test_graceful_stop_keeps_host_blocks_on_nvme(tmp_path):
    cfg = daemon_config(tmp_path, host="1MiB", nvme="16MiB")
    blocks = [(K(i), os.urandom(4096)) for i in range(50)]
    d = start_server(cfg)
    with KVStoreClient(d.address) as c:
        c.put(blocks)
    in_host = [k for k, _ in blocks if d.manager.tier_of(k) == TierKind.HOST]
    assert in_host
    d.stop(0)
    d = start_server(cfg)
    try:
        with KVStoreClient(d.address) as c:
            got = c.get([k for k, _ in blocks])
        assert [g.data for g in got] == [b for _, b in blocks]      # nothing lost across the stop
    finally:
        d.stop(0)
