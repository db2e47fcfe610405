"""NVMe tier: an evicted block's file retired in place (``NVMeTier.evict``).

An eviction does no disk work: the block is gone at once (not stored, its space back),
its file stays at its block path until the next reservation renames it into its temp file
(one rename), a later commit or the close settles the files no reservation takes, and
its index entry goes with the next index write. A crash before that may bring the block
back, whole; never a wrong block. Checked in both I/O modes, like test_nvme.py.
"""

import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from nvme_support import ROOT, K, block_files, disk_bytes, file_of, payload, put, read
from tiers.errors import BlockExists, BlockNotStored
from tiers.nvme.index import BlockIndex
from tiers.nvme.format import IndexEntry


def spare_dir(t) -> pathlib.Path:
    return pathlib.Path(t.path) / "spare"


def test_an_evicted_block_is_gone_at_once_and_its_file_becomes_the_next_blocks(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), payload(K(1), 100_000))
    inode = file_of(t, K(1)).stat().st_ino
    t.evict(K(1))
    assert K(1) not in t and len(t) == 0 and t.used_bytes == 0
    assert t.spare_bytes == disk_bytes(100_000)          # retired: outside the blocks, inside the capacity
    with pytest.raises(BlockNotStored):
        read(t, K(1))
    with pytest.raises(BlockNotStored):
        t.free(K(1))
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), real_rename(a, b))[1])
    put(t, K(2), payload(K(2), 100_000))
    monkeypatch.undo()
    assert file_of(t, K(2)).stat().st_ino == inode and not file_of(t, K(1)).exists()
    assert renames == [(str(file_of(t, K(1))), str(file_of(t, K(2))) + ".tmp"),     # one rename in,
                       (str(file_of(t, K(2))) + ".tmp", str(file_of(t, K(2))))]     # one to its name
    assert read(t, K(2)) == payload(K(2), 100_000) and t.spare_bytes == 0
    t.close()
    t2 = open_nvme()
    assert dict(t2.recover()) == {K(2): 100_000} and t2.recovery.dropped == 0


def test_a_spare_file_is_written_where_it_lies_and_renamed_once(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), payload(K(1), 60_000))
    t.free(K(1))                                        # a free moves the file to the spare files
    (spare,) = spare_dir(t).iterdir()
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), real_rename(a, b))[1])
    t.reserve(K(2), 60_000)
    t.write(K(2), 0, payload(K(2), 60_000))
    assert renames == [] and not file_of(t, K(2)).exists()     # no block's name while it is written
    t.commit(K(2))
    monkeypatch.undo()
    assert renames == [(str(spare), str(file_of(t, K(2))))]
    assert read(t, K(2)) == payload(K(2), 60_000) and list(spare_dir(t).iterdir()) == []


def test_a_spare_file_left_half_written_by_a_crash_is_a_spare_file_again(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), 60_000))
    t.free(K(1))
    t.reserve(K(2), 60_000)
    t.write(K(2), 0, payload(K(2), 60_000))             # written, never committed: the process dies
    t._folder.close()                                   # (its folder lock released as by the kill)
    t._closed = True
    t2 = open_nvme()
    assert dict(t2.recover()) == {} and t2.recovery.quarantined == 0
    assert t2.spare_bytes == disk_bytes(60_000) and block_files(t2.path) == []
    put(t2, K(3), payload(K(3), 60_000))
    assert read(t2, K(3)) == payload(K(3), 60_000)


def test_a_block_stored_again_takes_its_own_retired_file(open_nvme):
    t = open_nvme()
    for i in (1, 2):
        put(t, K(i), payload(K(i), 50_000))
    inodes = {i: file_of(t, K(i)).stat().st_ino for i in (1, 2)}
    t.evict(K(1))
    t.evict(K(2))
    t.reserve(K(3), 50_000)            # reserved first, opened later: takes a retired file then
    put(t, K(1), payload(K(1), 50_000))
    assert file_of(t, K(1)).stat().st_ino == inodes[1]  # its own file, though K(2)'s retired last
    t.write(K(3), 0, payload(K(3), 50_000))
    t.commit(K(3))
    assert file_of(t, K(3)).stat().st_ino == inodes[2] and not file_of(t, K(2)).exists()
    assert read(t, K(1)) == payload(K(1), 50_000) and read(t, K(3)) == payload(K(3), 50_000)
    with pytest.raises(BlockExists):
        t.reserve(K(1), 10)


