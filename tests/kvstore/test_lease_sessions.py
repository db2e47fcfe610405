"""What a same-node client holds ends with it, and every TTL is capped by the daemon (issue 19, item 18).

A client that maps the shared arena keeps its hand-out connection open as its session; a
client SIGKILLed while holding 600 s leases and reservations had left the host arena pinned
for ten minutes (every put went to NVMe). Now the daemon releases the session's leases and
aborts its reservations as soon as the connection closes. And ``[server] lease_ttl_s`` is
the longest TTL granted, whatever a client asks: the standard client asks 30 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore.client import arena as client_arena
from kvstore.client.client import KVStoreClient
from kvstore.common.arena import HELLO
from kvstore.common.errors import FeatureDisabled
from kvstore.service.startup import start_server
from support.daemon import child_env, daemon_config
from tiers.base import TierKind

BLOCK = 256 << 10
RECLAIM_DEADLINE_S = 30.0      # far below the 600 s TTL the killed client asked for


def key(i: int, tag: str = "s") -> bytes:
    return (f"{tag}:{i}:".encode() * 32)[:32]


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


HOLDER = textwrap.dedent('''
    import sys
    from kvstore._proto import kvstore_pb2 as pb
    from kvstore.client.client import KVStoreClient
    address, n_leased, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    key = lambda i, tag: (f"{tag}:{i}:".encode() * 32)[:32]
    c = KVStoreClient(address, shared_memory=True, lease_ttl_s=600.0, timeout=60)
    arena = c.arena()
    lease = c.lease([key(i, "s") for i in range(n_leased)], ttl_s=600.0, max_bytes=1 << 40)
    assert sum(1 for t in lease.tier_codes if t) == n_leased, lease
    reserved = 0
    for i in range(64):                      # reserve until the arena has no room left
        reply = c._stub.Reserve(pb.ReserveRequest(keys=[key(i, "r")], sizes=[block], ttl_seconds=600.0),
                                metadata=arena.metadata, timeout=60)
        if reply.status[0] != pb.RESERVED:
            break
        reserved += 1
    print("HELD", lease.ttl_seconds, reserved, flush=True)
    sys.stdin.read()                         # until killed
''')


@pytest.fixture
def long_ttl_daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme="64MiB",
                                   extra={"server": {"lease_ttl_s": 600.0}}))
    yield d
    d.stop(0)


def test_a_killed_clients_leases_and_reservations_are_reclaimed_at_once(long_ttl_daemon, tmp_path):
    d = long_ttl_daemon
    n_leased = 6
    with KVStoreClient(d.address, shared_memory=False, timeout=60) as c:
        c.put([(key(i), os.urandom(BLOCK)) for i in range(n_leased)])
        assert all(d.manager.tier_of(key(i)) == TierKind.HOST for i in range(n_leased))
        env = child_env()
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.address, str(n_leased), str(BLOCK)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        try:
            line = holder.stdout.readline().split()
            assert line[:2] == ["HELD", "600.0"], line          # the daemon granted the 600 s asked
            reserved = int(line[2])
            assert reserved >= 1
            c.put([(key(100, "p"), os.urandom(BLOCK))])
            assert d.manager.tier_of(key(100, "p")) == TierKind.NVME   # the arena is pinned full
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
            wait_for(lambda: c.stats()["counters"].get("reservations_reclaimed", 0) == reserved
                     and c.stats()["counters"].get("leases_reclaimed", 0) == 1,
                     "the killed client's session to be reclaimed", RECLAIM_DEADLINE_S)
        finally:
            holder.kill()
            holder.wait(timeout=30)
        assert d.manager.catalogue.num_leases == 0
        assert not [cl for cl in d.manager.catalogue._claims.values() if cl.session]
        c.put([(key(101, "p"), os.urandom(BLOCK))])
        assert d.manager.tier_of(key(101, "p")) == TierKind.HOST          # the arena is usable again
        counters = c.stats()["counters"]
        assert counters.get("leases_expired", 0) == 0 and counters.get("reservations_expired", 0) == 0


def test_closing_the_client_ends_its_session(long_ttl_daemon):
    d = long_ttl_daemon
    c = KVStoreClient(d.address, shared_memory=True, timeout=60)
    c.put([(key(1), b"x" * 4096)])
    assert c.arena().session                                          # mapped: a session is open
    reply = c.lease([key(1)], ttl_s=600.0)
    assert reply.lease_id and d.manager.catalogue.num_leases == 1
    c.close()
    wait_for(lambda: d.manager.catalogue.num_leases == 0, "the lease to end with the client", RECLAIM_DEADLINE_S)
    assert d.manager.counters["leases_reclaimed"] == 1


def test_a_lease_or_reservation_naming_an_ended_session_is_refused(long_ttl_daemon):
    m = long_ttl_daemon.manager
    m.put(key(1), b"y" * 4096)
    m.open_session("s1")
    m.end_session("s1")
    with pytest.raises(FeatureDisabled, match="session"):
        m.lease([key(1)], 60.0, session="s1")
    with pytest.raises(FeatureDisabled, match="session"):
        m.reserve_shared(key(2), 4096, "", 60.0, session="s1")
    assert m.catalogue.num_leases == 0 and m.catalogue.claim(key(2)) is None
    assert m.catalogue.raw(key(1)).pins == 0
    with pytest.raises(FeatureDisabled, match="session"):
        m.lease([key(1)], 60.0, session="never-opened")


def test_a_version_1_hello_still_gets_the_arena(long_ttl_daemon):
    with KVStoreClient(long_ttl_daemon.address) as c:
        path = c.info().shm_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(HELLO + b"-\n")
        msg, fds, _, _ = socket.recv_fds(s, 256, 1)
    for fd in fds:
        os.close(fd)
    assert msg == b"OK %d\n" % (4 << 20) and len(fds) == 1


# ------------------------------------------------------------------ the daemon caps every TTL


@pytest.fixture
def capped_daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None, extra={"server": {"lease_ttl_s": 5.0}}))
    yield d
    d.stop(0)


def test_lease_ttl_s_caps_what_the_standard_client_is_granted(capped_daemon):
    from kvstore._proto import kvstore_pb2 as pb
    d = capped_daemon
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as c:
        assert c.lease_ttl_s == 30.0                                  # the standard client asks 30 s
        c.put([(key(1), b"z" * 4096)])
        assert c.lease([key(1)]).ttl_seconds == 5.0
        assert c.lease([key(1)], ttl_s=600.0).ttl_seconds == 5.0
        assert c._stub.Info(pb.InfoRequest(), timeout=30).max_lease_seconds == 5.0     # Info says so
        arena = c.arena()
        assert arena.max_ttl_s == 5.0
        sent = d.manager.catalogue.clock()
        reply = c._stub.Reserve(pb.ReserveRequest(keys=[key(2)], sizes=[4096], ttl_seconds=600.0),
                                metadata=arena.metadata, timeout=30)
        assert reply.status[0] == pb.RESERVED
        claim = d.manager.catalogue.claim(key(2))
        assert claim.deadline - sent <= 5.0 + 1.0                     # 5 s, not 600 s


def test_the_client_counts_its_safety_margin_from_the_granted_ttl(capped_daemon, monkeypatch):
    """The client asks 30 s and is granted 5: a copy 3 s late (inside half of 30, outside
    half of 5) may have outlived its lease and is read again by gRPC."""
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")        # leases are what this tests (the table needs none)
    rng = np.random.default_rng(3)
    keys = [rng.bytes(32) for _ in range(4)]
    data = rng.integers(0, 256, (4, 32 << 10), dtype=np.uint8)
    with KVStoreClient(capped_daemon.address, shared_memory=True, lease_ttl_s=30.0, timeout=30) as c:
        assert c.put_from(keys, data).stored == 4
        reads = c.stats()["counters"].get("reads", 0)
        start = client_arena.time.monotonic()
        readings = iter(range(1 << 30))
        monkeypatch.setattr(client_arena, "_clock",
                            lambda: client_arena.time.monotonic() + (3.0 if next(readings) >= 1 else 0.0))
        out = np.zeros_like(data)
        assert c.get_into(keys, out).found == 4 and np.array_equal(out, data)
        assert client_arena.time.monotonic() - start < 60
        assert c.stats()["counters"]["reads"] == reads + 4            # served again by gRPC


def test_a_reservation_is_its_sessions_alone_and_outlives_its_ttl_while_the_session_lives(long_ttl_daemon):
    """A zero-copy reservation is committed or aborted by the session that made it only,
    and its TTL does not give its room away at once while that session lives: a client
    stalled mid-copy (SIGSTOP, swap) past its TTL still writes there. Found by a hostile test: a
    stranger's Commit published a half-written slot, and a writer late past its TTL wrote
    over another client's block."""
    import grpc

    from kvstore._proto import kvstore_pb2 as pb
    from kvstore.common.arena import ARENA_HEADER

    d = long_ttl_daemon
    k = key(1, "own")
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as a, \
            KVStoreClient(d.address, shared_memory=True, timeout=30) as b:
        ma, mb = a.arena().metadata, b.arena().metadata
        with pytest.raises(grpc.RpcError) as refused:          # a reservation names its session
            a._stub.Reserve(pb.ReserveRequest(keys=[key(2, "own")], sizes=[4096]), timeout=30,
                            metadata=((ARENA_HEADER, a.arena().identity),))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "session" in refused.value.details()
        assert d.manager.catalogue.claim(key(2, "own")) is None
        r = a._stub.Reserve(pb.ReserveRequest(keys=[k], sizes=[4096]), timeout=30, metadata=ma)
        assert list(r.status) == [pb.RESERVED]
        off, arr = r.offsets[0], a.arena().array
        arr[off:off + 2048] = 0xAB                              # half written
        for meta in (mb, ((ARENA_HEADER, a.arena().identity),)):   # another session, or none
            with pytest.raises(grpc.RpcError) as refused:
                b._stub.Commit(pb.CommitRequest(keys=[k]), timeout=30, metadata=meta)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert b._stub.Commit(pb.CommitRequest(keys=[k], abort=True), timeout=30, metadata=meta).committed == 0
        claim = d.manager.catalogue.claim(k)
        assert claim is not None and k not in d.manager
        claim.deadline = d.manager.catalogue.clock() - 1       # its TTL passed (a stalled writer)
        d.manager.leases.maintain()
        assert d.manager.catalogue.claim(k) is claim and d.manager.counters.get("reservations_expired", 0) == 0
        busy = b._stub.Reserve(pb.ReserveRequest(keys=[k], sizes=[4096]), timeout=30, metadata=mb)
        assert list(busy.status) == [pb.BUSY]                   # its room and key stay the writer's
        arr[off + 2048:off + 4096] = 0xCD                       # the writer wakes up and finishes
        assert a._stub.Commit(pb.CommitRequest(keys=[k]), timeout=30, metadata=ma).committed == 1
        assert b.get([k])[0].data == b"\xab" * 2048 + b"\xcd" * 2048


