"""Slow clients never hold every worker (issue 19, item 10).

Streaming calls run on threads of their own, below ``[server] workers``, so as many
trickling streams as there are workers leave the Lookups and Stats of other clients
answered; a stream running longer than ``stream_timeout_s`` is ended with
DEADLINE_EXCEEDED naming the key, whichever streaming method it is; a Get whose reader
never reads is cancelled once it has waited on its client for ``stream_idle_timeout_s``;
and a peer that sends its arena hello slowly does not delay another client's hand-out.
Verdicts wait on events with generous deadlines, never on a speed.
"""

from __future__ import annotations

import hashlib
import pathlib
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common.arena import HELLO
from kvstore.common.wire import FOUND, encode
from kvstore.service.startup import start_server

DEADLINE = 60.0
TOTAL = 1 << 20                  # the block a trickling stream never finishes
PIECE = 128                      # bytes per message, ten messages a second: about 1 KiB/s


def K(i: int) -> bytes:
    return hashlib.sha256(f"streams-{i}".encode()).digest()


def trickle(address: str, key: bytes, stop: threading.Event, raw: bool, outcome: list) -> None:
    """A Put (or PutRaw) stream sending PIECE bytes every 0.1 s until ``stop`` or its end."""
    def messages():
        offset = 0
        while not stop.is_set() and offset < TOTAL:
            if raw:
                yield encode([(key, FOUND, 0, TOTAL, offset, b"x" * PIECE)])
            else:
                yield pb.PutBatch(chunks=[pb.PutChunk(key=key, total_size=TOTAL, offset=offset, data=b"x" * PIECE)])
            offset += PIECE
            stop.wait(0.1)
    try:
        with grpc.insecure_channel(address) as ch:
            if raw:
                ch.stream_unary("/kvstore.v1.KVStoreData/PutRaw", response_deserializer=pb.PutReply.FromString)(
                    messages(), timeout=DEADLINE * 2)
            else:
                pb_grpc.KVStoreStub(ch).Put(messages(), timeout=DEADLINE * 2)
        outcome.append("ended")
    except grpc.RpcError as e:
        outcome.append(e)


