"""The same-node data plane: the shared host arena, leases for reads, reservations for
writes, and the gRPC fallback (issue #11's acceptance list)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from support.daemon import ROOT, daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import FeatureDisabled, Unauthenticated
from kvstore.service.startup import start_server
from kvstore.common.types import TierKind

DEADLINE = 30.0


def K(i: int, tag: str = "shm") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def block(i: int, n: int = 64 << 10) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def wait_for(predicate, what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="64MiB",
                                   extra={"server": {"lease_ttl_s": 2.0}}))
    yield d
    d.stop(0)


def test_round_trip_numpy_and_torch_through_the_arena(daemon):
    torch = pytest.importorskip("torch")
    keys = [K(i) for i in range(8)]
    src = [block(i) for i in range(8)]
    with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
        assert c.shared_memory
        r = c.put_from(keys[:4], src[:4])                              # numpy, one array per block
        assert (r.stored, r.bytes_stored) == (4, 4 * (64 << 10))
        t = torch.from_numpy(np.stack(src[4:])).view(torch.float32)   # one tensor holding 4 blocks
        r = c.put_from(keys[4:], t, sizes=64 << 10)
        assert r.stored == 4
        out = np.zeros((8, 64 << 10), dtype=np.uint8)
        g = c.get_into(keys, out)                                      # one buffer, back to back
        assert g.found == 8 and g.sizes == [64 << 10] * 8 and set(g.tier_codes) == {int(TierKind.HOST)}
        assert all((out[i] == src[i]).all() for i in range(8))
        back = torch.zeros(2, 64 << 10, dtype=torch.uint8)
        assert c.get_into(keys[2:4], [back[0], back[1]]).found == 2    # torch CPU tensors
        assert (back.numpy() == np.stack(src[2:4])).all()
        part = np.zeros(2 * 300, dtype=np.uint8)                       # byte ranges of each block
        assert c.get_into(keys[:2], part, ranges=[(10, 100), (60_000, 200)]).found == 2
        assert (part[:100] == src[0][10:110]).all() and (part[400:600] == src[1][60_000:60_200]).all()
    counters = daemon.manager.counters
    assert counters.get("reads", 0) == 0 and counters["blocks_put"] == 8     # nothing read by gRPC


def test_prefix_miss_and_blocks_promoted_from_nvme_into_the_arena(daemon):
    keys = [K(i, "nvme") for i in range(200)]                         # 200 x 64 KiB > 8 MiB host
    with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
        c.put_from(keys, [block(i) for i in range(200)])
        daemon.manager.drain(DEADLINE)
        assert daemon.manager.tier_of(keys[0]) == TierKind.NVME
        out = np.zeros((201, 64 << 10), dtype=np.uint8)
        g = c.get_into(keys[:100] + [K(999, "absent")] + keys[100:], out)
        assert g.found == 100 and g.sizes[100] == 0                   # a prefix: stops at the miss
        assert all((out[i] == block(i)).all() for i in range(100))
        assert daemon.manager.counters["promotions"] >= 1


def refuse_in_host(d, refused: set) -> None:
    """Make the host tier's admission policy of daemon ``d`` refuse the keys in ``refused``."""
    host = d.manager.policies[0]
    own = host._admit
    host._admit = lambda key, nbytes, now: key not in refused and own(key, nbytes, now)


def test_a_block_the_host_tier_refuses_is_stored_on_nvme_through_the_arena_put(daemon):
    """A zero-copy put reserves in the host arena only; a block the host tier's admission
    refuses is put into the other tiers (by gRPC), not dropped while NVMe has room."""
    keys = [K(i, "refused") for i in range(6)]
    refuse_in_host(daemon, set(keys[:3]))
    with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
        assert c.shared_memory
        r = c.put_from(keys, [block(i) for i in range(6)])
        assert (r.stored, r.not_admitted) == (6, 0)
        assert [daemon.manager.tier_of(k) for k in keys] == [TierKind.NVME] * 3 + [TierKind.HOST] * 3
        out = np.zeros((6, 64 << 10), dtype=np.uint8)
        assert c.get_into(keys, out).found == 6
        assert all((out[i] == block(i)).all() for i in range(6))
    assert daemon.manager.counters["puts_not_admitted"] == 0


