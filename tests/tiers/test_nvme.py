"""NVMe tier: the write protocol, reads, recycling, restart and recovery, crash safety,
hostile keys, disk full, errors.

Every behaviour is checked in both I/O modes: O_DIRECT (where the filesystem of
``tmp_path`` accepts it) and buffered I/O (forced with ``direct=False``). The block
format and ranged reads: test_nvme_format.py; a damaged index: test_nvme_index_damage.py.
"""

import errno
import os
import pathlib
import signal
import subprocess
import sys
import threading

import lmdb
import numpy as np
import pytest

from nvme_support import ROOT, K, block_files, disk_bytes, file_of, payload, put, read
from tiers import gds
from tiers.nvme import write as nvme_write
from tiers.base import TierKind
from tiers.errors import (
    BlockCorrupt,
    BlockExists,
    BlockNotStored,
    DiskFull,
    InvalidAccess,
    NoRoom,
    MediaIOError,
    MediaUnavailable,
)
from tiers.nvme.tier import NVMeTier
from tiers.nvme.format import PAGE, IndexEntry, read_header


# ---------------------------------------------------------------- basics


def test_kind_mode_and_declared_capabilities(open_nvme, io_mode):
    """``io = "auto"`` is GDS where kvikio and a GPU are (then declared as device_files), else POSIX."""
    t = open_nvme()
    on_gpu = gds.gds_available()
    assert t.kind is TierKind.NVME and t.io == ("gds" if on_gpu else "posix") and t.volatile is False
    assert t.direct is (io_mode == "direct")
    assert (t.capabilities.device_files is t) is on_gpu and t.capabilities.host is None


def test_put_read_ranges_and_file_layout(open_nvme):
    t = open_nvme()
    put(t, K(0), b"\xff" * 200_000)                # leaves stale bytes in reused buffers
    t.free(K(0))
    data = payload(K(1), 100_003)
    put(t, K(1), data)
    assert K(1) in t and len(t) == 1 and t.size_of(K(1)) == 100_003
    assert read(t, K(1)) == data
    assert read(t, K(1), [(0, 5), (100_000, 3), (7, 0)]) == data[:5] + data[100_000:]
    assert t.used_bytes == disk_bytes(100_003) == 4096 + 102_400       # header page + 25 payload pages
    raw = file_of(t, K(1)).read_bytes()
    assert len(raw) == 106_496 and raw[:8] == b"KVSBLK\r\n"
    assert raw[4096:4096 + 100_003] == data and raw[4096 + 100_003:] == bytes(2397)
    with pytest.raises(InvalidAccess):
        read(t, K(1), [(100_000, 4)])
    with pytest.raises(BlockNotStored):
        read(t, K(2))


