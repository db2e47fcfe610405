"""KV events never leave a router with a wrong view of the node (issue 19, items 8 and 9).

A router that follows the documented protocol (tests/support/router.py: apply batches in
order, ask the replay endpoint on a gap, start over when the numbers restart) ends with
exactly the daemon's blocks: after its event queue overflowed under a burst of puts, after
a start-up recovering more blocks than the queue holds, when it joins late, when it asks
for batches the replay buffer no longer keeps, and after the daemon restarted while it was
away. Verdicts wait on events with generous deadlines.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from support.daemon import daemon_config, short_socket_dir
from support.router import Router, true_blocks
from kvstore.client.client import KVStoreClient
from kvstore.common.types import BlockMeta
from kvstore.service.startup import start_server

DEADLINE = 60.0


def K(i: int) -> bytes:
    return hashlib.sha256(f"resync-{i}".encode()).digest()


def block(i: int, n: int = 4096) -> np.ndarray:
    return np.full(n, i % 251, dtype=np.uint8)


def meta(i: int) -> BlockMeta:
    return BlockMeta(engine_hash=f"vllm-{i}".encode(), parent_engine_hash=f"vllm-{i - 1}".encode() if i else b"",
                     token_ids=tuple(range(16)), block_tokens=16)


def events_config(folder, **events) -> dict:
    return {"events": {"enabled": True, "endpoint": f"ipc://{folder}/ev", "replay_endpoint": f"ipc://{folder}/replay",
                       "batch_ms": 0.0, **events}, "blocks": {"block_tokens": 16}}


def converge(router: Router, daemon, what: str) -> None:
    """Follow the stream until the router's view is the daemon's (AssertionError after DEADLINE)."""
    router.follow(lambda: router.blocks == true_blocks(daemon.manager), what, DEADLINE)


def put_each(address: str, ids, with_meta: bool = True, nbytes: int = 4096) -> None:
    with KVStoreClient(address, timeout=DEADLINE) as c:
        ids = list(ids)
        c.put_from([K(i) for i in ids], [block(i, nbytes) for i in ids],
                   meta=[meta(i) for i in ids] if with_meta else None)


def wait_until_subscribed(router: Router, address: str) -> None:
    """Put probe blocks until the router receives a batch (a SUB socket misses what is sent
    before its subscription arrives)."""
    deadline = time.monotonic() + DEADLINE
    i = 10_000
    while not router.poll(100):
        assert time.monotonic() < deadline, "the router receives nothing"
        put_each(address, [i])
        i += 1


def test_a_burst_larger_than_the_queue_reaches_a_slow_router(tmp_path):
    folder = short_socket_dir()
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme="16MiB",
                                   extra=events_config(folder, max_queue=1, hwm=4)))
    router = Router(d.events.endpoint, d.events.replay_endpoint, rcvhwm=4)
    try:
        wait_until_subscribed(router, d.address)
        put_each(d.address, range(400))           # 400 blocks through a queue of 1, nobody reading
        time.sleep(0.5)                           # the router is slow: it reads only now
        converge(router, d, "the router's view of 400 blocks")
        assert {meta(i).engine_hash for i in range(400)} <= {h for h, _, _ in router.blocks}
        assert d.manager.counters["events_dropped"] > 0              # the queue did overflow ...
        assert d.manager.counters["events_snapshots"] >= 2           # ... and a snapshot replaced what it dropped
    finally:
        router.close()
        d.stop(0)


def test_a_start_up_recovering_more_blocks_than_the_queue_reaches_the_router(tmp_path):
    folder = short_socket_dir()
    cfg = daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra=events_config(folder))
    first = start_server(cfg)
    try:
        put_each(first.address, range(300), with_meta=False)
    finally:
        first.stop(5)                             # every block kept on NVMe
    router = Router(f"ipc://{folder}/ev", f"ipc://{folder}/replay")   # connected before the daemon binds
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra=events_config(folder, max_queue=16)))
    try:
        assert len(d.manager) == 300
        converge(router, d, "the 300 recovered blocks")
        assert {m for _, m, _ in router.blocks} == {"STORAGE"}
    finally:
        router.close()
        d.stop(0)


def test_a_router_that_joins_late_gets_every_block(tmp_path):
    folder = short_socket_dir()
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra=events_config(folder)))
    try:
        put_each(d.address, range(40), nbytes=64 << 10)     # before anyone listens; some demoted to NVMe
        late = Router(d.events.endpoint, d.events.replay_endpoint)
        try:
            converge(late, d, "a late router's view")
            assert {m for _, m, _ in late.blocks} == {"CPU", "STORAGE"}
        finally:
            late.close()
    finally:
        d.stop(0)


def test_a_replay_of_batches_no_longer_buffered_is_answered_by_a_snapshot(tmp_path):
    folder = short_socket_dir()
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None, extra=events_config(folder, buffer_steps=2)))
    router = Router(d.events.endpoint, d.events.replay_endpoint)
    try:
        wait_until_subscribed(router, d.address)
        i = 0
        while router.last is None or router.last < 6:     # more batches than the buffer keeps
            put_each(d.address, [i])
            i += 1
            router.poll(100)
            assert i < 1000, "the daemon sends no batches"
        snapshots = d.manager.counters["events_snapshots"]
        router.last = 0                                   # as if it had missed everything after batch 0
        router.blocks.clear()
        put_each(d.address, [i])                          # the next batch shows the gap
        converge(router, d, "the view after an unanswerable replay")
        assert router.replays >= 1
        assert d.manager.counters["events_snapshots"] > snapshots
    finally:
        router.close()
        d.stop(0)


def test_a_router_away_during_a_restart_ends_with_the_restarted_daemons_blocks(tmp_path):
    folder = short_socket_dir()
    cfg = daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra=events_config(folder))
    first = start_server(cfg)
    router = Router(first.events.endpoint, first.events.replay_endpoint)
    try:
        put_each(first.address, range(40), nbytes=64 << 10)     # 2.5 MiB: some demoted to NVMe
        converge(router, first, "the first daemon's blocks")
        assert {m for _, m, _ in router.blocks} == {"CPU", "STORAGE"}
        router.disconnect()                       # the router is away ...
        first.stop(0, persist_s=0)                # ... while the daemon dies: its host blocks are lost
        d = start_server(daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra=events_config(folder)))
        try:
            deadline = time.monotonic() + DEADLINE
            while d.manager.counters["events_published"] < 1 + len(d.manager):   # its start-up events went to nobody
                assert time.monotonic() < deadline, "no start-up snapshot"
                time.sleep(0.05)
            router.connect()
            converge(router, d, "the restarted daemon's blocks")
            assert {m for _, m, _ in router.blocks} == {"STORAGE"}
            assert router.restarts == 1
        finally:
            d.stop(0)
    finally:
        router.close()


@pytest.mark.parametrize("interval", [0.3])
def test_a_periodic_snapshot_is_sent_when_configured(tmp_path, interval):
    folder = short_socket_dir()
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None,
                                   extra=events_config(folder, snapshot_interval_s=interval)))
    router = Router(d.events.endpoint, d.events.replay_endpoint)
    try:
        put_each(d.address, range(3))
        router.follow(lambda: router.cleared >= 3, "three snapshots")
        assert router.blocks == true_blocks(d.manager)
    finally:
        router.close()
        d.stop(0)