def test_an_aborted_reservation_gives_its_own_retired_file_back(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), 30_000))
    t.evict(K(1))
    t.reserve(K(1), 30_000)
    assert t.spare_bytes == 0
    t.abort(K(1))
    assert t.spare_bytes == disk_bytes(30_000) and file_of(t, K(1)).exists() and K(1) not in t
    t.close()                                           # the close settles it among the spare files
    assert not file_of(t, K(1)).exists() and len(list(spare_dir(t).iterdir())) == 1
    t2 = open_nvme()
    assert dict(t2.recover()) == {} and t2.spare_bytes == disk_bytes(30_000)


def test_a_commit_settles_the_retired_files_no_reservation_waits_for(open_nvme):
    t = open_nvme()
    for i in range(4):
        put(t, K(i), payload(K(i), 20_000))
    for i in range(4):
        t.evict(K(i))
    assert all(file_of(t, K(i)).exists() for i in range(4))
    t.reserve(K(10), 20_000)                            # waits for a file: one retired file stays
    put(t, K(11), payload(K(11), 20_000))               # takes one, and settles two of the rest
    assert sum(file_of(t, K(i)).exists() for i in range(4)) == 1
    assert len(list(spare_dir(t).iterdir())) == 2
    t.write(K(10), 0, payload(K(10), 20_000))
    t.commit(K(10))
    assert not any(file_of(t, K(i)).exists() for i in range(4))
    assert sorted(block_files(t.path)) == sorted(str(file_of(t, k).relative_to(pathlib.Path(t.path) / "blocks"))
                                                 for k in (K(10), K(11)))
    assert t.used_bytes + t.spare_bytes <= t.capacity_bytes


def test_retired_files_count_within_the_capacity(open_nvme):
    capacity = 6 * disk_bytes(1 << 20)
    t = open_nvme(capacity=capacity)
    rng = random.Random(3)
    held: list[bytes] = []
    for i in range(120):                                # a cache in service with mixed sizes
        k, n = K(100 + i), rng.choice([100_000, 1 << 20, 2 << 20])
        while not t.fits(n):
            t.evict(held.pop(0))
        put(t, k, payload(k, n))
        held.append(k)
        on_disk = sum(p.stat().st_size for p in pathlib.Path(t.path).glob("*/**/*")
                      if p.is_file() and p.parts[-2] != "index")
        assert t.used_bytes + t.spare_bytes <= capacity and on_disk <= capacity, i
    assert all(read(t, k) == payload(k, t.size_of(k)) for k in held)


def disk_of(t) -> int:
    """Bytes allocated to the tier's files (blocks, spare and retired files)."""
    return sum(q.stat().st_blocks * 512 for q in pathlib.Path(t.path).glob("*/**/*")
               if q.is_file() and q.parts[-2] != "index")


def test_retired_files_larger_than_the_blocks_that_follow_never_take_the_disk_past_the_capacity(open_nvme):
    mib = 1 << 20
    capacity = 2 * disk_bytes(mib)
    t = open_nvme(capacity=capacity)
    put(t, K(1), payload(K(1), mib))
    put(t, K(2), payload(K(2), mib))
    t.evict(K(1))
    t.reserve(K(3), 100_000)                # a small block waits: the large retired file is no use to it
    put(t, K(4), payload(K(4), 100_000))
    assert t.used_bytes + t.spare_bytes <= capacity and disk_of(t) <= capacity
    t.write(K(3), 0, payload(K(3), 100_000))
    t.commit(K(3))
    t.evict(K(2))
    t.reserve(K(2), 4096)                   # stored again smaller: its large old file is not its file
    n = (capacity - t.used_bytes - disk_bytes(0) - 8192) // 4096 * 4096
    put(t, K(5), payload(K(5), n))
    t.write(K(2), 0, payload(K(2), 4096))
    t.commit(K(2))
    assert t.used_bytes + t.spare_bytes <= capacity and disk_of(t) <= capacity
    assert all(read(t, k) == payload(k, t.size_of(k)) for k in (K(2), K(3), K(4), K(5)))


