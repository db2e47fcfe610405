"""Disk full: the NVMe tier's folder on a small filesystem (an 8 MiB tmpfs, mounted by the
test when it runs as root) while its configured capacity is 64 MiB; and, everywhere, an
injected ENOSPC.

Expected: a put that hits the full disk fails with RESOURCE_EXHAUSTED (or, when the block
was being demoted, a clear error naming the disk), the tier lowers its capacity to what it
holds, later puts evict instead of failing, the daemon keeps serving, and nothing served is
ever corrupt.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest

from support.daemon import daemon_config
from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from rel_support import key, payload
from tiers.base import read_bytes
from tiers.errors import DiskFull
from tiers.nvme.tier import NVMeTier

BLOCK = 256 << 10
FS_BYTES = 8 << 20


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs at ``tmp_path/small``; skips when it cannot be mounted."""
    where = tmp_path / "small"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small filesystem")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount an {FS_BYTES >> 20} MiB tmpfs (needs root): {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def put_many(c: KVStoreClient, tag: str, n: int) -> tuple[list[bytes], list[str]]:
    """Put ``n`` blocks one by one; returns the acknowledged keys and the errors."""
    acked, failures = [], []
    for i in range(n):
        k = key(i, tag)
        try:
            c.put([(k, payload(k, BLOCK))])
            acked.append(k)
        except errors.KVStoreError as e:
            failures.append(str(e))
    return acked, failures


def check_served(c: KVStoreClient, keys: list[bytes]) -> int:
    """Every block served is whole and right; returns how many are served."""
    served = 0
    for i in range(0, len(keys), 16):
        for g in c.get(keys[i:i + 16]):
            if g.found:
                assert g.data == payload(g.key, BLOCK), f"corrupt block {g.key.hex()[:16]} served"
                served += 1
    return served


@pytest.mark.parametrize("layout", ["nvme only", "host and nvme"])
def test_disk_smaller_than_the_configured_capacity(small_fs, layout):
    extra = {"tiers": {"host": {"enabled": False}}} if layout == "nvme only" else None
    d = start_server(daemon_config(small_fs, host="1MiB", nvme="64MiB", extra=extra))
    try:
        with KVStoreClient(d.address, timeout=20) as c:
            acked, failures = put_many(c, "df", 3 * FS_BYTES // BLOCK)      # 3x what the disk holds
            if layout == "nvme only":
                assert failures, "the 8 MiB filesystem never filled up"
            # with host + NVMe, a demotion that hits the full disk is retried once after the
            # NVMe tier shrank to what the disk holds, so puts may all succeed by evicting
            for f in failures:
                if layout == "nvme only":
                    assert f.startswith("RESOURCE_EXHAUSTED") and "disk full" in f, f
                else:
                    assert "disk full" in f, f
            assert len(failures) <= 2, f"the tier did not adapt to the full disk: {len(failures)} failures"
            _, later = put_many(c, "df-after", 8)                           # puts now evict instead
            assert later == []
            served = check_served(c, acked)
            assert 0 < served < len(acked)                                   # evicted ones are misses
            stats = c.stats()
            nvme = next(t for t in stats["tiers"] if t["name"] == "nvme")
            assert nvme["capacity_bytes"] <= FS_BYTES and nvme["used_bytes"] <= nvme["capacity_bytes"]
            assert stats["counters"].get("corrupt_blocks", 0) == 0
            assert stats["counters"]["evictions_nvme"] > 0
        d.manager.drain(20) if hasattr(d.manager, "drain") else None
    finally:
        d.stop(0)
    # after a restart the blocks on the full disk are all intact
    d = start_server(daemon_config(small_fs, host="1MiB", nvme="64MiB", extra=extra))
    try:
        with KVStoreClient(d.address, timeout=20) as c:
            assert check_served(c, acked) > 0
    finally:
        d.stop(0)


def fake_full_disk(monkeypatch) -> dict:
    """A disk that is full while the returned ``{"on": ...}`` is true: ``os.pwritev`` (how the
    NVMe tier writes block files) fails with ENOSPC and ``os.statvfs`` reports no free blocks."""
    real_pwritev, real_statvfs = os.pwritev, os.statvfs
    full = {"on": False}

    def pwritev(fd, buffers, offset, *flags):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset, *flags)

    def statvfs(path):
        st = real_statvfs(path)
        if not full["on"]:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0) + tuple(st)[5:])

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "statvfs", statvfs)
    return full


