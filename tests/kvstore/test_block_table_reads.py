"""Same-node reads from the daemon's block table (issue 21): no round trip, the same answers.

A client handed the block table (hello version 4) answers a lookup found whole there and
copies a prefix found there with no LOOKUP, LEASE or RELEASE (neither frame nor RPC); its
answers are the gRPC path's, and the daemon still sees the reads (``table_read_blocks``, the
policies' hits). What the table cannot vouch for goes by lease: a block deleted while it is
copied, a daemon that stopped or was SIGKILLed (even with the old table still marked open),
blocks not in the host arena. Space a client may be copying is not reused until it is done,
or its session ends (a SIGKILLed client). Tenants, old daemons (hello version 3) and
``block_table = false`` get no table and read by lease.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.client import arena as client_arena
from kvstore.client.arena_mapping import ArenaMapping
from kvstore.client.client import KVStoreClient
from kvstore.service import arena_server
from kvstore.service.arena_control import ArenaControl
from kvstore.service.arena_server import ArenaServer
from kvstore.service.auth import Authenticator, tenant_key
from kvstore.service.liveness import ClientSessions
from kvstore.service.startup import start_server
from support.daemon import child_env, daemon_config, short_socket_dir
from tiers.base import TierKind
from tiers.block_table import supported

from test_arena_control import BLOCK, DEADLINE_S, d, key, payloads, wait_for  # noqa: F401 (d: a fixture)

pytestmark = pytest.mark.skipif(not supported(), reason="the block table is offered on x86-64 only")


def no_round_trips(c: KVStoreClient) -> list[str]:
    """Make every asking call of ``c`` (gRPC Lookup, Lease, Release; LOOKUP and LEASE frames)
    record itself and fail; returns the record (empty: none was made)."""
    made: list[str] = []

    def forbidden(name):
        def call(*a, **kw):
            made.append(name)
            raise AssertionError(f"{name} called on a read the block table serves")
        return call
    for name in ("Lookup", "Lease", "Release"):
        setattr(c._connection.stub, name, forbidden(name))
    ch = c.arena().control
    ch.lookup, ch.lease = forbidden("LOOKUP frame"), forbidden("LEASE frame")
    return made


def host_of(d):
    m = d.manager
    return m.tiers[m.shared_tier]


def test_lookup_and_get_into_from_the_table_make_no_round_trip_and_match_grpc(d):
    data = payloads(40)
    keys = [key(i) for i in range(40)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as g:
        c.put_from(keys[:32], data[:32])
        assert c.arena().table is not None and c.arena().table.answers_lookups
        want_lookup = g.lookup(keys[:32])
        out, ref = np.zeros((32, BLOCK), np.uint8), np.zeros((32, BLOCK), np.uint8)
        want = g.get_into(keys[:32], ref)
        ranges = [(0, 100), (BLOCK - 50, 50)]
        small = [np.zeros(150, np.uint8) for _ in range(3)]
        made = no_round_trips(c)
        assert c.lookup(keys[:32]) == want_lookup
        assert want_lookup.hit_blocks == 32 and set(want_lookup.tier_codes) == {TierKind.HOST}
        got = c.get_into(keys[:32], out)
        assert (got.found, got.sizes, got.tier_codes) == (want.found, want.sizes, want.tier_codes)
        assert np.array_equal(out, data[:32]) and np.array_equal(ref, data[:32])
        r = c.get_into(keys[:3], small, ranges=ranges)
        assert r.found == 3 and all(np.array_equal(small[i], np.concatenate([data[i][:100], data[i][-50:]]))
                                    for i in range(3))
        assert made == []
        wait_for(lambda: d.manager.counters.get("table_read_blocks", 0) == 35, "the TOUCH notes (35 blocks)")
        assert d.manager.counters.get("leases_granted", 0) == 0
        wait_for(lambda: d.manager.counters.get("lookups") == 2, "the table lookup's note (and g's lookup)")


def test_a_client_that_only_looks_up_maps_the_arena_and_then_looks_up_with_no_round_trip(d):
    """An engine's scheduler only looks up (its workers read): its first lookup maps the
    shared arena, and the lookups after it are answered from the block table."""
    data = payloads(8, seed=5)
    keys = [key(i, "sched") for i in range(8)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as w, KVStoreClient(d.address, timeout=DEADLINE_S) as s, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as g:
        w.put_from(keys, data)
        want = g.lookup(keys)
        assert want.hit_blocks == 8
        assert s._arena_path.current is None                   # nothing mapped before its first call
        assert s.lookup(keys) == want
        assert s._arena_path.current is not None               # mapped by that lookup
        made = no_round_trips(s)
        assert s.lookup(keys) == want and s.lookup(keys[:3]) == g.lookup(keys[:3])
        assert made == []


def test_a_prefix_past_the_table_continues_by_lease_with_the_same_answers(d):
    data = payloads(40, seed=3)
    keys = [key(i) for i in range(40)]
    asked = keys[:30] + [key(99, "miss")] + keys[31:32]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as g:
        c.put_from(keys[:32], data[:32])
        assert c.lookup(asked) == g.lookup(asked)              # not all in the table: the daemon answers
        for stop in (True, False):
            out, ref = np.zeros((32, BLOCK), np.uint8), np.zeros((32, BLOCK), np.uint8)
            got, want = c.get_into(asked, out, stop_at_miss=stop), g.get_into(asked, ref, stop_at_miss=stop)
            assert (got.found, got.sizes, got.tier_codes) == (want.found, want.sizes, want.tier_codes)
            assert np.array_equal(out, ref)
        assert got.found == 31 and np.array_equal(out[31], data[31])


def test_a_block_deleted_while_copied_is_not_served_and_its_space_waits(d, monkeypatch):
    data = payloads(8, seed=5)
    keys = [key(i, "del") for i in range(8)]
    host = host_of(d)
    seen = {}
    original = client_arena.ArenaPath._copy_out

    def racing(src, reply, start, bufs, ranges, sizes, codes):
        if not seen:                                # first copy: the table's; block 5 goes first
            assert d.manager.delete([keys[5]]) == 1
            seen["retired"] = len(host._retired)    # its space is held back: this client reads
            refill = payloads(4, seed=6)
            d.manager.put(key(0, "refill"), refill[0].tobytes())
            seen["reused"] = any(np.array_equal(src[o:o + BLOCK], refill[0]) for o in reply.offsets)
        original(src, reply, start, bufs, ranges, sizes, codes)

    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, data)
        monkeypatch.setattr(client_arena.ArenaPath, "_copy_out", staticmethod(racing))
        out = np.zeros((8, BLOCK), np.uint8)
        r = c.get_into(keys, out)
        assert r.found == 5 and r.sizes == [BLOCK] * 5 + [0] * 3        # the rest asked by lease: a miss
        assert np.array_equal(out[:5], data[:5])       # the bytes past ``found`` are not the caller's
        assert seen == {"retired": 1, "reused": False}
        wait_for(lambda: host.fits(host.capacity_bytes - host.used_bytes) and not host._retired,
                 "the deleted block's space to be reusable once the read ended")


def test_a_stopped_daemons_table_is_not_read_and_the_new_one_is(tmp_path):
    cfg = daemon_config(tmp_path, host="16MiB", nvme=None)
    first = start_server(cfg)
    c = KVStoreClient(first.address, timeout=DEADLINE_S)
    try:
        keys = [key(i) for i in range(8)]
        c.put_from(keys, payloads(8, seed=1))
        old = c.arena()
        assert old.table is not None and old.table.open()
        first.stop(0)
        assert not old.table.open()                              # closed as the daemon stopped
        second = start_server(cfg)
        try:
            with KVStoreClient(second.address, shared_memory=False) as g:
                g.put([(k, payloads(8, seed=2)[i]) for i, k in enumerate(keys)])
            out = np.zeros((8, BLOCK), np.uint8)
            r = c.get_into(keys, out)
            assert r.found == 8 and np.array_equal(out, payloads(8, seed=2))
            assert c.arena() is not old and c.arena().table is not None
        finally:
            c.close()
            second.stop(0)
    finally:
        first.stop(0)


DAEMON = textwrap.dedent('''
    import signal, sys
    from kvstore import config
    from kvstore.service.startup import start_server
    d = start_server(config.from_dict({"server": {"listen": "unix:" + sys.argv[1], "workers": 4},
                                       "tiers": {"host": {"capacity": "16MiB"}, "nvme": {"enabled": False}}}))
    print("ready", d.address, flush=True)
    signal.sigwait([signal.SIGTERM])
    d.stop(0)
''')


def spawn_daemon(sock: pathlib.Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DAEMON, str(sock)], stdout=subprocess.PIPE, text=True,
                            env=child_env())
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return proc


def test_a_sigkilled_daemons_table_left_open_is_not_served():
    sock = short_socket_dir() / "killed.sock"
    first = spawn_daemon(sock)
    keys = [key(i, "k") for i in range(8)]
    try:
        c = KVStoreClient(f"unix:{sock}", timeout=DEADLINE_S)
        c.put_from(keys, payloads(8, seed=7))
        old = c.arena()
        assert old.table is not None
        first.send_signal(signal.SIGKILL)
        first.wait(DEADLINE_S)
        assert old.table.open()                 # nobody closed it: the old bytes are still mapped
        wait_for(lambda: not old.alive(), "the killed daemon's session to read as closed")
        second = spawn_daemon(sock)             # the same socket, an empty store
        try:
            out = np.zeros((8, BLOCK), np.uint8)
            r = c.get_into(keys, out)
            assert r.found == 0 and r.sizes == [0] * 8 and r.tier_codes == bytes(8)   # never the old blocks
            assert c.lookup(keys).hit_blocks == 0
        finally:
            c.close()
            second.terminate()
            second.wait(DEADLINE_S)
    finally:
        first.kill()
        first.wait(DEADLINE_S)


READER = textwrap.dedent('''
    import sys
    from kvstore.client.client import KVStoreClient
    c = KVStoreClient(sys.argv[1], timeout=60)
    table = c.arena().table
    slot = table.enter()                        # announced, then stopped inside the read
    print("READING", slot is not None, flush=True)
    sys.stdin.read()
''')


def test_a_client_killed_inside_a_read_holds_no_space_after_its_session(tmp_path, monkeypatch):
    monkeypatch.setattr("tiers.block_table.STUCK_READER_S", 3600.0)    # only the session's end frees it
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))
    host = host_of(d)
    try:
        keys = [key(i, "r") for i in range(4)]
        with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
            c.put_from(keys, payloads(4, seed=8))
        reader = subprocess.Popen([sys.executable, "-c", READER, d.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=child_env())
        try:
            assert reader.stdout.readline().split() == ["READING", "True"]
            assert d.manager.delete(keys) == 4
            free = host.capacity_bytes - host.used_bytes
            assert len(host._retired) == 4 and not host.fits(free + BLOCK)    # held back for the reader
            reader.send_signal(signal.SIGKILL)
            reader.wait(DEADLINE_S)
            wait_for(lambda: host.block_table.readers == 0, "the killed reader's session to end")
            assert host.fits(host.capacity_bytes) and not host._retired
        finally:
            reader.kill()
            reader.wait(DEADLINE_S)
    finally:
        d.stop(0)


def test_tenants_get_no_table_the_shared_key_space_does(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))
    m = d.manager
    try:
        m.put(key(1), b"s" * 4096)                                # the shared key space's block
        m.put(tenant_key("a", key(2)), b"a" * 4096)
        host = m.tiers[m.shared_tier]
        seg = host.capabilities.shared.segment()
        sessions = ClientSessions(m.open_session, m.end_session)
        path = short_socket_dir() / "tenants.arena"
        server = ArenaServer(path, seg.fd, seg.size, Authenticator({"token-a": "a", "token-s": ""}),
                             sessions=sessions, max_ttl_s=30.0, control=ArenaControl(m, lease_ttl_s=30.0),
                             table=host.block_table).start()
        try:
            a, s = ArenaMapping(str(path), "token-a"), ArenaMapping(str(path), "token-s")
            assert a.control is not None and a.table is None          # a's keys are not the table's
            assert s.table is not None
            slot = s.table.enter()
            assert s.table.find([key(1)])[0] == 1 and s.table.find([key(2)])[0] == 0
            s.table.leave(slot)
            assert a.control.lookup([key(1)], DEADLINE_S) == (0, b"")    # the shared block is not a's
            a.close()
            s.close()
        finally:
            server.stop()
            sessions.stop()
    finally:
        d.stop(0)


def test_an_old_daemon_or_block_table_off_is_read_by_lease(tmp_path, monkeypatch):
    data = payloads(8, seed=9)
    keys = [key(i, "o") for i in range(8)]
    for how in ("config", "hello 3"):
        if how == "hello 3":                     # a daemon that does not know version 4
            monkeypatch.setattr(arena_server, "HELLO_TABLE", b"KVSTORE-ARENA 9 ")
            cfg = daemon_config(tmp_path / "old", host="16MiB", nvme=None)
        else:
            cfg = daemon_config(tmp_path / "off", host="16MiB", nvme=None,
                                extra={"tiers": {"host": {"capacity": "16MiB", "block_table": False},
                                                 "nvme": {"enabled": False}}})
        d = start_server(cfg)
        try:
            assert (host_of(d).block_table is None) == (how == "config")
            with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
                c.put_from(keys, data)
                arena = c.arena()
                assert arena.table is None and arena.control is not None, how
                out = np.zeros((8, BLOCK), np.uint8)
                assert c.get_into(keys, out).found == 8 and np.array_equal(out, data)
                assert c.lookup(keys).hit_blocks == 8
            assert d.manager.counters.get("leases_granted", 0) >= 1
            assert d.manager.counters.get("table_read_blocks", 0) == 0
        finally:
            d.stop(0)


def test_lookups_go_to_the_daemon_when_the_table_does_not_answer_them(d):
    """A node whose fastest tier is not the arena (HBM) names other tiers: the table then
    serves reads, not lookups."""
    keys = [key(i, "l") for i in range(4)]
    host_of(d).block_table.answer_lookups(False)
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, payloads(4, seed=10))
        ch = c.arena().control
        asked = []
        real = ch.lookup
        ch.lookup = lambda *a: asked.append(a) or real(*a)
        assert c.lookup(keys).hit_blocks == 4 and len(asked) == 1


def test_a_process_that_did_not_map_the_table_reads_by_lease(d):
    """A forked child shares its parent's mapping, reader page and session: it reads by
    lease (or gRPC), never from the table (seen here as a channel made by another pid)."""
    data = payloads(4, seed=11)
    keys = [key(i, "f") for i in range(4)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, data)
        arena = c.arena()
        assert arena.table is not None
        arena.control._pid = -1                                  # as in a child after fork()
        out = np.zeros((4, BLOCK), np.uint8)
        assert c.get_into(keys, out).found == 4 and np.array_equal(out, data)
        assert c.lookup(keys).hit_blocks == 4
    assert d.manager.counters.get("table_read_blocks", 0) == 0


def test_a_block_deleted_while_leased_is_gone_from_the_table_at_once(d):
    data = payloads(4, seed=12)
    keys = [key(i, "dl") for i in range(4)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, data)
        lease = c.lease(keys[1:2])                          # pinned: the delete hides it, frees it later
        assert lease.lease_id and d.manager.delete(keys[1:2]) == 1
        out = np.zeros((4, BLOCK), np.uint8)
        r = c.get_into(keys, out)
        assert r.found == 1 and r.sizes == [BLOCK, 0, 0, 0] and np.array_equal(out[0], data[0])
        assert c.lookup(keys).hit_blocks == 1
        assert c.release([lease.lease_id]) == 1


def test_a_reader_stopped_inside_a_read_costs_a_put_one_eviction_not_the_tier(tmp_path, monkeypatch):
    """Freed space a stopped reader holds back is waited for (at most STUCK_READER_S), not
    evicted around: one new block evicts one block; and the reader holds space back once,
    not again for every later put."""
    for where in ("tiers.block_table", "kvstore.store.room"):
        monkeypatch.setattr(f"{where}.STUCK_READER_S", 0.3)
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))         # 32 blocks of 32 KiB
    try:
        keys = [key(i, "full") for i in range(32)]
        with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
            c.put_from(keys, payloads(32, seed=13))
            assert c.lookup(keys).hit_blocks == 32
            table = c.arena().table
            slot = table.enter()                            # stopped here, holding the epoch
            try:
                assert c.put_from([key(0, "new")], payloads(1, seed=14)).stored == 1
                assert sum(c.lookup([k]).hit_blocks for k in keys) == 31     # one evicted, not all
                # held past STUCK_READER_S: the stopped reader holds nothing back any more
                assert host_of(d).block_table.oldest_reader() is None
                assert c.put_from([key(1, "new")], payloads(1, seed=15)).stored == 1
                assert sum(c.lookup([k]).hit_blocks for k in keys) == 30
            finally:
                table.leave(slot)
            assert d.manager.counters.get("blocks_dropped", 0) == 2      # one per new block
    finally:
        d.stop(0)


def test_a_session_that_ends_during_its_hand_out_leaves_no_reader_page(d):
    server = next(b for b in d.background if isinstance(b, arena_server.ArenaServer))
    table = host_of(d).block_table
    assert server._table_fds("no-such-session") == [] and table.readers == 0


def test_block_table_notes_are_queued_never_sent_on_the_read_path():
    import socket
    from kvstore.client.arena_control import MAX_NOTE_BYTES, ControlChannel
    ours, daemon = socket.socketpair()
    try:
        ch = ControlChannel(ours)                           # a daemon that reads nothing
        keys = [key(i, "n") for i in range(128)]
        queued = 0
        while ch.note(keys):
            queued += 1
        assert queued == MAX_NOTE_BYTES // (16 + 128 * 32) and ch.notes_dropped == 1
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)                                  # nothing was written by note()
        daemon.setblocking(True)
        got = bytearray()
        reader = __import__("threading").Thread(target=lambda: [got.extend(daemon.recv(1 << 20))
                                                                for _ in range(64) if len(got) < queued * 4112])
        reader.start()
        assert ch.send_notes(DEADLINE_S) == queued
        reader.join(DEADLINE_S)
        assert len(got) == queued * (16 + 128 * 32) and ch.usable()
    finally:
        ours.close()
        daemon.close()


def test_the_table_is_sized_as_the_arena_clients_map(d):
    host = host_of(d)
    from tiers.block_table import H_ARENA
    assert int(host.block_table._header[H_ARENA]) == host.segment().size


def test_fence_works_in_a_child_forked_while_another_thread_fences():
    import threading
    from tiers.block_table import fence
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [fence() for _ in iter(lambda: stop.is_set(), True)], daemon=True)
    busy.start()
    try:
        children = []
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                signal.alarm(20)                            # a fence that hangs ends the child, nonzero
                fence()
                os._exit(0)
            children.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        assert codes == [0] * 20
    finally:
        stop.set()
        busy.join(DEADLINE_S)


def test_notes_wait_for_a_batch_then_go_in_one_write_when_the_socket_has_room_and_queued_when_not():
    import socket
    from kvstore.client.arena_control import NOTE_BATCH_S, ControlChannel
    ours, daemon = socket.socketpair()
    try:
        ch = ControlChannel(ours)
        ch.note([key(1, "w")])
        assert not ch.try_send_notes()                      # young: the release thread is asked (once)
        ch.note([key(2, "w")])
        assert ch.try_send_notes()                          # already asked: nothing more to do
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)                                  # nothing written yet
        daemon.setblocking(True)
        ch._notes_at -= NOTE_BATCH_S                        # the batch has waited long enough
        assert ch.try_send_notes()                          # both written whole, now, in one write
        daemon.settimeout(DEADLINE_S)
        assert len(daemon.recv(1 << 16)) == 2 * (16 + 32)
        assert ch.send_notes(DEADLINE_S) == 0 and not ch._flush_asked   # the thread's turn: nothing left
        filler = socket.socket(fileno=os.dup(ours.fileno()))
        filler.setblocking(False)
        try:                                                # the daemon reads nothing: fill the socket
            while True:
                filler.send(bytes(1 << 16))
        except BlockingIOError:
            pass
        finally:
            filler.setblocking(True)                        # the descriptor's flags are ours' too
            os.close(filler.detach())
        ch.note([key(3, "w")])
        ch._notes_at -= NOTE_BATCH_S
        assert not ch.try_send_notes()                      # no room: left for the release thread
        assert ch.usable() and ch._notes_bytes == 16 + 32
    finally:
        ours.close()
        daemon.close()
