"""A same-node client never uses a lease or reservation near or past its TTL.

A client that stalls (a GC pause, a stopped process) after its Lease or Reserve could copy
out of, or write into, arena space the daemon has since given to other blocks: wrong KV read
or, worse, another block overwritten. The client times each lease and reservation from the
moment it asked (``kvstore.client.arena.SAFE_FRACTION`` of the TTL) and goes by gRPC instead.
The stall is simulated by the client's clock jumping after the request was sent.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import arena as client_arena
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import InvalidRequest
from kvstore.service.startup import start_server
from kvstore.service.validate import MIN_TTL_S, check_ttl
from support.daemon import daemon_config

BLOCK = 32 << 10


class JumpingClock:
    """Real time, plus ``jump`` seconds from the ``after``-th reading on."""

    def __init__(self, after: int, jump: float):
        self.after, self.jump, self.readings = after, jump, 0

    def __call__(self) -> float:
        self.readings += 1
        return client_arena.time.monotonic() + (self.jump if self.readings > self.after else 0.0)


@pytest.fixture
def daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None))
    yield d
    d.stop(0)


def blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(n)], rng.integers(0, 256, (n, BLOCK), dtype=np.uint8)


def test_a_copy_that_outlived_its_lease_is_read_again_by_grpc(daemon, monkeypatch):
    monkeypatch.setenv("KVSTORE_BLOCK_TABLE", "0")        # leases are what this tests (the table needs none)
    keys, data = blocks(8, 1)
    with KVStoreClient(daemon.address, shared_memory=True, lease_ttl_s=30.0) as c:
        assert c.put_from(keys, data).stored == 8
        reads = c.stats()["counters"].get("reads", 0)
        monkeypatch.setattr(client_arena, "_clock", JumpingClock(after=1, jump=3600.0))
        out = np.zeros_like(data)
        got = c.get_into(keys, out)
        assert got.found == 8 and np.array_equal(out, data)
        assert c.stats()["counters"]["reads"] == reads + 8       # served again by gRPC


def test_a_reservation_too_old_to_write_is_aborted_and_put_by_grpc(daemon, monkeypatch):
    keys, data = blocks(8, 2)
    with KVStoreClient(daemon.address, shared_memory=True, lease_ttl_s=30.0) as c:
        assert c.shared_memory
        monkeypatch.setattr(client_arena, "_clock", JumpingClock(after=1, jump=3600.0))
        res = c.put_from(keys, data)
        assert res.stored == 8 and res.bytes_stored == 8 * BLOCK
        counters = c.stats()["counters"]
        assert counters["puts_aborted"] == 8                      # the reservations, released at once
        assert not daemon.manager.catalogue._claims               # nothing left open
        monkeypatch.setattr(client_arena, "_clock", client_arena.time.monotonic)
        out = np.zeros_like(data)
        assert c.get_into(keys, out).found == 8 and np.array_equal(out, data)


def test_leases_and_reservations_shorter_than_a_second_are_refused():
    assert check_ttl(0, "ttl_seconds", 30.0, 600.0) == 30.0
    assert check_ttl(MIN_TTL_S, "ttl_seconds", 30.0, 600.0) == MIN_TTL_S
    for bad in (5e-324, 0.5, 0.999):
        with pytest.raises(InvalidRequest):
            check_ttl(bad, "ttl_seconds", 30.0, 600.0)