def start_tricklers(address: str, n: int, stop: threading.Event) -> tuple[list[threading.Thread], list]:
    outcome: list = []
    threads = [threading.Thread(target=trickle, args=(address, K(100 + i), stop, i % 2 == 1, outcome), daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    return threads, outcome


def wait_for(predicate, what: str, deadline_s: float = DEADLINE) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_as_many_trickling_streams_as_workers_leave_lookups_answered(tmp_path):
    d = start_server(daemon_config(tmp_path, nvme=None, extra={"server": {"workers": 4}}))
    stop = threading.Event()
    threads, outcome = start_tricklers(d.address, 4, stop)
    try:
        wait_for(lambda: sum(t.used_bytes for t in d.manager.tiers) >= 3 * TOTAL, "three streams running")
        with KVStoreClient(d.address, timeout=DEADLINE, shared_memory=False) as c:
            assert c.lookup([K(1), K(2)]).hit_blocks == 0
            assert c.stats()["tiers"]
            assert c.info().max_message_bytes > 0
        assert outcome == []                      # answered while every stream still trickles
        assert d.service.streams.active == 3      # the fourth waits for a stream thread
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE)
        d.stop(0)


@pytest.mark.parametrize("raw", [False, True], ids=["Put", "PutRaw"])
def test_a_stream_running_longer_than_stream_timeout_is_ended_with_a_clear_status(tmp_path, raw):
    d = start_server(daemon_config(tmp_path, nvme=None, extra={"server": {"workers": 4, "stream_timeout_s": 1.0}}))
    stop = threading.Event()
    outcome: list = []
    t = threading.Thread(target=trickle, args=(d.address, K(7), stop, raw, outcome), daemon=True)
    try:
        t.start()
        t.join(DEADLINE)
        assert len(outcome) == 1 and isinstance(outcome[0], grpc.RpcError), outcome
        err = outcome[0]
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "longer than server.stream_timeout_s = 1 s" in err.details()
        assert err.details().startswith("PutRaw: " if raw else "Put: ")
        assert d.manager.counters["streams_timed_out"] == 1
        assert d.manager.counters["puts_aborted"] == 1                  # the open block never became visible
        assert all(tier.used_bytes == 0 for tier in d.manager.tiers)
    finally:
        stop.set()
        t.join(DEADLINE)
        d.stop(0)


@pytest.mark.parametrize("raw", [False, True], ids=["Get", "GetRaw"])
def test_a_get_read_slowly_is_ended_at_stream_timeout(tmp_path, raw):
    d = start_server(daemon_config(tmp_path, host="64MiB", nvme=None, extra={
        "server": {"workers": 4, "stream_timeout_s": 1.0, "max_chunk_bytes": "64KiB"}}))
    try:
        with KVStoreClient(d.address, timeout=DEADLINE, shared_memory=False) as c:
            c.put([(K(3), np.zeros(32 << 20, dtype=np.uint8))])
        request = pb.GetRequest(keys=[K(3)])
        # no BDP probe: the receive window stays small, so the daemon cannot push the whole
        # block into the transport's buffers before its stream timeout, however slow the machine
        with grpc.insecure_channel(d.address, options=[("grpc.max_receive_message_length", 8 << 20),
                                                       ("grpc.http2.bdp_probe", 0)]) as ch:
            if raw:
                call = ch.unary_stream("/kvstore.v1.KVStoreData/GetRaw", request_serializer=pb.GetRequest.SerializeToString)(
                    request, timeout=DEADLINE)
            else:
                call = pb_grpc.KVStoreStub(ch).Get(request, timeout=DEADLINE)
            with pytest.raises(grpc.RpcError) as failure:
                for _ in call:                   # one 64 KiB message every 0.1 s: 512 messages take 51 s
                    time.sleep(0.1)
        assert failure.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_timeout_s" in failure.value.details()
        assert d.manager.counters["streams_timed_out"] == 1
        wait_for(lambda: d.service.streams.active == 0, "the Get to end")
    finally:
        d.stop(0)


def test_a_get_whose_reader_never_reads_is_cancelled_and_lookups_go_on(tmp_path):
    d = start_server(daemon_config(tmp_path, host="128MiB", nvme=None, extra={
        "server": {"workers": 2, "stream_idle_timeout_s": 0.5, "max_chunk_bytes": "1MiB"},
        "store": {"writer_wait_s": 0.25}}))
    try:
        with KVStoreClient(d.address, timeout=DEADLINE, shared_memory=False) as c:
            c.put([(K(4), np.zeros(64 << 20, dtype=np.uint8))])
        with grpc.insecure_channel(d.address) as ch:
            call = pb_grpc.KVStoreStub(ch).Get(pb.GetRequest(keys=[K(4)]), timeout=DEADLINE)
            wait_for(lambda: d.service.streams.cancelled == 1, "the unread Get to be cancelled")
            with KVStoreClient(d.address, timeout=DEADLINE, shared_memory=False) as c:
                assert c.lookup([K(4)]).hit_blocks == 1
            call.cancel()
        wait_for(lambda: d.service.streams.active == 0, "the Get to end")
        assert d.manager.counters["streams_idle_cancelled"] == 1
    finally:
        d.stop(0)


def hello(path: str, timeout: float) -> bytes:
    """One arena hand-out; returns the daemon's answer line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(HELLO + b"-\n")
        msg, fds, _, _ = socket.recv_fds(s, 256, 1)
        for fd in fds:
            socket.close(fd)
        return msg


def test_a_slow_hello_does_not_delay_another_clients_arena_hand_out(tmp_path):
    d = start_server(daemon_config(tmp_path, nvme=None))
    path = d.service.info.shm_socket
    assert path and pathlib.Path(path).is_socket()
    arena = next(b for b in d.background if type(b).__name__ == "ArenaServer")
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = threading.Event()
    line = HELLO + b"t" * 200 + b"\n"          # one byte every 0.2 s: 43 s for the whole line

    def dribble():
        try:
            for b in line[1:]:
                if stop.wait(0.2):
                    return
                slow.send(bytes([b]))
        except OSError:                        # the daemon dropped it
            pass
    t = threading.Thread(target=dribble, daemon=True)
    try:
        slow.connect(path)
        slow.send(line[:1])
        t.start()
        time.sleep(0.5)                        # the slow peer is connected and sending
        assert hello(path, timeout=10.0).startswith(b"OK ")      # the client's own timeout is 5 s
        slow.settimeout(DEADLINE)              # dropped at its deadline (2 s), without an answer
        try:
            assert slow.recv(64) == b""
        except ConnectionResetError:
            pass
        wait_for(lambda: arena.timed_out == 1, "the slow peer to be dropped")
    finally:
        stop.set()
        t.join(DEADLINE)
        slow.close()
        d.stop(0)


def test_the_stream_watchdog_ends_with_the_last_stream(daemon):
    """The watchdog thread holds the service; it must not outlive the streams (an
    in-process daemon stopped and started again kept one such thread per daemon)."""
    guard = daemon.service.streams
    with KVStoreClient(daemon.address, timeout=30, shared_memory=False) as c:
        c.put([(K(900), b"w" * 4096)])                          # a Put stream: the watchdog starts
        assert [r.found for r in c.get([K(900)])] == [True]      # a Get stream
    wait_for(lambda: guard._thread is None, "the stream watchdog to end with its last stream")
    with KVStoreClient(daemon.address, timeout=30, shared_memory=False) as c:
        assert [r.found for r in c.get([K(900)])] == [True]      # a new stream starts another
    wait_for(lambda: guard._thread is None, "the second stream watchdog to end")
