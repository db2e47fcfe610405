"""The node (issue 9, items 7 and 9): health tells the truth, one daemon per TCP port.

Health: with the host tier full of blocks that only it holds and the NVMe folder replaced
by a file, puts fail; gRPC health says NOT_SERVING for every service and Stats says why
(``serving`` false, ``problems`` naming the folder and the failing puts), and it stays so
while the folder is broken. Once the folder is back, puts succeed and health says SERVING.
Verdicts wait for the health monitor's verdict with generous deadlines.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.daemon import daemon_config
from kvstore import config
from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from kvstore.service.health import SERVICES
from kvstore.service.startup import start_server
from rel_support import key

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BLOCK = 512 << 10


def health(address: str) -> set:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return {stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=20).status for s in SERVICES}


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_full_host_and_broken_nvme_folder_is_not_serving_until_repaired(tmp_path):
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme="64MiB"))
    nvme = tmp_path / "nvme"
    moved = tmp_path / "nvme.moved"
    try:
        with KVStoreClient(d.address, shared_memory=False, timeout=30) as c:
            assert health(d.address) == {SERVING}
            os.rename(nvme, moved)
            nvme.write_text("not a folder")
            wait_for(lambda: any("not a folder" in p for p in c.stats()["problems"]), "the folder problem in Stats")
            assert c.stats()["serving"] is True             # the host tier still takes puts

            failed = None
            for i in range(64):                               # fill the host tier; then demotions fail
                try:
                    c.put([(key(i, "h"), bytes([i % 251]) * BLOCK)])
                except errors.StoreUnavailable as e:
                    failed = e
                    break
            assert failed is not None, "puts kept succeeding with a full host tier and a broken NVMe folder"
            wait_for(lambda: health(d.address) == {NOT_SERVING}, "NOT_SERVING")
            stats = c.stats()
            assert stats["serving"] is False
            assert any("nvme" in p and "not a folder" in p for p in stats["problems"]), stats["problems"]
            assert any(p.startswith("puts are failing") for p in stats["problems"]), stats["problems"]

            d.monitor.window_s = 0.0                          # the failure does not age out while the
            assert d.monitor.check() is False                 # folder is still broken

            nvme.unlink()
            os.rename(moved, nvme)
            wait_for(lambda: not any("folder" in p for p in c.stats()["problems"]), "the folder problem to clear")
            assert c.put([(key(999, "h"), b"z" * BLOCK)]).stored == 1
            wait_for(lambda: health(d.address) == {SERVING}, "SERVING again")
            assert c.stats()["serving"] is True and c.stats()["problems"] == []
            assert c.get([key(0, "h")])[0].data == bytes([0]) * BLOCK    # nothing stored was lost
    finally:
        if moved.exists():
            if nvme.is_file():
                nvme.unlink()
            os.rename(moved, nvme)
        d.stop(0)


def test_health_recovers_when_the_folder_comes_back_without_a_put(tmp_path):
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme="64MiB"))
    nvme = tmp_path / "nvme"
    try:
        shutil.rmtree(nvme)
        wait_for(lambda: any("is gone" in p for p in d.monitor.problems), "the missing folder to be reported")
        d.manager.writes.put_failure = (time.monotonic(), "nvme: test failure")
        d.monitor.window_s = 0.5
        wait_for(lambda: health(d.address) == {NOT_SERVING}, "NOT_SERVING")
        nvme.mkdir()
        wait_for(lambda: health(d.address) == {SERVING}, "SERVING once the folder is back and the failure aged")
    finally:
        d.stop(0)


# ------------------------------------------------------------------ item 9: one daemon per TCP port

def tcp_config(tmp_path, name: str, port: int) -> config.Config:
    cfg = daemon_config(tmp_path / name, host="4MiB", nvme="16MiB")
    return config.replace(cfg, server=dataclasses.replace(cfg.server, listen=f"127.0.0.1:{port}"))


def test_a_second_daemon_on_the_same_tcp_port_is_refused(tmp_path):
    first = start_server(tcp_config(tmp_path, "a", 0))
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(errors.ConfigError, match=rf"server.listen: cannot bind 127.0.0.1:{port}: the port is in use"):
            start_server(tcp_config(tmp_path, "b", port))
        with KVStoreClient(first.address, timeout=20) as c:           # the first one still serves alone
            assert c.put([(key(1), b"one")]).stored == 1
            assert c.get([key(1)])[0].data == b"one"
    finally:
        first.stop(0)


# ------------------------------------------------------------------ issue 19, item 15: one oversized put

def test_an_oversized_put_is_refused_alone_and_health_stays_serving(tmp_path):
    """A block too big for every tier says nothing about the tiers: only that put is
    refused (RESOURCE_EXHAUSTED naming its size and each tier's largest block), health
    stays SERVING for every service and Stats has no problem, and normal puts go on."""
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme="8MiB"))
    big = 12 << 20
    try:
        nvme_most = d.manager.tiers[1].max_block_bytes
        for shared in (False, True):                          # gRPC, and the same-node arena first
            with KVStoreClient(d.address, shared_memory=shared, timeout=30) as c:
                with pytest.raises(errors.TierFull) as e:
                    c.put([(key(1, f"big{shared}"), b"x" * big)])
                assert (f"a {big}-byte block is larger than the largest block a tier can hold "
                        f"(host: {4 << 20} bytes, nvme: {nvme_most} bytes)") in str(e.value)
                for _ in range(3):
                    assert d.monitor.check() is True          # the health verdict, taken now
                assert health(d.address) == {SERVING}
                stats = c.stats()
                assert stats["serving"] is True and stats["problems"] == []
                assert c.put([(key(2, f"small{shared}"), b"s" * BLOCK)]).stored == 1
                assert c.get([key(2, f"small{shared}")])[0].data == b"s" * BLOCK
        counters = d.manager.counters
        assert counters["puts_too_large"] == 2 and counters.get("puts_rejected_full") == 0
    finally:
        d.stop(0)


def test_tiers_full_of_leased_blocks_still_turn_health_not_serving(tmp_path):
    """A tier-wide condition still counts: with every block of the only tier leased, a
    put that fits a tier finds no room; health says NOT_SERVING until a put succeeds."""
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None))
    try:
        keys = [key(i, "pinned") for i in range(4)]
        with KVStoreClient(d.address, shared_memory=False, timeout=30) as c:
            c.put([(k, bytes([i]) * (1 << 20)) for i, k in enumerate(keys)])
            grant = d.manager.lease(keys, 60.0, max_bytes=1 << 30)
            assert sum(b.found for b in grant.blocks) == 4
            with pytest.raises(errors.TierFull, match="no tier can hold"):
                c.put([(key(9, "pinned"), b"n" * (1 << 20))])
            assert d.monitor.check() is False
            wait_for(lambda: health(d.address) == {NOT_SERVING}, "NOT_SERVING")
            assert any(p.startswith("puts are failing") for p in c.stats()["problems"])
            assert d.manager.release(grant.lease_id)
            assert c.put([(key(9, "pinned"), b"n" * (1 << 20))]).stored == 1
            wait_for(lambda: health(d.address) == {SERVING}, "SERVING again")
    finally:
        d.stop(0)
