"""NVMe tier with ``fsync``: commits in flight together share one index transaction
(group commit, :mod:`tiers.nvme.group`), and no block is indexed before its bytes and its
name are flushed; a crash inside a batch (SIGKILL at each step) leaves index and files in
agreement with every acknowledged block readable; a step that fails fails its own
commit (a flush) or its batch (the index transaction), never another block's."""

import errno
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import lmdb
import pytest

from nvme_support import ROOT, K, block_files, disk_bytes, file_of, payload, put, read
from tiers.errors import MediaIOError
from tiers.nvme import commit as nvme_commit

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")

WAIT_S = 60.0


def written(t, keys, size=20_000):
    """Reserve and write each block (not committed yet)."""
    for k in keys:
        t.reserve(k, size)
        t.write(k, 0, payload(k, size))


def commit_all(t, keys, first_inside=None):
    """Commit ``keys`` from one thread each; returns {key: error or None}. With
    ``first_inside`` (an Event set once the first commit is inside its index transaction)
    ``keys[0]`` commits first and the others start once it is there."""
    out = {}

    def one(k):
        try:
            t.commit(k)
            out[k] = None
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[k] = e
    threads = [threading.Thread(target=one, args=(k,)) for k in keys]
    for i, th in enumerate(threads):
        th.start()
        if i == 0 and first_inside is not None:
            assert first_inside.wait(WAIT_S)
    for th in threads:
        th.join(WAIT_S * 2)
    assert not any(th.is_alive() for th in threads), "a commit never returned"
    return out


class HeldIndex:
    """The tier's index ``put_many`` wrapped: the first transaction sets ``inside`` and
    waits until ``others`` commits queue for the next batch (which then carries them
    all); ``fail(n)`` may raise in transaction ``n``. ``batches``: the keys of each."""

    def __init__(self, t, monkeypatch, others, fail=None):
        self.inside, self.batches = threading.Event(), []
        real = t._index.put_many

        def put_many(items, stale=()):
            n = len(self.batches)
            self.batches.append([k for k, _ in items])
            if n == 0:
                self.inside.set()
                deadline = time.monotonic() + WAIT_S
                while t._writes.group.waiting < others and time.monotonic() < deadline:
                    time.sleep(0.005)
            if fail is not None:
                fail(n)
            return real(items, stale)
        monkeypatch.setattr(t._index, "put_many", put_many)


def test_commits_in_flight_share_an_index_transaction_after_their_flushes(open_nvme, monkeypatch):
    t = open_nvme(fsync=True)
    keys = [K(i) for i in range(8)]
    written(t, keys)
    events, lock = [], threading.Lock()

    def note(*event):
        with lock:
            events.append(event)

    real_sync, real_dir, real_rename = nvme_commit.fdatasync, nvme_commit.fsync_folder, os.rename
    monkeypatch.setattr(nvme_commit, "fdatasync",
                        lambda fd: (real_sync(fd), note("data", os.readlink(f"/proc/self/fd/{fd}")))[0])
    monkeypatch.setattr(nvme_commit, "fsync_folder", lambda folder: (real_dir(folder), note("folder", folder))[0])
    monkeypatch.setattr(os, "rename", lambda a, b: (real_rename(a, b), note("rename", str(b)))[0])
    held = HeldIndex(t, monkeypatch, others=7)
    real_index = t._index.put_many
    monkeypatch.setattr(t._index, "put_many", lambda items, stale=(): (real_index(items, stale), note("index", [k for k, _ in items]))[0])

    assert commit_all(t, keys, held.inside) == {k: None for k in keys}
    assert [len(b) for b in held.batches] == [1, 7]                # 8 commits, 2 index transactions
    assert t._writes.group.batches == 2 and t._writes.group.items == 8
    for k in keys:
        final = str(file_of(t, k))
        at = {e: i for i, e in enumerate(map(repr, events))}
        data = at[repr(("data", final + ".tmp"))]
        rename = at[repr(("rename", final))]
        folder = at[repr(("folder", os.path.dirname(final)))]
        index = next(i for i, e in enumerate(events) if e[0] == "index" and k in e[1])
        assert data < rename < folder < index, f"block {k.hex()[:8]}: {events}"
        assert read(t, k) == payload(k, 20_000)
    t.close()
    t2 = open_nvme(fsync=True)
    assert sorted(k for k, _ in t2.recover()) == sorted(keys) and t2.recovery.adopted == 0


def test_a_new_folder_is_flushed_in_its_parents_before_its_block_is_indexed(open_nvme, monkeypatch):
    t = open_nvme(fsync=True)
    flushed = []
    real = nvme_commit.fsync_folder
    monkeypatch.setattr(nvme_commit, "fsync_folder", lambda folder: (real(folder), flushed.append(folder))[0])
    put(t, K(1), payload(K(1), 5000))
    leaf = file_of(t, K(1)).parent                                  # blocks/abc
    assert [str(leaf.parent), str(leaf)] == flushed
    put(t, K(257), payload(K(257), 5000))                            # the same folder: only the leaf again
    assert K(257).hex()[:3] == K(1).hex()[:3] and flushed[2:] == [str(leaf)]


