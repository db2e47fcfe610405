"""The daemon's deadlines are ordered so that the right error wins (issue 19, item 20).

Four timeouts were all 30 s (writer wait, client deadline, stream idle, lease TTL): a put
waiting on a block leased for 120 s failed DEADLINE_EXCEEDED instead of WriteConflict. A put
now waits for another writer at most ``[store] writer_wait_s`` (10 s) and never past what its
call's deadline leaves; and a Put stream that sends nothing at all holds its worker only
``[server] stream_first_message_s`` (5 s), not the whole idle timeout.
"""

from __future__ import annotations

import inspect
import threading
import time

import grpc
import pytest

from kvstore import config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common import errors
from kvstore.service.startup import start_server
from support.daemon import daemon_config

K = b"w" * 32


def test_the_default_deadlines_are_ordered():
    cfg = config.Config()
    client_deadline = inspect.signature(KVStoreClient).parameters["timeout"].default
    assert cfg.store.writer_wait_s < client_deadline                      # WriteConflict, not DEADLINE_EXCEEDED
    assert cfg.store.writer_wait_s < cfg.server.stream_idle_timeout_s     # ... nor a stream cancelled as idle
    assert cfg.server.stream_first_message_s < cfg.server.stream_idle_timeout_s


def test_a_writer_wait_longer_than_the_idle_timeout_is_refused():
    with pytest.raises(errors.ConfigError, match="store.writer_wait_s: must be below server.stream_idle_timeout_s"):
        config.from_dict({"store": {"writer_wait_s": 30.0}, "server": {"stream_idle_timeout_s": 30.0}})


@pytest.fixture
def leased_and_deleted(tmp_path):
    """A daemon holding block K leased for 120 s by a same-node client and then deleted:
    a put of K waits for the lease's end."""
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None, extra={"server": {"lease_ttl_s": 120.0}}))
    holder = KVStoreClient(d.address, shared_memory=True, timeout=60)
    try:
        holder.put([(K, b"old" * 100)])
        holder.arena()
        assert holder.lease([K], ttl_s=120.0).ttl_seconds == 120.0
        assert holder.delete([K]) == 1
        yield d
    finally:
        holder.close()
        d.stop(0)


def test_a_put_waiting_on_a_leased_block_fails_write_conflict_with_the_defaults(leased_and_deleted):
    with KVStoreClient(leased_and_deleted.address) as c:                    # the standard 30 s deadline
        t0 = time.monotonic()
        with pytest.raises(errors.WriteConflict):
            c.put([(K, b"new" * 100)])
        waited = time.monotonic() - t0
    print(f"put waited {waited:.1f} s before WriteConflict")


def test_a_put_gives_up_waiting_before_its_own_deadline(leased_and_deleted):
    with KVStoreClient(leased_and_deleted.address, timeout=6.0) as c:     # shorter than writer_wait_s
        with pytest.raises(errors.WriteConflict):
            c.put([(K, b"new" * 100)])
    with grpc.insecure_channel(leased_and_deleted.address) as ch:          # the streamed Put too
        stub = pb_grpc.KVStoreStub(ch)
        batch = pb.PutBatch(chunks=[pb.PutChunk(key=K, total_size=3, offset=0, data=b"new")])
        with pytest.raises(grpc.RpcError) as e:
            stub.Put(iter([batch]), timeout=6.0)
        assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()


def test_a_put_stream_that_sends_nothing_frees_its_worker_before_the_idle_timeout(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None,
                                   extra={"server": {"workers": 2, "stream_idle_timeout_s": 600.0}}))
    release = threading.Event()
    outcomes = []

    def silent():
        def nothing():
            release.wait(120)
            yield from ()
        try:
            with grpc.insecure_channel(d.address) as ch:
                pb_grpc.KVStoreStub(ch).Put(nothing(), timeout=120)
            outcomes.append("ok")
        except grpc.RpcError as e:
            outcomes.append(e.code())

    threads = [threading.Thread(target=silent) for _ in range(2)]            # every worker held
    try:
        for t in threads:
            t.start()
        with KVStoreClient(d.address, timeout=60) as c:
            assert c.stats()["tiers"]                         # answered once the silent streams are cancelled
        deadline = time.monotonic() + 60                      # 5 s by the config, far below the 600 s idle timeout
        while d.service.streams.cancelled < 2:
            assert time.monotonic() < deadline, "silent Put streams were not cancelled"
            time.sleep(0.05)
    finally:
        release.set()
        for t in threads:
            t.join(30)
        d.stop(0)
    assert outcomes == [grpc.StatusCode.CANCELLED] * 2


def test_a_stream_that_sent_a_message_gets_the_idle_timeout(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None,
                                   extra={"server": {"stream_idle_timeout_s": 600.0, "stream_first_message_s": 1.0}}))
    try:
        def slow():
            yield pb.PutBatch(chunks=[pb.PutChunk(key=K, total_size=6, offset=0, data=b"abc")])
            time.sleep(3.0)                                   # past the first-message limit, inside the idle one
            yield pb.PutBatch(chunks=[pb.PutChunk(key=K, total_size=6, offset=3, data=b"def")])
        with grpc.insecure_channel(d.address) as ch:
            assert pb_grpc.KVStoreStub(ch).Put(slow(), timeout=60).stored == 1
        assert d.service.streams.cancelled == 0
    finally:
        d.stop(0)
