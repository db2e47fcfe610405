"""NVMe tier: a free's file removal and a commit's index transaction run without the tier's
lock, so other threads' writes and commits go on meanwhile, and nothing is seen half done.

A free makes the block gone for readers and gives its space back at once; its file is
moved away (to the spare files) and its index entry deleted after that, while the key
stays busy: a reservation of it raises BlockExists until the file is gone. A commit's index
transaction comes after its decision (an abort then is too late). Both I/O modes, as
test_nvme.py.
"""

import os

from nvme_support import K, block_files, disk_bytes, file_of, payload, put, read
from test_nvme_abort_races import DEADLINE, paused_in, run_a
import pytest

from tiers.errors import BlockExists, BlockNotStored


def put_in_b(t, key: bytes, n: int):
    """A whole put of ``key`` on thread "B"; returns the thread and its result (:func:`run_a`
    names its thread "A": this one is "B", so A's pause hooks skip it)."""
    import threading
    out: dict = {}

    def body():
        try:
            put(t, key, payload(key, n))
            out["result"] = "done"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["result"] = e
    th = threading.Thread(target=body, name="B")
    th.start()
    return th, out


def test_a_free_moves_its_file_away_without_the_lock_while_its_key_stays_busy(open_nvme, monkeypatch):
    t = open_nvme()
    n = 64 << 10
    put(t, K(1), payload(K(1), n))
    inside, go = paused_in(monkeypatch, "rename")     # the free's move of the file to the spare files
    th, out = run_a(lambda: t.free(K(1)))
    assert inside.wait(DEADLINE)
    assert K(1) not in t and t.used_bytes == 0          # gone for readers, its space back, at once
    with pytest.raises(BlockNotStored):
        read(t, K(1))
    with pytest.raises(BlockExists, match="being freed"):
        t.reserve(K(1), n)                              # its file is still where a new one would go
    b, b_out = put_in_b(t, K(2), n)                     # another block's whole put meanwhile
    b.join(DEADLINE)
    assert b_out.get("result") == "done"
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert out["result"] == "done"
    assert read(t, K(2)) == payload(K(2), n)
    assert not file_of(t, K(1)).exists()
    put(t, K(1), payload(K(1), n))                      # free to reserve again, written anew
    assert read(t, K(1)) == payload(K(1), n)
    assert sorted(block_files(t.path)) == sorted(
        str(file_of(t, k).relative_to(os.path.join(t.path, "blocks"))) for k in (K(1), K(2)))


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
    b, b_out = put_in_b(t, K(2), n)                     # another block's whole put meanwhile
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