def test_read_into_numpy_and_bounds_of_the_output_buffer(open_nvme):
    import numpy as np
    t = open_nvme()
    data = payload(K(1), 70_000)
    put(t, K(1), data)
    out = np.zeros(70_000 // 4 + 10, dtype=np.float32)          # any C-contiguous buffer
    assert t.read_into(K(1), out) == 70_000
    assert out.tobytes()[:70_000] == data and out.tobytes()[70_000:] == bytes(40)
    with pytest.raises(InvalidAccess, match="output buffer has 69999 bytes"):
        t.read_into(K(1), bytearray(69_999))
    with pytest.raises(InvalidAccess, match="read-only"):
        t.read_into(K(1), bytes(70_000))
    assert t.read_into(K(1), bytearray(10), [(5, 10)]) == 10


def test_chunked_writes_cross_staging_buffers(open_nvme, monkeypatch):
    monkeypatch.setattr(nvme_write, "STAGE_BYTES", 1 << 20)    # a 2.5 MB block crosses it twice
    t = open_nvme()
    data = payload(K(2), 2_500_001)
    t.reserve(K(2), len(data))
    sizes = [1, 4095, 4096, 70_001, 1 << 20, 3]
    off = 0
    while off < len(data):
        n = sizes[off % len(sizes)]
        t.write(K(2), off, memoryview(data)[off:off + n])
        off += len(data[off:off + n])
    assert K(2) not in t                            # invisible until commit
    t.commit(K(2))
    assert read(t, K(2)) == data


def test_protocol_errors_are_typed(open_nvme):
    t = open_nvme()
    t.reserve(K(1), 1000)
    with pytest.raises(InvalidAccess, match="offset 10 but 0"):
        t.write(K(1), 10, b"x")
    t.write(K(1), 0, b"a" * 600)
    with pytest.raises(InvalidAccess, match="overruns"):
        t.write(K(1), 600, b"b" * 401)
    with pytest.raises(InvalidAccess, match="600 of 1000"):
        t.commit(K(1))
    with pytest.raises(BlockExists):
        t.reserve(K(1), 5)
    with pytest.raises(BlockNotStored, match="not reserved"):
        t.write(K(2), 0, b"x")
    with pytest.raises(BlockNotStored):
        t.commit(K(2))
    with pytest.raises(InvalidAccess, match="32 bytes"):
        t.reserve(b"short", 5)
    with pytest.raises(InvalidAccess):
        t.reserve(K(3), -1)
    with pytest.raises(BlockNotStored):
        t.free(K(9))
    with pytest.raises(BlockNotStored):
        t.size_of(K(9))


def test_zero_byte_block(open_nvme):
    t = open_nvme()
    t.reserve(K(1), 0)
    t.commit(K(1))
    assert read(t, K(1)) == b"" and t.used_bytes == PAGE         # the header page only
    assert t.read_into(K(1), bytearray(0)) == 0


def test_abort_leaves_nothing(open_nvme):
    t = open_nvme()
    t.reserve(K(1), 10_000)
    t.write(K(1), 0, b"z" * 5000)
    assert any(f.endswith(".tmp") for f in block_files(t.path))
    t.abort(K(1))
    assert t.used_bytes == 0 and K(1) not in t
    assert block_files(t.path) == []
    t.abort(K(1))                                   # unknown key: no-op
    put(t, K(1), b"again")
    assert read(t, K(1)) == b"again"


def test_capacity_counts_whole_files_and_is_never_exceeded(open_nvme):
    t = open_nvme(capacity=7 * PAGE)
    put(t, K(1), b"x")                              # header + 1 page
    put(t, K(2), b"y" * (PAGE + 1))                 # header + 2 pages
    assert t.used_bytes == 5 * PAGE
    assert t.fits(PAGE) and not t.fits(PAGE + 1)
    assert t.max_block_bytes == 6 * PAGE
    with pytest.raises(NoRoom):
        t.reserve(K(3), PAGE + 1)
    t.reserve(K(3), PAGE)
    assert t.used_bytes == t.capacity_bytes == 7 * PAGE
    assert not t.fits(0)
    t.abort(K(3))
    t.free(K(2))
    t.free(K(1))
    assert t.used_bytes == 0 and len(t) == 0 and block_files(t.path) == []


def test_freed_files_are_recycled_no_larger_than_the_new_block(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), 5000))
    inode = file_of(t, K(1)).stat().st_ino
    t.free(K(1))
    assert not file_of(t, K(1)).exists() and t.spare_bytes == disk_bytes(5000) == 12_288
    put(t, K(2), payload(K(2), 300_000))
    st = file_of(t, K(2)).stat()
    assert st.st_ino == inode                       # the same file, renamed into place and extended
    assert st.st_size == disk_bytes(300_000)
    assert read(t, K(2)) == payload(K(2), 300_000) and t.spare_bytes == 0
    t.free(K(2))                                    # a larger spare is not a smaller block's file:
    put(t, K(3), payload(K(3), 5000))               # it would take more disk than the block counts
    assert file_of(t, K(3)).stat().st_ino != inode and t.spare_bytes == disk_bytes(300_000)
    assert read(t, K(3)) == payload(K(3), 5000)


