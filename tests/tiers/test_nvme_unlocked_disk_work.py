"""NVMe tier: a free's file removal and a commit's index transaction run without the tier's
lock, so other threads' writes and commits go on meanwhile, and nothing is seen half done.

A free makes the block gone for readers and gives its space back at once; its file is
moved away (to the spare files) and its index entry deleted after that, while
reservations and the tier's close wait for it (a reservation then takes the freed file,
within the capacity). A commit caches its checksums before its block can be read or freed,
and its index transaction comes after its decision (an abort then is too late). Both I/O
modes, as test_nvme.py.
"""

import os
import pathlib
import threading

import pytest

from nvme_support import K, block_files, disk_bytes, file_of, payload, put, read
from test_nvme_abort_races import DEADLINE, held_until_go, paused_in, run_a

from tiers.errors import BlockExists, BlockNotStored


def run_b(target, name: str = "B") -> tuple[threading.Thread, dict]:
    """``target`` on a thread that is not "A" (the pause hooks skip it)."""
    return run_a(target, name)


def disk_of(t) -> int:
    """Bytes of every file in the tier's block and spare folders."""
    root = pathlib.Path(t.path)
    return sum(p.stat().st_size for sub in ("blocks", "spare") for p in (root / sub).rglob("*") if p.is_file())


def test_a_free_moves_its_file_without_the_lock_and_reservations_wait_for_it(open_nvme, monkeypatch):
    n = 64 << 10
    t = open_nvme(capacity=2 * disk_bytes(n))          # K(1), then K(2) and K(3): two blocks at most
    put(t, K(1), payload(K(1), n))
    inode = file_of(t, K(1)).stat().st_ino
    t.reserve(K(2), n)                                  # reserved before the free
    inside, go = paused_in(monkeypatch, "rename")       # the free's move of the file to the spare files
    th, out = run_a(lambda: t.free(K(1)))
    assert inside.wait(DEADLINE)
    assert K(1) not in t and t.used_bytes == disk_bytes(n)   # gone for readers, its space back, at once
    with pytest.raises(BlockNotStored):
        read(t, K(1))
    b, b_out = run_b(lambda: (t.write(K(2), 0, payload(K(2), n)), t.commit(K(2))))
    b.join(DEADLINE)                                    # a write and a commit go on meanwhile
    assert b_out.get("result") == "done"
    c, c_out = run_b(lambda: put(t, K(3), payload(K(3), n)), name="C")
    c.join(0.2)
    assert "result" not in c_out                        # a reservation waits for the file to be moved
    go.set()
    th.join(DEADLINE)
    c.join(DEADLINE)
    monkeypatch.undo()
    assert out["result"] == "done" and c_out.get("result") == "done"
    assert file_of(t, K(3)).stat().st_ino == inode      # then takes the freed file: no new one
    assert t.used_bytes + t.spare_bytes <= t.capacity_bytes and disk_of(t) <= t.capacity_bytes
    assert read(t, K(2)) == payload(K(2), n) and read(t, K(3)) == payload(K(3), n)
    assert not file_of(t, K(1)).exists()


def test_the_tiers_close_waits_for_a_free_in_flight(open_nvme, monkeypatch):
    n = 64 << 10
    t = open_nvme()
    put(t, K(1), payload(K(1), n))
    put(t, K(2), payload(K(2), n))
    inside, go = paused_in(monkeypatch, "rename")
    th, out = run_a(lambda: t.free(K(1)))
    assert inside.wait(DEADLINE)
    c_out = held_until_go(t.close, go, th, name="C")    # the index stays open under the free
    monkeypatch.undo()
    assert out["result"] == "done" and c_out.get("result") == "done"
    t = open_nvme()
    assert K(1) not in t and read(t, K(2)) == payload(K(2), n)
    assert block_files(t.path) == [str(file_of(t, K(2)).relative_to(os.path.join(t.path, "blocks")))]


def test_a_freed_block_does_not_come_back_after_a_restart(open_nvme):
    t = open_nvme()
    n = 64 << 10
    put(t, K(1), payload(K(1), n))
    put(t, K(2), payload(K(2), n))
    t.free(K(1))
    t.close()
    t = open_nvme()
    assert K(1) not in t and read(t, K(2)) == payload(K(2), n)
    assert t.used_bytes == disk_bytes(n)                # one block's file
    assert not file_of(t, K(1)).exists()


def test_a_commit_indexes_its_block_without_the_lock_and_an_abort_then_is_too_late(open_nvme, monkeypatch):
    t = open_nvme()
    n = 64 << 10
    inside, go = paused_in(monkeypatch, "put", owner=t._index)

    def commit_a():
        t.reserve(K(1), n)
        t.write(K(1), 0, payload(K(1), n))
        t.commit(K(1))
    th, out = run_a(commit_a)
    assert inside.wait(DEADLINE)                        # renamed into place, its entry being written
    b, b_out = run_b(lambda: put(t, K(2), payload(K(2), n)))   # another block's whole put meanwhile
    b.join(DEADLINE)
    assert b_out.get("result") == "done"
    t.abort(K(1))                                       # decided: the block stays
    with pytest.raises(BlockExists):
        t.reserve(K(1), n)
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert out["result"] == "done"
    assert read(t, K(1)) == payload(K(1), n) and read(t, K(2)) == payload(K(2), n)
    t.close()
    t = open_nvme()                                     # both indexed on disk
    assert read(t, K(1)) == payload(K(1), n) and read(t, K(2)) == payload(K(2), n)


def test_a_block_freed_as_its_commit_ends_leaves_no_checksums_for_the_next_block_of_its_key(open_nvme, monkeypatch):
    n = 64 << 10
    t = open_nvme(spare_files=0)
    real = t._index.put
    inside, go = threading.Event(), threading.Event()

    def indexed_then_paused(key, entry, stale=()):      # thread "A" pauses once its block is visible
        real(key, entry, stale)
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            go.wait(DEADLINE)
    monkeypatch.setattr(t._index, "put", indexed_then_paused)
    th, out = run_a(lambda: put(t, K(1), payload(K(1), n)))
    assert inside.wait(DEADLINE)
    t.free(K(1))                                        # before A's commit returned
    go.set()
    th.join(DEADLINE)
    assert out["result"] == "done" and K(1) not in t
    inside.clear()
    go.clear()
    other = payload(K(7), n)                            # the same key and size, other bytes
    th, out = run_a(lambda: put(t, K(1), other))
    assert inside.wait(DEADLINE)                        # visible, its commit not returned yet
    assert read(t, K(1)) == other                       # verified against its own checksums
    go.set()
    th.join(DEADLINE)
    assert out["result"] == "done" and read(t, K(1)) == other
