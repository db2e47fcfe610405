"""NVMe tier: file format, checksums, restart and recovery, crash safety, hostile keys, disk full.

Every behaviour is checked in both I/O modes: O_DIRECT (where the filesystem of
``tmp_path`` accepts it) and buffered I/O (forced with ``direct=False``).
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

from tiers.base import read_bytes

from tiers.errors import BlockCorrupt as CorruptBlock, BlockNotStored, TierFull, TierIOError
ConfigError = ValueError
from tiers import nvme
from tiers.base import TierKind
from tiers.nvme import PAGE, NVMeTier, disk_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(key, n):
    """``n`` bytes derived from ``key``, so a wrong block is visible."""
    seed = int.from_bytes(key[:8], "big") % 251
    return ((np.arange(n, dtype=np.int64) * 13 + seed) % 251).astype(np.uint8).tobytes()


def put(tier, key, data, chunk=None):
    tier.reserve(key, len(data))
    chunk = chunk or max(len(data), 1)
    for off in range(0, len(data), chunk):
        tier.write(key, off, data[off:off + chunk])
    tier.commit(key)


def block_files(root):
    """Paths of all files under ``root/blocks``, relative to it."""
    base = pathlib.Path(root) / "blocks"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


def file_of(tier, key):
    h = key.hex()
    return pathlib.Path(tier.path) / "blocks" / h[:2] / h[2:4] / h


@pytest.fixture(params=["direct", "buffered"])
def mode(request, tmp_path):
    if request.param == "direct" and not nvme._probe_direct(str(tmp_path)):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    return request.param


@pytest.fixture
def open_tier(tmp_path, mode):
    """Open (or reopen) an NVMe tier in ``tmp_path/nvme`` in the test's I/O mode."""
    opened = []

    def make(capacity=1 << 30, **kw):
        kw.setdefault("direct", None if mode == "direct" else False)
        t = NVMeTier(tmp_path / "nvme", capacity, **kw)
        opened.append(t)
        return t

    yield make
    for t in opened:
        t.close()


# ---------------------------------------------------------------- basics and format


def test_io_mode_is_the_one_asked_for(open_tier, mode):
    t = open_tier()
    assert t.kind is TierKind.NVME and t.io == "posix"
    assert t.direct is (mode == "direct")


def test_put_read_ranges_and_file_format(open_tier, mode):
    t = open_tier()
    put(t, K(0), b"\xff" * 200_000)                # leaves stale bytes in a reused bounce buffer
    t.free(K(0))
    data = payload(K(1), 100_003)
    put(t, K(1), data)
    assert K(1) in t and len(t) == 1 and t.size_of(K(1)) == 100_003
    assert read_bytes(t, K(1)) == data
    assert read_bytes(t, K(1), [(0, 5), (100_000, 3), (7, 0)]) == data[:5] + data[100_000:]
    assert t.used_bytes == 102_400                  # 25 pages of 4096 bytes
    raw = file_of(t, K(1)).read_bytes()
    assert raw[:100_003] == data                    # payload at offset 0
    if mode == "direct":
        assert len(raw) == 102_400 and raw[100_003:] == bytes(2397)
    else:
        assert len(raw) == 100_003
    with pytest.raises(ValueError):
        read_bytes(t, K(1), [(100_000, 4)])
    with pytest.raises(KeyError):
        read_bytes(t, K(2))


def test_chunked_writes_cross_bounce_buffers(open_tier, monkeypatch):
    monkeypatch.setattr(nvme, "WRITE_BOUNCE_BYTES", 1 << 20)   # a 2.5 MB block crosses it twice
    t = open_tier()
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
    assert read_bytes(t, K(2)) == data


def test_write_errors_and_incomplete_commit(open_tier):
    t = open_tier()
    t.reserve(K(1), 1000)
    with pytest.raises(ValueError, match="offset 10 but 0"):
        t.write(K(1), 10, b"x")
    t.write(K(1), 0, b"a" * 600)
    with pytest.raises(ValueError, match="overruns"):
        t.write(K(1), 600, b"b" * 401)
    with pytest.raises(ValueError, match="600 of 1000"):
        t.commit(K(1))
    with pytest.raises(ValueError, match="already present"):
        t.reserve(K(1), 5)
    with pytest.raises(BlockNotStored, match="not reserved"):
        t.write(K(2), 0, b"x")
    with pytest.raises(ValueError, match="32 bytes"):
        t.reserve(b"short", 5)