def test_a_commit_refused_for_one_block_aborts_the_batch_and_put_from_puts_it_by_grpc(long_ttl_daemon,
                                                                                      monkeypatch):
    """When a Commit names a reservation that is gone, the batch's other reservations are
    aborted (none is left holding room) and ``put_from`` stores the batch by gRPC."""
    d = long_ttl_daemon
    keys = [key(i, "gone") for i in range(3)]
    data = np.stack([np.full(4096, i + 1, dtype=np.uint8) for i in range(3)])
    real_copy = client_arena.copy
    copies = []

    def copy_then_lose_the_first(dst, src):                 # the first reservation ends meanwhile
        real_copy(dst, src)
        copies.append(1)
        if len(copies) == 3:
            claim = d.manager.catalogue.claim(keys[0])
            d.manager.abort_put(claim)
    monkeypatch.setattr(client_arena, "copy", copy_then_lose_the_first)
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as c:
        assert c.put_from(keys, data).stored == 3
        assert all(d.manager.catalogue.claim(k) is None for k in keys)
        assert [bytes(r.data) for r in c.get(keys)] == [bytes(row) for row in data]


def test_a_lease_as_a_clients_first_call_names_its_session_and_ends_with_it(long_ttl_daemon):
    """A client whose first call is ``lease`` maps the arena first, so the lease names its
    session and ends when the client does (it had been left to its TTL, up to 600 s)."""
    d = long_ttl_daemon
    keys = [key(i, "first") for i in range(3)]
    with KVStoreClient(d.address, timeout=30) as writer:
        writer.put([(k, k * 128) for k in keys])
    c = KVStoreClient(d.address, timeout=30)
    grant = c.lease(keys, ttl_s=600.0)
    assert sum(1 for t in grant.tier_codes if t) == 3
    lease = d.manager.catalogue._leases[grant.lease_id]
    assert lease.session and d.manager.catalogue.session_open(lease.session)
    c.close()
    wait_for(lambda: grant.lease_id not in d.manager.catalogue._leases, "the lease to end with its client",
             RECLAIM_DEADLINE_S)
    assert all(e.pins == 0 for e in d.manager.catalogue.entries())