def test_spare_files_are_bounded_and_kept_across_restarts(open_nvme):
    t = open_nvme(spare_files=2)
    for i in range(5):
        put(t, K(i), b"s" * 100)
    for i in range(5):
        t.free(K(i))
    spare = pathlib.Path(t.path) / "spare"
    assert len(list(spare.iterdir())) == 2 and block_files(t.path) == [] and t.spare_bytes == 2 * disk_bytes(100)
    t.close()
    (spare / "junk").write_bytes(b"not ours")
    t2 = open_nvme(spare_files=1)
    assert [p.name for p in spare.iterdir()] == ["0"]
    assert t2.spare_bytes == disk_bytes(100) and len(t2) == 0      # a spare file is no block
    kept = (spare / "0").stat().st_ino
    put(t2, K(7), b"new")
    assert file_of(t2, K(7)).stat().st_ino == kept and list(spare.iterdir()) == []
    assert read(t2, K(7)) == b"new"


def disk_of(t) -> int:
    """Bytes the tier's files (blocks and spare files) take."""
    return sum(p.stat().st_size for p in pathlib.Path(t.path).glob("*/**/*") if p.is_file()
               and p.parts[-2] != "index" and "quarantine" not in p.parts)


def test_blocks_and_spare_files_never_take_more_than_the_capacity(open_nvme):
    capacity = 8 * disk_bytes(1 << 20)
    t = open_nvme(capacity=capacity)
    for i in range(8):                                  # full of 1 MiB blocks, then all freed: spares
        put(t, K(i), payload(K(i), 1 << 20))
    for i in range(8):
        t.free(K(i))
    assert t.spare_bytes == capacity and t.used_bytes == 0 and disk_of(t) <= capacity
    big = t.max_block_bytes                             # one block as large as the tier takes
    put(t, K(100), payload(K(100), big))
    assert t.used_bytes + t.spare_bytes <= capacity and disk_of(t) <= capacity
    assert read(t, K(100)) == payload(K(100), big)
    t.free(K(100))
    rng = np.random.default_rng(7)                      # a cache of mixed sizes, oldest evicted first
    held: list[bytes] = []
    for i in range(200):
        k, n = K(1000 + i), int(rng.choice([256 << 10, 1 << 20, 3 << 20]))
        while not t.fits(n):
            t.free(held.pop(0))
        put(t, k, payload(k, n))
        held.append(k)
        assert t.used_bytes + t.spare_bytes <= capacity and disk_of(t) <= capacity, i
    assert all(read(t, k) == payload(k, t.size_of(k)) for k in held)


def test_a_small_reservation_never_holds_a_large_spare_file(open_nvme):
    big = 3 << 20
    capacity = 4 * disk_bytes(big)
    t = open_nvme(capacity=capacity)
    for i in range(4):
        put(t, K(i), payload(K(i), big))
    t.free(K(0))
    t.free(K(1))                                        # two large spare files
    for k in (K(10), K(11)):                            # small blocks reserved, not written yet
        t.reserve(k, 100)
    for k in (K(20), K(21)):
        while not t.fits(big):
            t.free(next(x for x in (K(2), K(3)) if x in t))
        put(t, k, payload(k, big))
        assert disk_of(t) <= capacity
    for k in (K(10), K(11)):
        t.write(k, 0, payload(k, 100))
        t.commit(k)
        assert disk_of(t) <= capacity and read(t, k) == payload(k, 100)
    t.reserve(K(30), 100)
    t.abort(K(30))                                      # an abort puts its spare back within the capacity
    assert t.used_bytes + t.spare_bytes <= capacity and disk_of(t) <= capacity