def test_zero_byte_block(open_tier):
    t = open_tier()
    t.reserve(K(1), 0)
    t.commit(K(1))
    assert read_bytes(t, K(1)) == b"" and t.used_bytes == PAGE


def test_abort_leaves_nothing(open_tier):
    t = open_tier()
    t.reserve(K(1), 10_000)
    t.write(K(1), 0, b"z" * 5000)
    assert any(f.endswith(".tmp") for f in block_files(t.path))
    t.abort(K(1))
    assert t.used_bytes == 0 and K(1) not in t
    assert block_files(t.path) == []
    t.abort(K(1))                                   # unknown key: no-op
    put(t, K(1), b"again")
    assert read_bytes(t, K(1)) == b"again"


def test_capacity_counts_whole_pages_and_is_never_exceeded(open_tier):
    t = open_tier(capacity=5 * PAGE)
    put(t, K(1), b"x")                              # 1 page
    put(t, K(2), b"y" * (PAGE + 1))                 # 2 pages
    assert t.used_bytes == 3 * PAGE
    assert t.fits(2 * PAGE) and not t.fits(2 * PAGE + 1)
    with pytest.raises(TierFull):
        t.reserve(K(3), 2 * PAGE + 1)
    t.reserve(K(3), 2 * PAGE)
    assert t.used_bytes == t.capacity_bytes == 5 * PAGE
    assert not t.fits(0)
    t.abort(K(3))
    t.free(K(2))
    t.free(K(1))
    assert t.used_bytes == 0 and len(t) == 0 and block_files(t.path) == []


def test_freed_files_are_recycled_and_cut_to_the_new_size(open_tier, mode):
    t = open_tier()
    put(t, K(1), payload(K(1), 300_000))
    inode = file_of(t, K(1)).stat().st_ino
    t.free(K(1))
    assert not file_of(t, K(1)).exists() and t.spare_bytes == disk_bytes(300_000)
    put(t, K(2), payload(K(2), 5000))
    st = file_of(t, K(2)).stat()
    assert st.st_ino == inode                       # the same file, renamed into place
    assert st.st_size == (8192 if mode == "direct" else 5000)
    assert read_bytes(t, K(2)) == payload(K(2), 5000) and t.spare_bytes == 0


def test_spare_files_are_bounded_and_kept_across_restarts(open_tier, mode):
    t = open_tier(spare_files=2)
    for i in range(5):
        put(t, K(i), b"s" * 100)
    for i in range(5):
        t.free(K(i))
    spare = pathlib.Path(t.path) / "spare"
    assert len(list(spare.iterdir())) == 2 and block_files(t.path) == [] and t.spare_bytes == 2 * PAGE
    t.close()
    (spare / "junk").write_bytes(b"not ours")
    t2 = open_tier(spare_files=1)
    assert [p.name for p in spare.iterdir()] == ["0"]
    assert t2.spare_bytes == (PAGE if mode == "direct" else 100)     # the file's size now
    kept = (spare / "0").stat().st_ino
    put(t2, K(7), b"new")
    assert file_of(t2, K(7)).stat().st_ino == kept and list(spare.iterdir()) == []
    assert read_bytes(t2, K(7)) == b"new"


def test_spare_limits_in_bytes_and_recycling_off(open_tier, tmp_path):
    t = open_tier(spare_bytes=PAGE)
    put(t, K(1), b"x" * (PAGE + 1))                 # two pages: over the limit
    t.free(K(1))
    assert t.spare_bytes == 0 and list((pathlib.Path(t.path) / "spare").iterdir()) == []
    t.close()
    t2 = NVMeTier(tmp_path / "other", 1 << 20, spare_files=0)
    put(t2, K(1), b"y")
    t2.free(K(1))
    assert not (tmp_path / "other" / "spare").exists() and block_files(t2.path) == []
    t2.close()


# ---------------------------------------------------------------- restart and recovery


def test_restart_recovers_blocks_and_reads_match(open_tier):
    t = open_tier()
    sizes = {K(i): 1000 * i + 17 for i in range(1, 9)}
    for key, n in sizes.items():
        put(t, key, payload(key, n), chunk=777)
    t.free(K(4))
    del sizes[K(4)]
    used = t.used_bytes
    t.close()

    t2 = open_tier()
    assert t2.used_bytes == used
    recovered = t2.recover()
    assert sorted(recovered) == sorted(sizes.items())
    assert [k for k, _ in recovered] == [K(i) for i in (1, 2, 3, 5, 6, 7, 8)]   # oldest first
    for key, n in sizes.items():
        assert read_bytes(t2, key) == payload(key, n)
    assert len(t2) == 7 and t2.used_bytes == used