@pytest.mark.parametrize("drop", ["free", "evict"])
def test_after_the_disk_fills_spare_files_make_room_for_new_blocks(small_fs, drop):
    """Spare files left by many small blocks hold the little disk there is; once the disk
    has filled up, a larger block's reservation removes spare files for its file instead
    of failing every put."""
    t = NVMeTier(small_fs / "nvme", 64 << 20, direct=False)
    drop_block = getattr(t, drop)           # evict: the files are parked, not spare files yet
    try:
        keys = [key(i, "small") for i in range(90)]
        for k in keys:
            put_block(t, k, payload(k, 60 << 10))
        for k in keys:
            drop_block(k)
        held: list[bytes] = []
        failed = put_dropping(t, drop_block, [key(i, "large") for i in range(40)], 1 << 20, held, held)
        assert failed <= 2 and len(held) >= 4        # the first ENOSPC teaches the tier the disk's size
        assert all(read_bytes(t, k) == payload(k, 1 << 20) for k in held)
    finally:
        t.close()


@pytest.mark.parametrize("drop", ["free", "evict"])
def test_after_the_disk_fills_the_files_of_large_blocks_freed_make_room_for_small_ones(small_fs, drop):
    """Large blocks freed on a full disk leave spare files no small block takes (a spare
    file is taken only by a block at least as large): a small block's reservation removes
    them for its file instead of failing every put."""
    t = NVMeTier(small_fs / "nvme", 64 << 20, direct=False)
    drop_block = getattr(t, drop)           # evict: the files are parked, not spare files yet
    try:
        large = [key(i, "large") for i in range(7)]
        for k in large:
            put_block(t, k, payload(k, 1 << 20))
        small = []
        for i in range(100):                                # the rest of the disk
            k = key(i, "small")
            try:
                put_block(t, k, payload(k, 60 << 10))
            except DiskFull:
                break
            small.append(k)
        for k in large:
            drop_block(k)
        held: list[bytes] = []
        failed = put_dropping(t, drop_block, [key(i, "more") for i in range(30)], 60 << 10, small, held)
        assert failed <= 2 and len(held) >= 28
        assert all(read_bytes(t, k) == payload(k, 60 << 10) for k in held + small)
    finally:
        t.close()