def test_a_failed_flush_fails_that_commit_alone(open_nvme, monkeypatch):
    t = open_nvme(fsync=True)
    keys = [K(i) for i in range(4)]
    written(t, keys)
    bad = keys[2].hex() + ".tmp"
    real = nvme_commit.fdatasync

    def sync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(bad):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)
    monkeypatch.setattr(nvme_commit, "fdatasync", sync)
    held = HeldIndex(t, monkeypatch, others=2)                        # the failing one never queues
    out = commit_all(t, keys, held.inside)
    assert [len(b) for b in held.batches] == [1, 2]
    assert isinstance(out.pop(keys[2]), MediaIOError) and set(out.values()) == {None}
    monkeypatch.undo()
    assert keys[2] not in t and all(k in t for k in keys if k != keys[2])
    assert t.used_bytes == 3 * disk_bytes(20_000)
    assert not any(keys[2].hex() in f for f in block_files(t.path))
    put(t, keys[2], payload(keys[2], 20_000))                         # the block can be put again
    assert [read(t, k) for k in keys] == [payload(k, 20_000) for k in keys]


def test_a_failed_index_transaction_fails_its_batch_and_leaves_nothing(open_nvme, monkeypatch):
    t = open_nvme(fsync=True)
    keys = [K(i) for i in range(6)]
    written(t, keys)

    def fail(n):
        if n == 1:
            raise lmdb.Error("simulated index failure")
    held = HeldIndex(t, monkeypatch, others=5, fail=fail)
    out = commit_all(t, keys, held.inside)
    first = keys[0]
    assert held.batches[0] == [first] and out[first] is None
    failed = keys[1:]
    assert sorted(held.batches[1]) == sorted(failed)
    assert all(isinstance(out[k], MediaIOError) and "kvstore repair-index" in str(out[k]) for k in failed)
    monkeypatch.undo()
    assert [k in t for k in keys] == [k == first for k in keys]
    assert t.used_bytes == disk_bytes(20_000)
    assert block_files(t.path) == [f"{first.hex()[:3]}/{first.hex()}"]
    for k in failed:
        put(t, k, payload(k, 20_000))
    assert all(read(t, k) == payload(k, 20_000) for k in keys)


CHILD = """
import os, signal, sys, threading
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from nvme_support import K, payload
from tiers.nvme import commit as nvme_commit
from tiers.nvme.tier import NVMeTier

t = NVMeTier({path!r}, 1 << 30, fsync=True, direct={direct!r})
point, calls, lock = {point!r}, [0], threading.Lock()

def hit(where):
    with lock:
        calls[0] += where == point
        if calls[0] == 12:                    # inside a batch, well after the start
            os.kill(os.getpid(), signal.SIGKILL)

real_rename, real_index, real_sync = os.rename, t._index.put_many, nvme_commit.fdatasync
def rename(a, b):
    real_rename(a, b)
    if b.startswith({path!r}):
        hit("after rename")
os.rename = rename
def put_many(items, stale=()):
    hit("before index")
    real_index(items, stale)
    hit("after index")
t._index.put_many = put_many
def sync(fd):
    real_sync(fd)
    hit("after flush")
nvme_commit.fdatasync = sync

def say(what, i):
    with lock:
        sys.stdout.write(f"{{what}} {{i}}\\n")
        sys.stdout.flush()

def writer(w):
    for i in range(w, 10_000, 4):
        k = K(i)
        t.reserve(k, 6000 + i)
        t.write(k, 0, payload(k, 6000 + i))
        say("start", i)
        t.commit(k)
        say("done", i)
threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
for th in threads: th.start()
for th in threads: th.join()
"""


@pytest.mark.parametrize("point", ["after flush", "after rename", "before index", "after index"])
def test_a_crash_inside_a_group_commit_leaves_every_acknowledged_block(open_nvme, tmp_path, io_mode, point):
    path = str(tmp_path / "nvme")
    script = CHILD.format(root=str(ROOT), tests=str(pathlib.Path(__file__).parent), path=path,
                          direct=None if io_mode == "direct" else False, point=point)
    child = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stdout[-2000:]
    lines = [line.split() for line in child.stdout.splitlines()]
    done = {K(int(i)) for what, i in lines if what == "done"}
    started = {K(int(i)) for what, i in lines if what == "start"}
    assert len(done) >= 8
    t = open_nvme(fsync=True)
    recovered = dict(t.recover())
    assert done <= set(recovered)                                   # every acknowledged block is there
    assert set(recovered) <= started                                # and nothing that was not written
    for k, n in recovered.items():
        assert read(t, k) == payload(k, n)
    files = block_files(path)
    assert not any(f.endswith(".tmp") for f in files)
    assert sorted(f.rsplit("/", 1)[1] for f in files) == sorted(k.hex() for k in recovered)
    assert t.recovery.quarantined == 0
