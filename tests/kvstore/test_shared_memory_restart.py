"""A same-node client that outlives its daemon: the daemon restarts on the same socket
with a new shared arena, while the client still maps the old one. Its next get_into and
put_from must give and store the right bytes (through the new arena or gRPC), never
copy from or into the old mapping: that would serve wrong KV to every client."""

from __future__ import annotations

import hashlib

import numpy as np

from support.daemon import daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server


def K(i: int) -> bytes:
    return hashlib.sha256(f"restart-{i}".encode()).digest()


def block(i: int, n: int = 16 << 10) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_a_client_that_outlives_its_daemon_never_uses_the_old_arena(tmp_path):
    cfg = daemon_config(tmp_path)
    d = start_server(cfg)
    c = KVStoreClient(d.address, timeout=20)
    try:
        assert c.shared_memory
        c.put_from([K(1)], block(1).reshape(1, -1))
        d.stop(0)                                   # K(1) is kept on NVMe
        d = start_server(cfg)                       # the same socket, a new arena
        out = np.zeros((1, block(1).size), np.uint8)
        got = c.get_into([K(1)], out)
        assert got.found == 1
        assert np.array_equal(out[0], block(1))
        assert c.put_from([K(2)], block(2).reshape(1, -1)).stored == 1
        with KVStoreClient(d.address, timeout=20, shared_memory=False) as fresh:
            r = fresh.get([K(2)])[0]
            assert r.found and r.data == block(2).tobytes()
        # and the client goes on through the new daemon's arena
        out2 = np.zeros((1, block(2).size), np.uint8)
        assert c.get_into([K(2)], out2).found == 1 and np.array_equal(out2[0], block(2))
        assert c.put_from([K(3)], block(3).reshape(1, -1)).stored == 1
        assert d.manager.counters["leases_granted"] >= 1 and c.shared_memory
    finally:
        c.close()
        d.stop(0)
