"""The guarantees of the same-node path hold on its control frames (issue 21).

A block leased through a LEASE frame is not evicted while leased (its bytes in the arena
stay the same) and is evictable once released; a client SIGKILLed holding such a lease has
it reclaimed as soon as its session connection closes; frames that are short, oversized,
garbage, or name keys that are not 32 bytes get an ERROR answer or the connection closed,
and the daemon keeps serving; a session's frames act in the key space of the tenant whose
token opened it, so a tenant neither sees nor releases another tenant's blocks.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.client.arena_mapping import ArenaMapping
from kvstore.client.client import KVStoreClient
from kvstore.common import arena_wire as w
from kvstore.common.arena import HELLO_CONTROL
from kvstore.common.errors import InvalidRequest, KVStoreError
from kvstore.service.arena_control import ArenaControl
from kvstore.service.arena_server import ArenaServer
from kvstore.service.auth import Authenticator, tenant_key
from kvstore.service.liveness import ClientSessions
from kvstore.service.startup import start_server
from support.daemon import child_env, daemon_config, short_socket_dir
from tiers.base import TierKind

from test_arena_control import DEADLINE_S, forbid_grpc, key, wait_for

BLOCK = 64 << 10


@pytest.fixture(autouse=True)
def frames_only(monkeypatch):
    """These tests are of the control frames: clients here read no block table (its reads:
    ``tests/kvstore/test_block_table_reads.py``)."""
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")



@pytest.fixture
def small(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))    # 16 blocks of 64 KiB
    yield d
    d.stop(0)


def test_a_block_leased_by_a_frame_is_not_evicted_until_released(small):
    rng = np.random.default_rng(3)
    with KVStoreClient(small.address, timeout=DEADLINE_S) as c:
        held = [key(i, "held") for i in range(4)]
        data = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
        c.put_from(held, data)
        arena = c.arena()
        forbid_grpc(c, "Lease", "Release")
        lease = c.lease(held)
        assert list(lease.tier_codes) == [TierKind.HOST] * 4
        spans = list(zip(lease.offsets, lease.sizes))
        for r in range(4):                                   # 64 newer blocks through a 16-block arena
            c.put_from([key(16 * r + i, "new") for i in range(16)], rng.integers(0, 256, (16, BLOCK), np.uint8))
        assert c.lookup([key(0, "new")]).hit_blocks == 0         # the oldest unleased block went
        for i, (off, size) in enumerate(spans):                  # the leased ones stayed, in place
            assert small.manager.tier_of(held[i]) == TierKind.HOST
            assert np.array_equal(arena.array[off:off + size], data[i])
        assert c.release([lease.lease_id]) == 1
        for r in range(2):
            c.put_from([key(100 + 16 * r + i, "after") for i in range(16)],
                       rng.integers(0, 256, (16, BLOCK), np.uint8))
        assert c.lookup(held[:1]).hit_blocks == 0                # released: evicted like any block


HOLDER = textwrap.dedent('''
    import sys
    from kvstore.client.client import KVStoreClient
    key = lambda i: (f"held:{i}:".encode() * 32)[:32]
    c = KVStoreClient(sys.argv[1], lease_ttl_s=600.0, timeout=60)
    arena = c.arena()
    lease = c.lease([key(i) for i in range(4)], ttl_s=600.0)
    print("HELD", arena.control is not None, lease.ttl_seconds, sum(1 for t in lease.tier_codes if t), flush=True)
    sys.stdin.read()
''')


def test_a_killed_clients_frame_lease_is_reclaimed_with_its_session(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None, extra={"server": {"lease_ttl_s": 600.0}}))
    try:
        with KVStoreClient(d.address, shared_memory=False, timeout=DEADLINE_S) as c:
            c.put([((f"held:{i}:".encode() * 32)[:32], os.urandom(BLOCK)) for i in range(4)])
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.address], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=child_env())
            try:
                assert holder.stdout.readline().split() == ["HELD", "True", "600.0", "4"]
                assert d.manager.catalogue.num_leases == 1
                holder.send_signal(signal.SIGKILL)
                holder.wait(timeout=DEADLINE_S)
                wait_for(lambda: d.manager.catalogue.num_leases == 0, "the killed client's lease to be reclaimed")
            finally:
                holder.kill()
                holder.wait(timeout=DEADLINE_S)
            assert c.stats()["counters"].get("leases_reclaimed") == 1
            assert c.stats()["counters"].get("leases_expired", 0) == 0
    finally:
        d.stop(0)


def _session(d) -> socket.socket:
    with KVStoreClient(d.address) as c:
        path = c.info().shm_socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(DEADLINE_S)
    s.connect(path)
    s.sendall(HELLO_CONTROL + b"-\n")
    msg, fds, _, _ = socket.recv_fds(s, 256, 1)
    for fd in fds:
        os.close(fd)
    assert msg.startswith(b"OK ") and msg.split()[-1] == b"1", msg
    return s


def _answer(s: socket.socket) -> tuple[int, int, bytes]:
    """(op, count, payload) of the next answer; (-1, 0, b"") when the daemon closed."""
    raw = b""
    while len(raw) < w.HEADER_BYTES:
        part = s.recv(w.HEADER_BYTES - len(raw))
        if not part:
            return -1, 0, b""
        raw += part
    length, op, _, _, _, _, count = w.HEADER.unpack(raw)
    payload = b""
    while len(payload) < length - (w.HEADER_BYTES - w.LENGTH.size):
        payload += s.recv(length - (w.HEADER_BYTES - w.LENGTH.size) - len(payload))
    return op, count, payload


def _error(s: socket.socket) -> KVStoreError:
    op, _, payload = _answer(s)
    assert op == w.ERROR, op
    return w.decode_error(payload)


def test_bad_frames_get_an_error_or_a_closed_connection_and_the_daemon_serves_on(small):
    with KVStoreClient(small.address, shared_memory=False) as c:
        c.put([(key(1), b"z" * 4096)])
    s = _session(small)
    s.sendall(struct.pack("<IBBBBII", 12, 77, 0, 32, 0, 5, 0))           # an unknown op
    assert "unknown control op" in str(_error(s))
    s.sendall(struct.pack("<IBBBBII", 12 + 31, w.LOOKUP, 0, 31, 0, 6, 1) + b"k" * 31)
    err = _error(s)                                                      # a 31-byte key
    assert isinstance(err, InvalidRequest) and "32 bytes" in str(err)
    s.sendall(w.header(w.LOOKUP, 0, 7, 3, 64) + b"k" * 64)               # says 3 keys, carries 2
    assert "says 3 keys" in str(_error(s))
    s.sendall(w.header(w.LEASE, 0, 8, 1, 10) + b"\0" * 10)               # shorter than its fixed part
    assert isinstance(_error(s), InvalidRequest)
    s.sendall(w.lease_frame(9, [key(1)], -5.0, 0, True, []))            # a negative TTL
    assert "ttl" in str(_error(s)).lower()
    s.sendall(w.header(w.RELEASE, 0, 10, 2, 16) + b"\1" * 16)            # says 2 ids, carries 1
    assert isinstance(_error(s), InvalidRequest)
    s.sendall(w.lookup_frame(11, [key(1)]))                              # the session still answers
    assert _answer(s) == (w.LOOKUP | w.REPLY, 1, bytes([TierKind.HOST]))
    s.sendall(struct.pack("<I", 3) + b"abc")                             # shorter than a header
    assert "frames have" in str(_error(s))
    assert _answer(s)[0] == -1                                           # ... closes the session
    s.close()
    s = _session(small)
    s.sendall(struct.pack("<I", w.MAX_FRAME_BYTES + 1) + os.urandom(64))  # longer than any frame
    assert "frames have" in str(_error(s))
    assert _answer(s)[0] == -1
    s.close()
    s = _session(small)
    s.sendall(os.urandom(4096))                                          # garbage
    s.close()
    with KVStoreClient(small.address, timeout=DEADLINE_S) as c:         # the daemon serves on
        assert c.lookup([key(1)]).hit_blocks == 1
        out = np.zeros(4096, np.uint8)
        assert c.get_into([key(1)], out).found == 1 and bytes(out) == b"z" * 4096
    control = next(b for b in small.background if isinstance(b, ArenaServer)).control
    assert control.refused >= 8


def test_a_session_acts_in_its_tenants_key_space(small):
    m = small.manager
    m.put(tenant_key("a", key(1)), b"a" * 4096)
    m.put(tenant_key("b", key(2)), b"b" * 4096)
    auth = Authenticator({"token-a": "a", "token-b": "b"})
    sessions = ClientSessions(m.open_session, m.end_session)
    seg = m.tiers[m.shared_tier].capabilities.shared.segment()
    path = short_socket_dir() / "tenants.arena"
    server = ArenaServer(path, seg.fd, seg.size, auth, sessions=sessions, max_ttl_s=30.0,
                         control=ArenaControl(m, lease_ttl_s=30.0)).start()
    try:
        with pytest.raises(OSError, match="token"):
            ArenaMapping(str(path), "token-c")
        a, b = ArenaMapping(str(path), "token-a"), ArenaMapping(str(path), "token-b")
        assert a.control is not None and b.control is not None
        assert a.control.lookup([key(1), key(2)], DEADLINE_S) == (1, bytes([TierKind.HOST]))
        assert b.control.lookup([key(1)], DEADLINE_S) == (0, b"")      # a's block is not b's key
        assert b.control.lookup([key(2)], DEADLINE_S)[0] == 1
        lease = a.control.lease([key(1)], 10.0, True, 0, [], DEADLINE_S)
        assert lease.lease_id and list(lease.tier_codes) == [TierKind.HOST]
        assert np.array_equal(a.array[lease.offsets[0]:lease.offsets[0] + 4096], np.full(4096, ord("a"), np.uint8))
        assert b.control.lease([key(1)], 10.0, True, 0, [], DEADLINE_S).lease_id == ""
        assert b.control.release([lease.lease_id], DEADLINE_S) == 0     # not b's lease
        assert m.catalogue.num_leases == 1
        assert a.control.release([lease.lease_id], DEADLINE_S) == 1
        a.close()
        b.close()
    finally:
        server.stop()
        sessions.stop()


def test_the_policy_sees_a_frame_lease_as_a_hit(small):
    """The touches run after the answer, yet they run: the leased (older) block outlives a
    newer one that nobody read."""
    rng = np.random.default_rng(4)
    keys = [key(i, "lru") for i in range(16)]                 # the arena holds 16: keys[0] is the oldest
    with KVStoreClient(small.address, timeout=DEADLINE_S) as c:
        for k in keys:
            c.put_from([k], rng.integers(0, 256, (1, BLOCK), dtype=np.uint8))
        forbid_grpc(c, "Lease", "Release")
        lease = c.lease(keys[:1])
        assert c.release([lease.lease_id]) == 1
        wait_for(lambda: small.manager.counters["leases_granted"] == 1, "the lease's bookkeeping")
        c.put_from([key(99, "lru")], rng.integers(0, 256, (1, BLOCK), dtype=np.uint8))
        assert c.lookup(keys[:1]).hit_blocks == 1                 # read by the lease: kept
        assert c.lookup(keys[1:2]).hit_blocks == 0                # the least recently used went
