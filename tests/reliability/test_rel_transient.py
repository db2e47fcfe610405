"""Transient is not corruption (issue 19, item 12): with the daemon out of file
descriptors (EMFILE) or its disk failing a read (EIO, ENOSPC) during a Get, every NVMe
block was dropped and its file deleted (``read_errors = 4``). Only a failed checksum or
a malformed header proves a copy bad: any other failure is a miss for that call (or the
block is served from another tier), counted in ``read_errors``, and the copy is kept
and read right once the fault is gone. A flipped byte is still detected and dropped.

Faults: the daemon's open-file limit lowered from outside (``resource.prlimit``) in a
subprocess daemon, or the NVMe tier's file open replaced by one that fails.
"""

from __future__ import annotations

import errno
import os
import pathlib
import resource

import pytest

import tiers.nvme.tier
from support.daemon import daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.policy import make_policy
from kvstore.service.startup import start_server
from kvstore.store.manager import TierManager
from rel_support import DaemonProcess, MemTier, key, payload, short_socket_dir, write_toml
from tiers.base import TierKind
from tiers.nvme.format import block_path
from tiers.errors import MediaIOError
from tiers.host import HostTier
from tiers.nvme.tier import NVMeTier

BLOCK = 96 << 10


class FailingOpen:
    """The ``os`` module as the NVMe tier sees it, with ``open`` failing with ``err``
    while ``on``."""

    def __init__(self, err: int):
        self.err, self.on = err, True

    def __getattr__(self, attr: str):
        return getattr(os, attr)

    def open(self, *args, **kwargs):
        if self.on:
            raise OSError(self.err, os.strerror(self.err))
        return os.open(*args, **kwargs)


def nvme_only(tmp_path, n: int = 4) -> tuple[TierManager, list[bytes]]:
    """A manager (host over NVMe, async copies as in the daemon) whose ``n`` blocks are on
    NVMe only: put, then the manager restarted over the same folder."""
    keys = [key(i, "transient") for i in range(n)]
    m = open_manager(tmp_path)
    for k in keys:
        m.put(k, payload(k, BLOCK))
    m.persist()
    m.close()
    return open_manager(tmp_path), keys


def open_manager(tmp_path) -> TierManager:
    tiers = [HostTier(4 << 20, name="host"), NVMeTier(tmp_path / "nvme", 64 << 20, name="nvme", direct=False)]
    return TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], async_moves=True)


def block_file(tier: NVMeTier, k: bytes) -> pathlib.Path:
    return pathlib.Path(block_path(str(pathlib.Path(tier.path) / "blocks"), k))


@pytest.mark.parametrize("err", [errno.EMFILE, errno.EIO, errno.ENOSPC], ids=errno.errorcode.get)
def test_a_transient_read_failure_is_a_miss_and_the_block_is_kept(tmp_path, monkeypatch, err):
    m, keys = nvme_only(tmp_path)
    nvme = m.tiers[1]
    try:
        fault = FailingOpen(err)
        monkeypatch.setattr(tiers.nvme.tier, "os", fault)
        assert [m.get(k).found for k in keys] == [False] * 4          # a miss for that call
        assert m.counters["read_errors"] == 4 and m.counters.get("corrupt_blocks") == 0
        assert m.lookup(keys).hit_blocks == 4                          # still stored
        assert all(block_file(nvme, k).exists() and k in nvme for k in keys)
        fault.on = False
        got = [m.get(k) for k in keys]
        assert [(g.tier, bytes(g.data)) for g in got] == [(TierKind.NVME, payload(k, BLOCK)) for k in keys]
    finally:
        m.close()


class FlakyHost(MemTier):
    """A host tier whose reads fail (MediaIOError) while ``failing``."""

    failing = False

    def read_into(self, key, out, ranges=None):
        if self.failing:
            raise MediaIOError(f"{self.name}: injected read failure")
        return super().read_into(key, out, ranges)