def test_an_overdue_reservation_of_a_live_session_is_reclaimed_after_a_bounded_grace(long_ttl_daemon):
    """Held past its TTL while its session lives, but not for ever: OVERDUE_TTLS TTLs later
    it is reclaimed like any other, and the key can be stored again."""
    import grpc  # noqa: F401

    from kvstore._proto import kvstore_pb2 as pb
    from kvstore.store.catalogue import OVERDUE_TTLS

    d = long_ttl_daemon
    k = key(1, "overdue")
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as a, \
            KVStoreClient(d.address, shared_memory=True, timeout=30) as b:
        r = a._stub.Reserve(pb.ReserveRequest(keys=[k], sizes=[4096]), timeout=30, metadata=a.arena().metadata)
        assert list(r.status) == [pb.RESERVED]
        claim = d.manager.catalogue.claim(k)
        assert claim.ttl_s == 600.0
        now = d.manager.catalogue.clock()
        stats = b.stats()["counters"]
        assert (stats["open_reservations"], stats["overdue_reservations"]) == (1, 0)
        claim.deadline = now - OVERDUE_TTLS * claim.ttl_s + 60    # past its TTL, inside the grace
        d.manager.leases.maintain()
        assert d.manager.catalogue.claim(k) is claim
        stats = b.stats()["counters"]
        assert (stats["open_reservations"], stats["overdue_reservations"]) == (1, 1)
        claim.deadline = now - OVERDUE_TTLS * claim.ttl_s - 1     # past the grace too
        d.manager.leases.maintain()
        assert d.manager.catalogue.claim(k) is None and d.manager.counters["reservations_expired"] == 1
        assert b.stats()["counters"]["overdue_reservations"] == 0
        assert b.put_from([k], np.full(4096, 9, np.uint8)).stored == 1
        assert b.get([k])[0].data == bytes([9]) * 4096