def test_a_full_tier_writes_each_new_block_into_the_file_it_freed(open_nvme, monkeypatch):
    t = open_nvme(capacity=4 * disk_bytes(1 << 20))
    held = [K(i) for i in range(4)]
    for k in held:
        put(t, k, payload(k, 1 << 20))
    created, real_open = [], os.open

    def spy_open(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            created.append(path)
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", spy_open)
    for i in range(4, 24):                              # a cache in service: evict, then put
        freed = held.pop(0)
        inode = file_of(t, freed).stat().st_ino
        t.free(freed)
        put(t, K(i), payload(K(i), 1 << 20))
        held.append(K(i))
        assert file_of(t, K(i)).stat().st_ino == inode, i   # an overwrite, not a new file
        assert t.used_bytes + t.spare_bytes <= t.capacity_bytes
    monkeypatch.undo()
    assert created == []                                # no block file was made anew
    assert all(read(t, k) == payload(k, 1 << 20) for k in held)


def test_a_reservation_dropped_while_its_file_is_opened_leaves_no_file(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), b"s" * 5000)
    t.free(K(1))                                        # a spare file its reservation sets aside
    opening = t._writes.open_temp

    def dropped_meanwhile(p):                           # another thread aborts before the file exists
        t.abort(p.key)
        return opening(p)
    monkeypatch.setattr(t._writes, "open_temp", dropped_meanwhile)
    t.reserve(K(2), 5000)
    with pytest.raises(BlockNotStored, match="dropped"):
        t.write(K(2), 0, b"x" * 5000)
    monkeypatch.undo()
    assert [f for f in block_files(t.path) if f.endswith(".tmp")] == [] and t.used_bytes == 0
    assert t.spare_bytes == disk_bytes(5000)            # the spare went back, not lost
    put(t, K(2), b"y" * 5000)
    assert read(t, K(2)) == b"y" * 5000


def test_spare_limits_in_bytes_and_recycling_off(open_nvme, tmp_path):
    t = open_nvme(spare_bytes=2 * PAGE)
    put(t, K(1), b"x" * (PAGE + 1))                 # three pages with the header: over the limit
    t.free(K(1))
    assert t.spare_bytes == 0 and list((pathlib.Path(t.path) / "spare").iterdir()) == []
    t.close()
    t2 = NVMeTier(tmp_path / "other", 1 << 20, spare_files=0)
    put(t2, K(1), b"y")
    t2.free(K(1))
    assert not (tmp_path / "other" / "spare").exists() and block_files(t2.path) == []
    t2.close()


# ---------------------------------------------------------------- restart and recovery


def test_restart_recovers_blocks_and_reads_match(open_nvme):
    t = open_nvme()
    sizes = {K(i): 1000 * i + 17 for i in range(1, 9)}
    for key, n in sizes.items():
        put(t, key, payload(key, n), chunk=777)
    t.free(K(4))
    del sizes[K(4)]
    used = t.used_bytes
    t.close()

    t2 = open_nvme()
    assert t2.used_bytes == used and t2.recovery.blocks == 7 and not t2.recovery.index_rebuilt
    recovered = t2.recover()
    assert sorted(recovered) == sorted(sizes.items())
    assert [k for k, _ in recovered] == [K(i) for i in (1, 2, 3, 5, 6, 7, 8)]   # oldest first
    for key, n in sizes.items():
        assert read(t2, key) == payload(key, n)
    assert len(t2) == 7 and t2.used_bytes == used


def test_second_process_cannot_open_the_same_folder(open_nvme):
    t = open_nvme()
    with pytest.raises(MediaUnavailable, match="in use by another process"):
        open_nvme()
    t.close()
    open_nvme()                                     # the lock went with close()