def test_a_block_no_tier_admits_is_refused_once_by_the_arena_put(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme=None))
    try:
        keys = [K(i, "host-only") for i in range(4)]
        refuse_in_host(d, set(keys[:2]))
        with KVStoreClient(d.address, timeout=DEADLINE) as c:
            assert c.shared_memory
            r = c.put_from(keys, [block(i) for i in range(4)])
            assert (r.stored, r.not_admitted) == (2, 2)
            assert c.lookup(keys[:2]).hit_blocks == 0 and c.lookup(keys[2:]).hit_blocks == 2
        assert d.manager.counters["puts_not_admitted"] == 2
    finally:
        d.stop(0)


def test_eviction_is_blocked_while_leased_and_expires_with_a_dead_client(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None, extra={"server": {"lease_ttl_s": 2.0}}))
    try:
        keys = [K(i, "lease") for i in range(16)]                       # 16 x 64 KiB: the whole arena
        with KVStoreClient(d.address, timeout=DEADLINE) as c:
            c.put_from(keys, [block(i) for i in range(16)])
        script = textwrap.dedent(f"""
            import sys, time
            sys.path[:0] = [{str(ROOT)!r}]
            from kvstore.client import KVStoreClient
            c = KVStoreClient({d.address!r}, lease_ttl_s=2.0)
            reply = c.lease([bytes.fromhex(k) for k in sys.argv[1:]], 2.0, max_bytes=1 << 20)
            print(len([s for s in reply.sizes if s]), flush=True)
            time.sleep(60)
        """)
        proc = subprocess.Popen([sys.executable, "-c", script] + [k.hex() for k in keys[:8]],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "8"                # 8 blocks leased
            with KVStoreClient(d.address, timeout=DEADLINE) as c:
                r = c.put_from([K(i, "new") for i in range(12)], [block(100 + i) for i in range(12)])
                assert r.stored + r.not_admitted <= 12
                for k in keys[:8]:                                      # never evicted under the lease
                    assert d.manager.tier_of(k) == TierKind.HOST
            proc.send_signal(signal.SIGKILL)                            # the client dies holding it
            proc.wait(DEADLINE)
            # the lease names the client's session (its first call mapped the arena): it ends with it
            wait_for(lambda: d.manager.counters["leases_reclaimed"] >= 1, "the dead client's lease to end")
            assert d.manager.catalogue.num_leases == 0
            assert all(e.pins == 0 for e in d.manager.catalogue.entries())
            with KVStoreClient(d.address, timeout=DEADLINE) as c:       # now evictable: room is made
                assert c.put_from([K(i, "later") for i in range(8)], [block(200 + i) for i in range(8)]).stored == 8
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        d.stop(0)


def test_a_reservation_abandoned_by_a_killed_client_is_reclaimed(daemon):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(ROOT)!r}]
        from kvstore._proto import kvstore_pb2 as pb
        from kvstore.client import KVStoreClient
        c = KVStoreClient({daemon.address!r})
        arena = c.arena()
        reply = c._stub.Reserve(pb.ReserveRequest(keys=[bytes.fromhex(sys.argv[1])], sizes=[65536], ttl_seconds=2),
                                metadata=arena.metadata)
        off = reply.offsets[0]
        arena.array[off:off + 1000] = 7                                  # half written, then killed
        print(reply.status[0], flush=True)
        time.sleep(60)
    """)
    k = K(1, "abandoned")
    used = daemon.manager.used_bytes(0)
    proc = subprocess.Popen([sys.executable, "-c", script, k.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "0"                     # RESERVED
        assert daemon.manager.used_bytes(0) > used and k not in daemon.manager
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE)
        wait_for(lambda: daemon.manager.counters["reservations_reclaimed"] == 1, "the reservation to be reclaimed")
        assert daemon.manager.used_bytes(0) == used and k not in daemon.manager
        with KVStoreClient(daemon.address, timeout=DEADLINE) as c:      # the key is free to put again
            assert c.put_from([k], [block(1)]).stored == 1
            out = np.zeros(64 << 10, dtype=np.uint8)
            assert c.get_into([k], out).found == 1 and (out == block(1)).all()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fallback_to_grpc_gives_the_same_results(daemon, tmp_path):
    keys = [K(i, "fb") for i in range(6)]
    with KVStoreClient(daemon.address, timeout=DEADLINE, shared_memory=False) as c:
        assert not c.shared_memory
        assert c.put_from(keys, np.stack([block(i) for i in range(6)]), sizes=64 << 10).stored == 6
        out = np.zeros((7, 64 << 10), dtype=np.uint8)
        g = c.get_into(keys[:3] + [K(0, "absent")] + keys[3:], out, stop_at_miss=False)
        assert g.sizes == [64 << 10] * 3 + [0] + [64 << 10] * 3 and g.found == 6
        assert (out[4] == block(3)).all() and (out[0] == block(0)).all()
    assert daemon.manager.counters["leases_granted"] == 0             # nothing went through the arena
    tcp = start_server(daemon_config(tmp_path / "tcp", extra={"server": {"listen": "127.0.0.1:0"}}))
    try:
        with KVStoreClient(tcp.address, timeout=DEADLINE) as c:          # remote clients: gRPC only
            assert not c.shared_memory
            with pytest.raises(FeatureDisabled):
                KVStoreClient(tcp.address, shared_memory=True).put_from([keys[0]], [block(0)])
    finally:
        tcp.stop(0)


def test_multi_tenant_daemon_refuses_the_arena_and_binds_leases_to_tenants(tmp_path):
    d = start_server(daemon_config(tmp_path, extra={"server": {"tenants": {"alice": "a" * 32, "bob": "b" * 32}}}))
    try:
        with KVStoreClient(d.address, auth_token="a" * 32, timeout=DEADLINE) as alice, \
                KVStoreClient(d.address, auth_token="b" * 32, timeout=DEADLINE) as bob:
            assert not alice.shared_memory and "multi-tenant" in alice.info().shm_refused
            assert alice.put_from([K(1, "t")], [block(1)]).stored == 1
            lease = alice.lease([K(1, "t")], 10.0)                       # alice's own block
            assert list(lease.sizes) == [64 << 10]
            assert bob.release([lease.lease_id]) == 0                   # bob cannot end alice's lease
            assert list(bob.lease([K(1, "t")], 10.0).sizes) == [0]      # nor see her block
            out = np.zeros(64 << 10, dtype=np.uint8)
            assert bob.get_into([K(1, "t")], out).found == 0
            assert alice.get_into([K(1, "t")], out).found == 1 and (out == block(1)).all()
            assert alice.release([lease.lease_id]) == 1
        mallory = os.path.join(os.path.dirname(d.address[len("unix:"):]), "kvstore.sock.arena")
        assert not os.path.exists(mallory)                             # no arena socket at all
    finally:
        d.stop(0)


def test_arena_socket_checks_the_bearer_token(tmp_path):
    d = start_server(daemon_config(tmp_path, extra={"server": {"auth_token": "t" * 32}}))
    try:
        from kvstore.client.arena_mapping import ArenaMapping
        sock = KVStoreClient(d.address, auth_token="t" * 32).info().shm_socket
        with pytest.raises(OSError, match="bearer token"):
            ArenaMapping(sock, "wrong-token")
        with KVStoreClient(d.address, auth_token="t" * 32, timeout=DEADLINE) as c:
            assert c.shared_memory
        with pytest.raises(Unauthenticated):
            KVStoreClient(d.address, auth_token="x" * 32).info()
    finally:
        d.stop(0)