def test_second_process_cannot_open_the_same_folder(open_tier):
    t = open_tier()
    with pytest.raises(TierIOError, match="in use"):
        open_tier()
    t.close()
    open_tier()                                     # the lock went with close()


def test_recover_removes_orphans_temps_and_entries_without_files(open_tier):
    t = open_tier()
    for i in range(1, 5):
        put(t, K(i), payload(K(i), 5000))
    t.close()
    blocks = pathlib.Path(t.path) / "blocks"
    file_of(t, K(1)).unlink()                                       # index entry without file
    with open(file_of(t, K(2)), "r+b") as f:                        # wrong size
        f.truncate(100)
    orphan = file_of(t, K(9))                                       # file without index entry
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"orphan")
    temp = file_of(t, K(3)).with_name(K(3).hex() + ".tmp")         # leftover temp file
    temp.write_bytes(b"partial")
    misplaced = blocks / "00" / "00" / K(4).hex()                   # right name, wrong folder
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    misplaced.write_bytes(b"x" * 5000)
    stranger = blocks / "README"                                    # not ours: left alone
    stranger.write_text("hello")

    t2 = open_tier()
    assert t2.used_bytes == 4 * disk_bytes(5000)                    # before the check
    assert sorted(t2.recover()) == [(K(3), 5000), (K(4), 5000)]
    assert t2.used_bytes == 2 * disk_bytes(5000) and len(t2) == 2
    rel = lambda k: f"{k.hex()[:2]}/{k.hex()[2:4]}/{k.hex()}"
    assert block_files(t2.path) == sorted(["README", rel(K(3)), rel(K(4))])
    assert read_bytes(t2, K(3)) == payload(K(3), 5000)
    t2.close()
    t3 = open_tier()                                                # the index agrees too
    assert sorted(t3.recover()) == [(K(3), 5000), (K(4), 5000)]


def test_reopen_with_smaller_capacity_drops_oldest_blocks(open_tier):
    t = open_tier()
    for i in range(1, 6):
        put(t, K(i), payload(K(i), PAGE))
    t.close()
    t2 = open_tier(capacity=3 * PAGE)
    assert t2.used_bytes == 3 * PAGE
    assert sorted(k for k, _ in t2.recover()) == [K(3), K(4), K(5)]
    assert len(block_files(t2.path)) == 3


def test_index_map_grows_when_full(tmp_path):
    t = NVMeTier(tmp_path / "nvme", 1 << 30, direct=False, map_size=64 << 10)   # 16 pages
    for i in range(1200):
        put(t, K(i), b"b")
    assert len(t) == 1200 and t._env.info()["map_size"] > 64 << 10
    t.close()
    t2 = NVMeTier(tmp_path / "nvme", 1 << 30, direct=False, map_size=64 << 10)
    assert len(t2.recover()) == 1200 and read_bytes(t2, K(1199)) == b"b"
    t2.close()


def test_fsync_mode_round_trip(open_tier):
    t = open_tier(fsync=True)
    put(t, K(1), payload(K(1), 9000))
    t.close()
    t2 = open_tier(fsync=True)
    assert t2.recover() == [(K(1), 9000)] and read_bytes(t2, K(1)) == payload(K(1), 9000)


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "symlink"])
def test_damaged_file_raises_corrupt_block(open_tier, tmp_path, damage):
    t = open_tier()
    data = payload(K(1), 20_000)
    put(t, K(1), data)
    put(t, K(2), data[:100])
    path = file_of(t, K(1))
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[12_345] ^= 0x01
        path.write_bytes(raw)
        match = "checksum"
    elif damage == "truncate":
        os.truncate(path, 8192)
        match = "truncated: 8192 of 20000"
    elif damage == "missing":
        path.unlink()
        match = "missing"
    else:
        other = tmp_path / "elsewhere"
        other.write_bytes(data)
        path.unlink()
        path.symlink_to(other)
        match = "symbolic link"
    with pytest.raises(CorruptBlock, match=match):
        read_bytes(t, K(1))
    with pytest.raises(CorruptBlock):
        read_bytes(t, K(1), [(0, 10)])                     # ranges are verified too
    assert read_bytes(t, K(2)) == data[:100]               # other blocks unaffected
    t.free(K(1))                                    # what the manager does next
    assert K(1) not in t and t.used_bytes == PAGE