def test_a_put_from_that_fails_mid_batch_aborts_its_reservations(long_ttl_daemon, monkeypatch):
    """A copy that raises (or a Commit that times out, or Ctrl-C) between Reserve and Commit
    aborts the batch's reservations at once: the keys are free for the next put."""
    d = long_ttl_daemon
    keys = [key(i, "fail") for i in range(4)]
    data = np.stack([np.full(8192, i + 1, dtype=np.uint8) for i in range(4)])
    real_copy, copies = client_arena.copy, []

    def failing_copy(dst, src):
        copies.append(1)
        if len(copies) == 2:
            raise KeyboardInterrupt
        real_copy(dst, src)
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as c:
        monkeypatch.setattr(client_arena, "copy", failing_copy)
        with pytest.raises(KeyboardInterrupt):
            c.put_from(keys, data)
        monkeypatch.setattr(client_arena, "copy", real_copy)
        assert all(d.manager.catalogue.claim(k) is None for k in keys)
        assert d.manager.counters["puts_aborted"] == 4
        assert c.put_from(keys, data).stored == 4


def test_a_mapping_without_a_session_puts_by_grpc(long_ttl_daemon):
    """Past the daemon's session cap a client maps the arena without a session; a
    reservation needs one, so its put_from goes by gRPC (it raised FeatureDisabled)."""
    d = long_ttl_daemon
    keys = [key(i, "nosession") for i in range(3)]
    data = np.stack([np.full(4096, i + 7, dtype=np.uint8) for i in range(3)])
    from kvstore.common.arena import ARENA_HEADER

    with KVStoreClient(d.address, shared_memory=True, timeout=30) as c:
        arena = c.arena()                                 # as the daemon hands it out past its cap
        arena.session, arena.metadata = "", ((ARENA_HEADER, arena.identity),)
        reserves = d.manager.counters.get("puts_aborted", 0), len(d.manager.catalogue._claims)
        assert c.put_from(keys, data).stored == 3
        assert (d.manager.counters.get("puts_aborted", 0), len(d.manager.catalogue._claims)) == reserves
        assert [bytes(r.data) for r in c.get(keys)] == [bytes(row) for row in data]


def test_a_session_the_daemon_closes_keeps_its_reservations_and_leases_to_their_ttl(long_ttl_daemon):
    """When the daemon itself closes a session (the client sent a frame it cannot frame),
    the client may still be copying: its reservations and leases are not released at once
    (their room could go to another block under the writer), but end by their TTLs."""
    from kvstore._proto import kvstore_pb2 as pb
    from kvstore.common import arena_wire

    d = long_ttl_daemon
    k, held = key(1, "closed"), key(2, "closed")
    with KVStoreClient(d.address, timeout=30) as writer:
        writer.put([(held, b"h" * 4096)])
    with KVStoreClient(d.address, shared_memory=True, timeout=30) as a:
        arena = a.arena()
        assert arena.control is not None, "this daemon serves control frames on the session"
        grant = a.lease([held], ttl_s=600.0)
        r = a._stub.Reserve(pb.ReserveRequest(keys=[k], sizes=[4096]), timeout=30, metadata=arena.metadata)
        assert list(r.status) == [pb.RESERVED]
        arena.control._sock.sendall(arena_wire.LENGTH.pack(1))     # a frame too short to frame
        wait_for(lambda: not d.manager.catalogue.session_open(arena.session), "the daemon to close the session",
                 RECLAIM_DEADLINE_S)
        claim = d.manager.catalogue.claim(k)
        assert claim is not None and claim.session == ""            # ends by its TTL now
        assert grant.lease_id in d.manager.catalogue._leases        # so does the lease
        assert d.manager.counters.get("reservations_reclaimed", 0) == 0
        assert d.manager.counters.get("leases_reclaimed", 0) == 0
        claim.deadline = 0.0
        d.manager.leases.maintain()
        assert d.manager.catalogue.claim(k) is None