def test_unusable_folder_is_tier_unavailable(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(MediaUnavailable, match="cannot use the tier folder"):
        NVMeTier(tmp_path / "file", 1 << 20)


def closed_tier_of_four_blocks(open_nvme):
    """A tier holding K(1)..K(4) (5000 bytes each), closed; and its ``blocks`` folder."""
    t = open_nvme()
    for i in range(1, 5):
        put(t, K(i), payload(K(i), 5000))
    t.close()
    return t, pathlib.Path(t.path) / "blocks"


def test_recover_removes_temps_drops_lost_entries_and_quarantines_bad_files(open_nvme):
    t, blocks = closed_tier_of_four_blocks(open_nvme)
    file_of(t, K(1)).unlink()                                       # index entry without file
    with open(file_of(t, K(2)), "r+b") as f:                        # cut inside its header
        f.truncate(100)
    orphan = file_of(t, K(9))                                       # no index entry, no header
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"orphan")
    temp = file_of(t, K(3)).with_name(K(3).hex() + ".tmp")         # leftover temp file
    temp.write_bytes(b"partial")
    misplaced = blocks / "ff" / "ff" / K(4).hex()                   # right name, wrong folder
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    misplaced.write_bytes(file_of(t, K(4)).read_bytes())
    stranger = blocks / "README"                                    # not ours: left alone
    stranger.write_text("hello")

    t2 = open_nvme()
    r = t2.recovery
    assert (r.dropped, r.temps_removed, r.quarantined, r.adopted) == (2, 1, 3, 0)
    assert sorted(t2.recover()) == [(K(3), 5000), (K(4), 5000)]
    assert t2.used_bytes == 2 * disk_bytes(5000) and len(t2) == 2
    rel = lambda k: f"{k.hex()[:3]}/{k.hex()}"                      # noqa: E731
    assert block_files(t2.path) == sorted(["README", rel(K(3)), rel(K(4))])
    quarantined = sorted(p.name for p in (pathlib.Path(t2.path) / "quarantine").iterdir())
    assert quarantined == sorted([K(2).hex(), K(9).hex(), K(4).hex()])   # moved, never deleted
    assert read(t2, K(3)) == payload(K(3), 5000)
    t2.close()
    t3 = open_nvme()                                                # the index agrees too
    assert sorted(t3.recover()) == [(K(3), 5000), (K(4), 5000)] and t3.recovery.dropped == 0


def test_blocks_of_the_earlier_two_level_layout_are_moved_in_place_at_start(open_nvme):
    t, blocks = closed_tier_of_four_blocks(open_nvme)
    old = lambda k: blocks / k.hex()[:2] / k.hex()[2:4] / k.hex()     # noqa: E731 - blocks/ab/cd/<hex>
    for i in (1, 2, 3):                                             # as an earlier tier left them
        old(K(i)).parent.mkdir(parents=True, exist_ok=True)
        file_of(t, K(i)).rename(old(K(i)))
    old(K(4)).parent.mkdir(parents=True, exist_ok=True)             # a stale copy of a block in place
    old(K(4)).write_bytes(file_of(t, K(4)).read_bytes())
    leftover = old(K(1)).with_name(K(1).hex() + ".tmp")             # an unfinished write of that time
    leftover.write_bytes(b"partial")

    t2 = open_nvme()
    r = t2.recovery
    assert (r.migrated, r.dropped, r.adopted, r.temps_removed, r.quarantined) == (3, 0, 0, 1, 1)
    assert sorted(t2.recover()) == [(K(i), 5000) for i in range(1, 5)]
    assert block_files(t2.path) == sorted(f"{K(i).hex()[:3]}/{K(i).hex()}" for i in range(1, 5))
    assert [p.name for p in (pathlib.Path(t2.path) / "quarantine").iterdir()] == [K(4).hex()]
    assert not (blocks / K(1).hex()[:2]).exists()                   # the emptied folders removed
    for i in range(1, 5):
        assert read(t2, K(i)) == payload(K(i), 5000)


def test_a_block_in_both_layouts_is_served_as_the_index_describes_it(open_nvme, tmp_path):
    """An earlier build reopened the tier after this one (it wrote the key again in its own
    layout and indexed that), then this build opens it: the indexed copy is served."""
    t = open_nvme()
    put(t, K(1), b"A" * 5000)
    put(t, K(2), b"C" * 5000)
    t.close()
    other = NVMeTier(tmp_path / "other", 1 << 30, direct=False)     # the earlier build's writes
    put(other, K(1), b"B" * 5000)
    put(other, K(2), b"D" * 5000)
    other.close()
    blocks = pathlib.Path(t.path) / "blocks"
    for k in (K(1), K(2)):
        old = blocks / k.hex()[:2] / k.hex()[2:4] / k.hex()
        old.parent.mkdir(parents=True, exist_ok=True)
        file_of(tmp_path / "other", k).rename(old)
    index = lmdb.open(str(pathlib.Path(t.path) / "index"), subdir=True)
    with index.begin(write=True) as txn:                            # the earlier build indexed B, not A
        txn.put(K(1), IndexEntry.of(read_header(str(blocks / K(1).hex()[:2] / K(1).hex()[2:4] / K(1).hex()),
                                                K(1))).pack())
        txn.delete(K(2))                                            # ... and lost D's entry: the later write wins
    index.close()
    t2 = open_nvme()
    assert read(t2, K(1)) == b"B" * 5000 and read(t2, K(2)) == b"D" * 5000
    assert t2.recovery.migrated == 2 and t2.recovery.quarantined == 2  # A and C kept aside, not deleted