def test_a_copy_whose_medium_fails_is_kept_and_the_next_copy_serves(tmp_path):
    host = FlakyHost(TierKind.HOST, 4 << 20)
    nvme = NVMeTier(tmp_path / "nvme", 64 << 20, name="nvme", direct=False)
    m = TierManager([host, nvme], [make_policy("lru", t.capacity_bytes) for t in (host, nvme)],
                    write_policy="write_through", promote_on_get=False)    # no copy comes back by promotion
    try:
        k = key(1, "flaky")
        m.put(k, payload(k, BLOCK))
        host.failing = True
        got = m.get(k)
        assert got.tier == TierKind.NVME and bytes(got.data) == payload(k, BLOCK)
        assert m.counters["read_errors"] == 1 and k in host and m.tier_of(k) == TierKind.HOST
        host.failing = False
        assert m.get(k).tier == TierKind.HOST
    finally:
        m.close()


def test_a_flipped_byte_is_still_dropped(tmp_path):
    m, keys = nvme_only(tmp_path)
    nvme = m.tiers[1]
    try:
        path = block_file(nvme, keys[0])
        with open(path, "r+b") as f:
            f.seek(nvme._index.entries[keys[0]].header_bytes + 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        assert not m.get(keys[0]).found
        assert m.counters["corrupt_blocks"] == 1 and m.counters.get("read_errors") == 0
        assert keys[0] not in nvme and m.lookup(keys[:1]).hit_blocks == 0
        assert bytes(m.get(keys[1]).data) == payload(keys[1], BLOCK)
    finally:
        m.close()


def test_a_get_through_the_daemon_is_a_miss_during_the_fault(tmp_path, monkeypatch):
    """The Get stream turns a read failure of every copy into a miss of that block (a
    FAILED record), not an error of the call; the block is served once the fault is gone."""
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="64MiB"))
    try:
        big = [(key(i, "big"), payload(key(i, "big"), 2 << 20)) for i in range(2)]   # too big for the host
        with KVStoreClient(d.address, shared_memory=False, timeout=30) as c:
            c.put(big)
            fault = FailingOpen(errno.EMFILE)
            monkeypatch.setattr(tiers.nvme.tier, "os", fault)
            assert [g.found for g in c.get([k for k, _ in big])] == [False, False]
            stats = c.stats()["counters"]
            assert stats["read_errors"] == 2 and stats.get("corrupt_blocks", 0) == 0
            fault.on = False
            assert [bytes(g.data) for g in c.get([k for k, _ in big])] == [v for _, v in big]
    finally:
        d.stop(0)


def test_a_daemon_out_of_file_descriptors_keeps_its_nvme_blocks(tmp_path):
    """The issue's input: a subprocess daemon whose open-file limit is exhausted during
    Gets (lowered from outside below the descriptors it has open: every open fails with
    EMFILE, the connection it has keeps serving)."""
    sock = short_socket_dir()
    cfg = write_toml(tmp_path / "node.toml", {
        "server": {"listen": f"unix:{sock}/kvstore.sock", "workers": 4},
        "tiers": {"host": {"capacity": "1MiB"}, "nvme": {"path": str(tmp_path / "nvme"), "capacity": "256MiB"}},
    })
    d = DaemonProcess(cfg, f"unix:{sock}/kvstore.sock", tmp_path / "daemon.log").start()
    try:
        blocks = [(key(i, "emfile"), payload(key(i, "emfile"), 2 << 20)) for i in range(4)]   # NVMe only
        with KVStoreClient(d.address, shared_memory=False, timeout=30) as c:
            c.put(blocks)
            assert [g.found for g in c.get([k for k, _ in blocks[:1]])] == [True]   # connection warm
            soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (0, hard))        # every new descriptor: EMFILE
            try:
                got = c.get([k for k, _ in blocks])
            finally:
                resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
            assert [g.found for g in got] == [False] * 4, d.log_tail()
            stats = c.stats()
            assert stats["counters"]["read_errors"] == 4 and stats["counters"].get("corrupt_blocks", 0) == 0
            files = list((tmp_path / "nvme" / "blocks").rglob("*"))
            assert sum(1 for p in files if p.is_file()) == 4                    # no file was deleted
            assert [bytes(g.data) for g in c.get([k for k, _ in blocks])] == [v for _, v in blocks]
    finally:
        d.stop()
