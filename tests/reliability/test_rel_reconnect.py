"""A client that outlives an outage, one that starts before its daemon, and clients that
are dropped without ``close()`` (issue 19, items 4, 5 and 11).

- Reconnect: a client's channel retries every second at most after an outage (gRPC's
  default back-off grows to 120 s: after a 15 s outage an existing client took 13 s to
  reconnect). The test stops a daemon for 15 s of failing calls, restarts it on the same
  socket and measures how soon the existing client's calls succeed (printed, asserted
  against a generous 5 s).
- A daemon that appears later: a client made before its daemon asks the daemon's offer
  again once it answers, and maps the shared arena (it used to check once, fail, and use
  gRPC for ever).
- A dropped client: its finalizer closes the channel, stops the lease-release thread and
  unmaps the arena; 30 dropped clients leave the process's threads, descriptors and
  arena mappings as they were.
"""

from __future__ import annotations

import gc
import os
import pathlib
import threading
import time

import numpy as np
import pytest

from support.daemon import daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.common import errors
from kvstore.common.transport import RECONNECT_BACKOFF_MS, client_channel_options
from kvstore.service.startup import start_server
from rel_support import DaemonProcess, key, short_socket_dir, write_toml


def daemon_process(tmp_path: pathlib.Path) -> DaemonProcess:
    address = f"unix:{short_socket_dir()}/kvstore.sock"
    cfg = write_toml(tmp_path / "kvstore.toml", {
        "server": {"listen": address, "workers": 4},
        "tiers": {"host": {"capacity": "32MiB"},
                  "nvme": {"enabled": False, "path": str(tmp_path / "nvme"), "capacity": "1MiB"}},
    })
    return DaemonProcess(cfg, address, tmp_path / "daemon.log")


def wait_until(predicate, timeout: float = 60.0, step: float = 0.02) -> float:
    """Seconds until ``predicate()`` is true; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not true after {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def answers(c: KVStoreClient, k: bytes) -> bool:
    """Whether a Lookup of ``k`` is answered (hit or miss)."""
    try:
        c.lookup([k], timeout=2)
    except errors.StoreUnavailable:
        return False
    return True


# ------------------------------------------------------------------ item 4: reconnect

def test_a_client_channel_retries_within_a_second():
    opts = dict(client_channel_options(1 << 20))
    assert opts["grpc.max_reconnect_backoff_ms"] == RECONNECT_BACKOFF_MS[1] <= 1000
    assert opts["grpc.initial_reconnect_backoff_ms"] == RECONNECT_BACKOFF_MS[0]
    assert "grpc.min_reconnect_backoff_ms" not in opts      # gRPC takes it as the connect timeout too


@pytest.mark.slow
def test_an_existing_client_reconnects_soon_after_a_15_s_outage(tmp_path):
    d = daemon_process(tmp_path).start()
    c = KVStoreClient(d.address, timeout=10, shared_memory=False)
    try:
        assert answers(c, key(1))
        d.kill()
        t_down = time.monotonic()
        failures = 0
        while time.monotonic() - t_down < 15.0:          # 15 s of failing calls: gRPC backs off meanwhile
            assert not answers(c, key(1))
            failures += 1
            time.sleep(0.05)
        d.start()                                        # the same socket; ready when a new channel is served
        took = wait_until(lambda: answers(c, key(1)), 60)
        print(f"\nexisting client answered {took:.2f} s after the daemon was ready again "
              f"({failures} failed calls during the 15 s outage)")
        assert took < 5.0
    finally:
        c.close()
        d.stop()


# ------------------------------------------------------------------ item 5: a daemon that appears later

def test_a_client_made_before_its_daemon_maps_the_arena_once_it_is_up(tmp_path):
    cfg = daemon_config(tmp_path, nvme=None)
    c = KVStoreClient(cfg.server.listen, timeout=5)
    rows = np.arange(4 * 1024, dtype=np.uint8).reshape(4, 1024)
    keys = [key(i, "late") for i in range(4)]
    try:
        with pytest.raises(errors.StoreUnavailable):
            c.put_from(keys, rows)
        with pytest.raises(errors.StoreUnavailable):
            c.get_into(keys, np.zeros_like(rows))
        d = start_server(cfg)
        try:
            wait_until(lambda: _put_ok(c, keys, rows))
            out = np.zeros_like(rows)
            assert c.get_into(keys, out).found == 4 and np.array_equal(out, rows)
            counters = d.manager.counters
            assert counters.get("reads", 0) == 0             # the same-node path, not gRPC
            assert c.shared_memory and c.arena() is not None
        finally:
            d.stop(0)
    finally:
        c.close()


def _put_ok(c: KVStoreClient, keys, rows) -> bool:
    try:
        return c.put_from(keys, rows).stored + c.put_from(keys, rows).already_present >= 4
    except errors.StoreUnavailable:
        return False


# ------------------------------------------------------------------ item 11: dropped clients

def _counts() -> tuple[int, int, int, int]:
    maps = sum(1 for line in open("/proc/self/maps") if "kvstore-host-arena" in line)
    return (threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), maps)


def test_dropped_clients_release_their_thread_socket_and_arena(tmp_path):
    d = daemon_process(tmp_path).start()
    keys = [key(i, "drop") for i in range(4)]
    rows = np.full((4, 4096), 3, np.uint8)
    try:
        with KVStoreClient(d.address, timeout=20) as warm:          # grpc's own threads exist from here on
            warm.put_from(keys, rows)
            warm.get_into(keys, np.zeros_like(rows))
        gc.collect()
        time.sleep(0.5)
        base = _counts()
        for _ in range(30):
            c = KVStoreClient(d.address, timeout=20)
            assert c.get_into(keys, np.zeros_like(rows)).found == 4   # maps the arena, leases, release thread
            assert c.arena() is not None
            del c
        gc.collect()

        def back() -> bool:
            gc.collect()
            now = _counts()
            return now[0] <= base[0] + 1 and now[1] <= base[1] + 4 and now[2] <= base[2] + 4 and now[3] <= base[3]
        wait_until(back, 60, 0.1)
        print(f"\nthreads, tasks, fds, arena mappings: before {base}, after 30 dropped clients {_counts()}")
    finally:
        d.stop()