def test_block_files_in_folders_that_are_not_block_folders_are_quarantined(open_nvme):
    t, blocks = closed_tier_of_four_blocks(open_nvme)
    for name, k in (("0", K(1)), ("0000", K(2))):                   # not abc/ nor ab/cd/
        (blocks / name).mkdir()
        file_of(t, k).rename(blocks / name / k.hex())
    t2 = open_nvme()
    assert sorted(t2.recover()) == [(K(3), 5000), (K(4), 5000)]
    assert t2.recovery.quarantined == 2 and t2.recovery.adopted == 0
    assert sorted(p.name for p in (pathlib.Path(t2.path) / "quarantine").iterdir()) == sorted([K(1).hex(), K(2).hex()])


def test_reopen_with_smaller_capacity_drops_oldest_blocks(open_nvme):
    t = open_nvme()
    for i in range(1, 6):
        put(t, K(i), payload(K(i), PAGE))
    t.close()
    t2 = open_nvme(capacity=3 * disk_bytes(PAGE))
    assert t2.used_bytes == 3 * disk_bytes(PAGE) and t2.recovery.trimmed == 2
    assert sorted(k for k, _ in t2.recover()) == [K(3), K(4), K(5)]
    assert len(block_files(t2.path)) == 3


def test_index_map_grows_when_full(tmp_path):
    t = NVMeTier(tmp_path / "nvme", 1 << 30, direct=False, map_size=64 << 10)   # 16 pages
    for i in range(1200):
        put(t, K(i), b"b")
    assert len(t) == 1200 and t._index.map_size() > 64 << 10
    t.close()
    t2 = NVMeTier(tmp_path / "nvme", 1 << 30, direct=False, map_size=64 << 10)
    assert len(t2.recover()) == 1200 and read(t2, K(1199)) == b"b" and t2.recovery.adopted == 0
    t2.close()


def test_fsync_mode_round_trip(open_nvme):
    t = open_nvme(fsync=True)
    put(t, K(1), payload(K(1), 9000))
    t.close()
    t2 = open_nvme(fsync=True)
    assert t2.recover() == [(K(1), 9000)] and read(t2, K(1)) == payload(K(1), 9000)


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("cache", [0, 1 << 20], ids=["header-read", "header-cached"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "symlink", "other-block"])
def test_damaged_file_raises_block_corrupt(open_nvme, tmp_path, damage, cache):
    t = open_nvme(header_cache_bytes=cache)
    data = payload(K(1), 40_000)
    put(t, K(1), data)
    put(t, K(2), data[:100])
    path = file_of(t, K(1))
    if damage == "flip":                            # payload byte 12_345: chunk 0 of 16 KiB
        raw = bytearray(path.read_bytes())
        raw[4096 + 12_345] ^= 0x01
        path.write_bytes(raw)
        match = "fails its checksum in chunk 0"
    elif damage == "truncate":
        os.truncate(path, 8192)
        match = "truncated"
    elif damage == "missing":
        path.unlink()
        match = "missing"
    elif damage == "symlink":
        other = tmp_path / "elsewhere"
        other.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(other)
        match = "symbolic link"
    else:                                           # another block's complete file under this name
        path.write_bytes(file_of(t, K(2)).read_bytes())
        match = "header names block" if not cache else "truncated"     # cached checksums: a short file
    with pytest.raises(BlockCorrupt, match=match):
        read(t, K(1))
    with pytest.raises(BlockCorrupt):
        read(t, K(1), [(0, 10)])                    # ranges are verified too
    if damage == "flip":                            # an intact chunk of the block is still served
        assert read(t, K(1), [(16_384, 100)]) == data[16_384:16_484]
    assert read(t, K(2)) == data[:100]              # other blocks unaffected
    t.free(K(1))                                    # what the manager does next
    assert K(1) not in t and t.used_bytes == disk_bytes(100)