def test_a_reservation_renames_its_own_retired_file_under_the_tiers_lock(open_nvme, monkeypatch):
    """Were the rename of a key's own retired file outside the lock, an abort and a new put
    of that key in between would be renamed away by it: a committed block lost."""
    t = open_nvme()
    put(t, K(9), payload(K(9), 50_000))
    t.free(K(9))                                        # a spare file for the second put
    put(t, K(1), payload(K(1), 50_000))
    t.evict(K(1))
    own = str(file_of(t, K(1)))
    other = {}
    real_rename = os.rename

    def rename(a, b):
        if a == own and not other:                      # the reservation's own file moves: now
            def abort_and_put_again():                  # another thread aborts it and stores K(1)
                t.abort(K(1))
                deadline = time.monotonic() + 30
                while True:                             # busy while the aborted write still runs
                    try:
                        put(t, K(1), payload(K(1), 50_000))
                        return
                    except BlockExists:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
            other["thread"] = threading.Thread(target=abort_and_put_again)
            other["thread"].start()
            other["thread"].join(0.5)
            other["blocked"] = other["thread"].is_alive()
        return real_rename(a, b)
    monkeypatch.setattr(os, "rename", rename)
    t.reserve(K(1), 50_000)
    try:
        t.write(K(1), 0, payload(K(1), 50_000))
    except BlockNotStored:
        pass                                            # aborted by the other thread meanwhile
    other["thread"].join(30)
    monkeypatch.undo()
    assert other["blocked"]                             # it waited for the rename to end
    assert read(t, K(1)) == payload(K(1), 50_000)
    t.close()
    t2 = open_nvme()
    assert dict(t2.recover()) == {K(1): 50_000}


def test_any_interleaving_of_evictions_frees_and_puts_serves_each_block_its_own_bytes(open_nvme):
    """Reservations opened out of order, keys stored again while their old files are
    retired, frees and aborts between: every block reads back its own bytes, now and after
    a restart, and nothing else comes back."""
    t = open_nvme()
    rng = random.Random(11)
    stored: dict[bytes, int] = {}
    open_: dict[bytes, int] = {}
    for step in range(600):
        op = rng.random()
        k = K(rng.randrange(24))
        if op < 0.3 and k not in stored and k not in open_:
            n = rng.choice([4096, 5000, 70_000])
            t.reserve(k, n)
            open_[k] = n
        elif op < 0.55 and open_:
            k = rng.choice(list(open_))
            n = open_.pop(k)
            if rng.random() < 0.1:
                t.abort(k)
                continue
            t.write(k, 0, payload(k, n))
            t.commit(k)
            stored[k] = n
        elif op < 0.85 and stored:
            k = rng.choice(list(stored))
            (t.evict if rng.random() < 0.8 else t.free)(k)
            del stored[k]
        for key, n in stored.items():
            if rng.random() < 0.05:
                assert read(t, key) == payload(key, n), step
        assert t.used_bytes + t.spare_bytes <= t.capacity_bytes
    for k in list(open_):
        t.abort(k)
    assert {k: t.size_of(k) for k in stored} == stored
    assert all(read(t, k) == payload(k, n) for k, n in stored.items())
    t.close()
    t2 = open_nvme()
    assert dict(t2.recover()) == stored and t2.recovery.quarantined == 0
    assert all(read(t2, k) == payload(k, n) for k, n in stored.items())


def test_an_index_entry_forgotten_then_put_again_survives_and_one_only_forgotten_does_not(tmp_path):
    entry = IndexEntry(100, 16384, 1.0, 4096)
    index = BlockIndex(str(tmp_path), fsync=False, map_size=1 << 20, name="t")
    index.put(K(1), entry)
    index.put(K(2), entry)
    index.forget(K(1))
    index.forget(K(2))
    assert K(1) not in index.entries
    index.put(K(1), entry)                              # the delete and the put in one transaction
    index.flush()                                       # the pending delete of K(2)
    index.close()
    index = BlockIndex(str(tmp_path), fsync=False, map_size=1 << 20, name="t")
    assert set(index.entries) == {K(1)}
    index.close()


def test_a_failed_index_write_keeps_the_forgotten_deletes_for_the_next(tmp_path, monkeypatch):
    import lmdb
    entry = IndexEntry(100, 16384, 1.0, 4096)
    index = BlockIndex(str(tmp_path), fsync=False, map_size=1 << 20, name="t")
    index.put(K(1), entry)
    index.forget(K(1))
    real_begin = index._env.begin
    monkeypatch.setattr(index, "_env", type("Env", (), {"begin": lambda *a, **k: (_ for _ in ()).throw(
        lmdb.DiskError("injected")), "info": real_begin.__self__.info})())
    with pytest.raises(lmdb.Error):
        index.put(K(2), entry)
    monkeypatch.undo()
    assert K(2) not in index.entries
    index.flush()
    index.close()
    index = BlockIndex(str(tmp_path), fsync=False, map_size=1 << 20, name="t")
    assert set(index.entries) == set()
    index.close()