# ---------------------------------------------------------------- hostile keys


@pytest.mark.parametrize("key", [b"../../".ljust(32, b"\0"), b"/" * 32, b"\0" * 32,
                                 b"..\\..\\etc\\passwd".ljust(32, b"."), bytes(range(224, 256))])
def test_hostile_keys_stay_inside_the_tier_folder(open_tier, tmp_path, key):
    t = open_tier()
    put(t, key, b"secret")
    h = key.hex()
    assert block_files(t.path) == [f"{h[:2]}/{h[2:4]}/{h}"]
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and pathlib.Path(t.path) not in p.parents]
    assert outside == []
    assert read_bytes(t, key) == b"secret"
    t.close()
    assert open_tier().recover() == [(key, 6)]


# ---------------------------------------------------------------- I/O failures


def test_disk_full_on_write_leaves_nothing_behind(open_tier, monkeypatch):
    t = open_tier()
    put(t, K(1), b"kept")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    t.reserve(K(2), 50_000)
    with pytest.raises(TierIOError, match="disk full"):
        t.write(K(2), 0, payload(K(2), 50_000))
    monkeypatch.undo()
    assert K(2) not in t and t.used_bytes == PAGE
    assert len(block_files(t.path)) == 1            # no temp file
    t.abort(K(2))                                   # the manager's clean-up: a no-op now
    put(t, K(2), payload(K(2), 50_000))             # the space is usable again
    assert read_bytes(t, K(2)) == payload(K(2), 50_000)


def test_rename_failure_on_commit_is_an_io_error(open_tier, monkeypatch):
    t = open_tier()
    t.reserve(K(1), 3000)
    t.write(K(1), 0, b"r" * 3000)

    def broken(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", broken)
    with pytest.raises(TierIOError, match="committing"):
        t.commit(K(1))
    monkeypatch.undo()
    assert K(1) not in t and t.used_bytes == 0 and block_files(t.path) == []


def test_index_failure_on_commit_removes_the_renamed_file(open_tier, monkeypatch):
    t = open_tier()
    t.reserve(K(1), 3000)
    t.write(K(1), 0, b"r" * 3000)

    def broken(apply):
        raise lmdb.Error("simulated index failure")

    monkeypatch.setattr(t, "_index_txn", broken)
    with pytest.raises(TierIOError, match="simulated index failure"):
        t.commit(K(1))
    monkeypatch.undo()
    assert K(1) not in t and t.used_bytes == 0 and block_files(t.path) == []


# ---------------------------------------------------------------- configuration


def test_io_choices(tmp_path):
    with pytest.raises(ValueError, match="io must be one of"):
        NVMeTier(tmp_path / "a", 1 << 20, io="spdk")
    if nvme._gds_available():
        pytest.skip("this machine has a CUDA GPU and kvikio")
    with pytest.raises(ConfigError, match="io = gds needs a CUDA GPU and kvikio"):
        NVMeTier(tmp_path / "b", 1 << 20, io="gds")
    NVMeTier(tmp_path / "c", 1 << 20, io="auto").close()


# ---------------------------------------------------------------- concurrency and crashes


def test_concurrent_writes_and_reads(open_tier):
    t = open_tier()
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
                assert read_bytes(t, key) == data
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
t.recover()
i = 0
while True:
    key = i.to_bytes(4, "big") * 8
    data = payload(key, 3000 + (i * 7919) % 40000)
    t.reserve(key, len(data))
    t.write(key, 0, data[:1000])
    t.write(key, 1000, data[1000:])
    t.commit(key)
    if i % 3 == 2:
        t.free((i - 1).to_bytes(4, "big") * 8)
    print(i, flush=True)
    i += 1
"""


def test_sigkill_at_any_time_leaves_index_and_files_in_agreement(open_tier, tmp_path, mode):
    path = str(tmp_path / "nvme")
    script = CHILD.format(root=str(ROOT), path=path, direct=None if mode == "direct" else False)
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
    t = open_tier()
    recovered = dict(t.recover())
    assert done <= set(recovered)                                   # nothing committed is lost
    assert set(recovered) - done <= in_flight
    for key, n in recovered.items():
        assert read_bytes(t, key) == payload(key, n)
    files = block_files(path)
    assert not any(f.endswith(".tmp") for f in files)
    assert sorted(f.rsplit("/", 1)[1] for f in files) == sorted(k.hex() for k in recovered)