# ---------------------------------------------------------------- hostile keys


@pytest.mark.parametrize("key", [b"../../".ljust(32, b"\0"), b"/" * 32, b"\0" * 32,
                                 b"..\\..\\etc\\passwd".ljust(32, b"."), bytes(range(224, 256))])
def test_hostile_keys_stay_inside_the_tier_folder(open_nvme, tmp_path, key):
    t = open_nvme()
    put(t, key, b"secret")
    h = key.hex()
    assert block_files(t.path) == [f"{h[:3]}/{h}"]
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and pathlib.Path(t.path) not in p.parents]
    assert outside == []
    assert read(t, key) == b"secret"
    t.close()
    assert open_nvme().recover() == [(key, 6)]


# ---------------------------------------------------------------- I/O failures


@pytest.mark.parametrize("chunked", [False, True])
def test_disk_full_on_write_leaves_nothing_behind(open_nvme, monkeypatch, chunked):
    t = open_nvme()
    put(t, K(1), b"kept")

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    data = payload(K(2), 50_000)
    t.reserve(K(2), len(data))
    with pytest.raises(DiskFull, match="disk full") as info:
        if chunked:                                 # staged: the error may come with any call
            t.write(K(2), 0, data[:20_000])
            t.write(K(2), 20_000, data[20_000:])
            t.commit(K(2))
        else:
            t.write(K(2), 0, data)
    assert isinstance(info.value, NoRoom) and isinstance(info.value, MediaIOError)
    monkeypatch.undo()
    assert K(2) not in t and t.used_bytes == disk_bytes(4)
    assert len(block_files(t.path)) == 1            # no temp file
    t.abort(K(2))                                   # the manager's clean-up: a no-op now
    put(t, K(2), data)                              # the space is usable again
    assert read(t, K(2)) == data