def test_after_the_disk_fills_evicted_blocks_files_make_room_at_once(small_fs):
    """Evicted blocks' files are parked for the next write (tiers/nvme/parked.py), not spare
    files yet: on a full disk the next reservation that needs their room deletes them
    before it makes its file, so its put does not fail."""
    t = NVMeTier(small_fs / "nvme", 64 << 20, direct=False)
    size = 256 << 10
    try:
        held: list[bytes] = []
        with pytest.raises(DiskFull):                       # fill the disk
            for i in range(100):
                k = key(i, "fill")
                put_block(t, k, payload(k, size))
                held.append(k)
        for k in held[:3]:
            t.evict(k)
        k = key(0, "larger")
        put_block(t, k, payload(k, size * 5 // 2))          # fits the three evicted files' room
        assert read_bytes(t, k) == payload(k, size * 5 // 2)
        assert all(read_bytes(t, k) == payload(k, size) for k in held[3:])
    finally:
        t.close()


def fill(t: NVMeTier, size: int) -> list[bytes]:
    """Put blocks of ``size`` bytes until the disk is full; returns their keys."""
    held: list[bytes] = []
    with pytest.raises(DiskFull):
        for i in range(1000):
            k = key(i, "fill")
            put_block(t, k, payload(k, size))
            held.append(k)
    return held


def test_on_a_full_disk_an_evicted_key_put_again_smaller_takes_its_old_files_room(small_fs):
    t = NVMeTier(small_fs / "nvme", 64 << 20, direct=False)
    size = 256 << 10
    try:
        held = fill(t, size)
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        n = min(size - (8 << 10), free + (16 << 10))     # more than the free space, less than its old file
        t.evict(held[0])
        put_block(t, held[0], payload(held[0], n))
        assert read_bytes(t, held[0]) == payload(held[0], n)
    finally:
        t.close()


def test_on_a_full_disk_a_reservation_whose_evicted_file_its_key_took_back_gets_another(small_fs):
    t = NVMeTier(small_fs / "nvme", 64 << 20, direct=False)
    size = 256 << 10
    try:
        held = fill(t, size)
        t.evict(held[0])
        t.evict(held[1])
        other = key(0, "other")
        t.reserve(other, size)                             # claims held[1]'s file
        t.reserve(held[1], size)                           # takes its own file back
        for k in (other, held[1]):
            t.write(k, 0, payload(k, size))
            t.commit(k)
        assert read_bytes(t, other) == payload(other, size)
        assert read_bytes(t, held[1]) == payload(held[1], size)
    finally:
        t.close()


def put_dropping(t: NVMeTier, drop_block, keys: list[bytes], size: int, victims: list[bytes],
                 stored: list[bytes]) -> int:
    """Put a block of ``size`` bytes under each of ``keys`` (appended to ``stored``), dropping
    the oldest of ``victims`` while one does not fit; returns the puts that hit DiskFull."""
    failed = 0
    for k in keys:
        while victims and not t.fits(size):
            drop_block(victims.pop(0))
        try:
            put_block(t, k, payload(k, size))
            stored.append(k)
        except DiskFull:
            failed += 1
    return failed


def put_block(t: NVMeTier, k: bytes, data: bytes) -> None:
    t.reserve(k, len(data))
    try:
        t.write(k, 0, data)
        t.commit(k)
    except BaseException:
        t.abort(k)
        raise


def test_injected_enospc_is_resource_exhausted_and_the_tier_adapts(tmp_path, monkeypatch):
    """The same path without root: ``os.pwritev`` (how the NVMe tier writes block files)
    fails with ENOSPC while ``full`` is set."""
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="64MiB",
                                   extra={"tiers": {"host": {"enabled": False}}}))
    full = fake_full_disk(monkeypatch)
    try:
        nvme = d.manager.tiers[0]
        with KVStoreClient(d.address, timeout=20) as c:
            acked, failures = put_many(c, "before", 6)
            assert failures == []
            full["on"] = True
            _, failures = put_many(c, "full", 1)
            assert len(failures) == 1 and failures[0].startswith("RESOURCE_EXHAUSTED"), failures
            on_disk = 6 * (4096 + BLOCK)                                    # 6 blocks: header page + payload
            assert nvme.capacity_bytes == nvme.used_bytes + nvme.spare_bytes == on_disk
            assert check_served(c, acked) == 6                              # nothing lost or damaged
            assert c.lookup([key(0, "full")]).hit_blocks == 0
            nvme_stats = next(t for t in c.stats()["tiers"] if t["name"] == "nvme")
            assert nvme_stats["capacity_bytes"] == on_disk                  # the stats show the limit
            full["on"] = False                                              # room again (files deleted)
            more, failures = put_many(c, "after", 3)
            assert failures == [] and check_served(c, more) == 3
            assert check_served(c, acked) == 6
            assert nvme.capacity_bytes == 64 << 20
            assert c.stats()["counters"].get("corrupt_blocks", 0) == 0
    finally:
        monkeypatch.undo()
        d.stop(0)


def test_a_disk_full_below_the_configured_capacity_is_reported_in_stats(tmp_path, monkeypatch):
    """Issue 19, item 20: Stats ``problems`` was empty while the NVMe tier held less than its
    configured capacity because its disk was full; the daemon keeps serving (it evicts)."""
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="64MiB",
                                   extra={"tiers": {"host": {"enabled": False}}}))
    full = fake_full_disk(monkeypatch)
    try:
        with KVStoreClient(d.address, timeout=20) as c:
            assert put_many(c, "before", 4)[1] == []
            d.monitor.check()
            assert c.stats()["problems"] == []
            full["on"] = True
            assert len(put_many(c, "full", 1)[1]) == 1
            d.monitor.check()
            stats = c.stats()
            held = 4 * (4096 + BLOCK)
            assert f"nvme: holds at most {held} of its configured {64 << 20} bytes: its disk is full (blocks " \
                   "are evicted to make room)" in stats["problems"]
            full["on"] = False
            assert put_many(c, "after", 1)[1] == []
            d.monitor.check()
            stats = c.stats()
            assert stats["problems"] == [] and stats["serving"]
    finally:
        monkeypatch.undo()
        d.stop(0)