CHILD = """
import sys, time
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from nvme_support import K, payload, put
from tiers.nvme import NVMeTier

t = NVMeTier({path!r}, 1 << 30, direct={direct!r})
for i in (1, 2, 3):
    put(t, K(i), payload(K(i), 40_000))
t.evict(K(2))
put(t, K(4), payload(K(4), 40_000))          # takes K(2)'s retired file; its index write drops K(2)
t.evict(K(1))                                # retired in place, its entry not yet written away
print("ready", flush=True)
time.sleep(600)
"""


def test_a_crash_after_evictions_brings_back_only_whole_blocks(open_nvme, tmp_path, io_mode):
    path = str(tmp_path / "nvme")
    script = CHILD.format(root=str(ROOT), tests=str(pathlib.Path(__file__).parent), path=path,
                          direct=None if io_mode == "direct" else False)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    t = open_nvme()
    recovered = dict(t.recover())
    assert set(recovered) == {K(1), K(3), K(4)}         # K(1) back, whole; K(2)'s file is K(4)'s now
    assert t.recovery.quarantined == 0 and t.recovery.dropped == 0
    assert all(read(t, k) == payload(k, n) for k, n in recovered.items())


def test_the_store_retires_the_files_it_evicts_and_removes_the_ones_it_deletes(tmp_path):
    """Through the store: an NVMe block evicted to make room leaves its file for the next
    put (no new file); a deleted one is gone from its path when delete returns."""
    from kvstore.policy import make_policy
    from kvstore.store.manager import TierManager
    from support.fake_tiers import MemTier
    from tiers.base import TierKind
    from tiers.nvme.tier import NVMeTier

    n = 20_000
    host = MemTier(TierKind.HOST, 2 * n)
    nvme = NVMeTier(tmp_path / "nvme", 4 * disk_bytes(n))
    m = TierManager([host, nvme], [make_policy("lru", t.capacity_bytes) for t in (host, nvme)],
                    watermarks=(1.0, 1.0), promote_on_get=False)
    try:
        for i in range(12):                             # puts beyond both tiers: NVMe evicts
            m.put(K(i), payload(K(i), n))
        files = block_files(nvme.path)
        assert len(files) == 4 and m.counters["blocks_dropped"] >= 6
        assert not (pathlib.Path(nvme.path) / "spare").exists() or not any((pathlib.Path(nvme.path) / "spare").iterdir())
        kept = [K(i) for i in range(12) if K(i) in nvme]
        assert len(kept) == 4 and all(read(nvme, k) == payload(k, n) for k in kept)
        assert m.delete([kept[0]]) == 1
        assert not file_of(nvme, kept[0]).exists() and len(block_files(nvme.path)) == 3
        assert all(bytes(m.get(k).data) == payload(k, n) for k in kept[1:])
    finally:
        m.close()
        nvme.close()


def test_a_block_whose_nvme_copy_was_evicted_is_gone_from_disk_once_deleted(tmp_path):
    """A copy evicted from NVMe (its file retired in place) while the block stays in host
    memory: the store's delete of the block moves that file too, so no crash brings back a
    deleted block."""
    from kvstore.policy import make_policy
    from kvstore.store.manager import TierManager
    from support.fake_tiers import MemTier
    from tiers.base import TierKind
    from tiers.nvme.tier import NVMeTier

    n = 20_000
    host = MemTier(TierKind.HOST, 8 * n)
    nvme = NVMeTier(tmp_path / "nvme", 1 << 26)
    m = TierManager([host, nvme], [make_policy("lru", t.capacity_bytes) for t in (host, nvme)])
    k = K(7)
    try:
        m.put(k, payload(k, n))
        assert m.demote(k, 0) and m.promote(k, 0) and k in host and k in nvme    # copies in both
        assert m.demote(k, 1) and k not in nvme and file_of(nvme, k).exists()      # NVMe's retired
        assert m.delete([k]) == 1
        assert not file_of(nvme, k).exists() and block_files(nvme.path) == []
        assert m.delete([K(8)]) == 0                                               # unknown: nothing
    finally:
        m.close()
        nvme.close()
    again = NVMeTier(tmp_path / "nvme", 1 << 26)
    try:
        assert dict(again.recover()) == {}
    finally:
        again.close()