def test_rename_failure_on_commit_is_an_io_error(open_nvme, monkeypatch):
    t = open_nvme()
    t.reserve(K(1), 3000)
    t.write(K(1), 0, b"r" * 3000)

    def broken(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", broken)
    with pytest.raises(MediaIOError, match="committing"):
        t.commit(K(1))
    monkeypatch.undo()
    assert K(1) not in t and t.used_bytes == 0 and block_files(t.path) == []


def test_index_failure_on_commit_removes_the_renamed_file(open_nvme, monkeypatch):
    t = open_nvme()
    t.reserve(K(1), 3000)
    t.write(K(1), 0, b"r" * 3000)

    def broken(key, entry, stale=()):
        raise lmdb.Error("simulated index failure")

    monkeypatch.setattr(t._index, "put", broken)
    with pytest.raises(MediaIOError, match="simulated index failure.*kvstore repair-index"):
        t.commit(K(1))
    monkeypatch.undo()
    assert K(1) not in t and t.used_bytes == 0 and block_files(t.path) == []


# ---------------------------------------------------------------- configuration


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="io must be one of"):
        NVMeTier(tmp_path / "a", 1 << 20, io="spdk")
    with pytest.raises(ValueError, match="capacity"):
        NVMeTier(tmp_path / "a", -1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        NVMeTier(tmp_path / "a", 1 << 20, chunk_bytes=5000)
    if gds.gds_available():
        pytest.skip("this machine has a CUDA GPU and kvikio")
    with pytest.raises(ValueError, match="io = gds needs a CUDA GPU and kvikio"):
        NVMeTier(tmp_path / "b", 1 << 20, io="gds")
    t = NVMeTier(tmp_path / "c", 1 << 20, io="auto")
    assert t.io == "posix"
    with pytest.raises(MediaIOError, match="needs io = gds"):
        t.read_into_device(K(1), None)
    t.close()


def test_tiers_import_nothing_from_kvstore():
    code = ("import sys; import tiers.nvme, tiers.nvme.recover, tiers.nvme.repair, tiers.nvme.device, tiers.gds; "
            "bad = sorted(m for m in sys.modules if m == 'kvstore' or m.startswith('kvstore.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- concurrency and crashes


def test_concurrent_writes_and_reads(open_nvme):
    t = open_nvme()
    lock = threading.Lock()                         # stands in for the manager's lock
    errors = []

    def worker(w):
        try:
            for i in range(30):
                key = K(w * 1000 + i)
                data = payload(key, 10_000 + 4096 * w + i)
                with lock:
                    t.reserve(key, len(data))
                t.write(key, 0, data[:5000])
                t.write(key, 5000, data[5000:])
                with lock:
                    t.commit(key)
                assert read(t, key) == data
                assert read(t, key, [(4000, 3000)]) == data[4000:7000]
        except Exception as e:                      # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and len(t) == 120


CHILD = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from tiers.nvme import NVMeTier

def payload(key, n):
    seed = int.from_bytes(key[:8], "big") % 251
    return ((np.arange(n, dtype=np.int64) * 13 + seed) % 251).astype(np.uint8).tobytes()

t = NVMeTier({path!r}, 1 << 30, direct={direct!r})
i = 0
while True:
    key = i.to_bytes(4, "big") * 8
    data = payload(key, 3000 + (i * 7919) % 40000)
    t.reserve(key, len(data))
    if i % 2:
        t.write(key, 0, data)
    else:
        t.write(key, 0, data[:1000])
        t.write(key, 1000, data[1000:])
    t.commit(key)
    if i % 3 == 2:
        t.free((i - 1).to_bytes(4, "big") * 8)
    print(i, flush=True)
    i += 1
"""


def test_sigkill_at_any_time_leaves_index_and_files_in_agreement(open_nvme, tmp_path, io_mode):
    path = str(tmp_path / "nvme")
    script = CHILD.format(root=str(ROOT), path=path, direct=None if io_mode == "direct" else False)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    last = -1
    for line in child.stdout:
        last = int(line)
        if last >= 400:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    for line in child.stdout:                                       # lines printed before the kill
        last = int(line)
    assert last >= 400, "the writer died before the test killed it"

    freed = {i - 1 for i in range(last + 1) if i % 3 == 2}
    done = {K(i) for i in range(last + 1) if i not in freed}        # committed and reported
    in_flight = {K(last + 1)}                                       # may have committed unreported
    if (last + 1) % 3 == 2:
        done.discard(K(last))                                       # may have been freed since
        in_flight.add(K(last))
    t = open_nvme()
    recovered = dict(t.recover())
    assert done <= set(recovered)                                   # nothing committed is lost
    assert set(recovered) - done <= in_flight
    for key, n in recovered.items():
        assert read(t, key) == payload(key, n)
    files = block_files(path)
    assert not any(f.endswith(".tmp") for f in files)
    assert sorted(f.rsplit("/", 1)[1] for f in files) == sorted(k.hex() for k in recovered)
    assert t.recovery.quarantined == 0


def test_whole_reads_into_page_aligned_buffers_of_any_size(open_nvme):
    """The fast whole-block path (page-aligned output, checksums cached at commit) verifies
    a payload that ends inside a chunk and inside a page: every size comes back intact."""
    import numpy as np
    from tiers.memory import allocate_host_buffer

    t = open_nvme()
    out = allocate_host_buffer(1 << 18).array          # page aligned
    rng = np.random.default_rng(7)
    sizes = [1, 4095, 4096, 4097, 12_288 + 3_243, 16_384, 16_385, 98_304 + 12_874, 131_072 - 1]
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        t.reserve(K(500 + i), n)
        t.write(K(500 + i), 0, data)
        t.commit(K(500 + i))
        assert t.read_into(K(500 + i), memoryview(out)[:n]) == n
        assert out[:n].tobytes() == data, f"{n} bytes"
