"""NVMe tier: an eviction parks the block's file for the next reservation (no disk I/O
under the caller's lock), and nothing is ever served wrong or lost because of it.

``evict`` makes the block gone for readers and gives its space back at once; its file
keeps its name and index entry until the next reservation's writer renames it to its temp
file (and that reservation's commit drops the entry). A crash while it is parked brings
the block back whole; a graceful close or a delete of the key does not. Both I/O modes,
as test_nvme.py.
"""

import os
import threading

import pytest

from nvme_support import K, block_files, disk_bytes, file_of, payload, put, read
from test_nvme_abort_races import DEADLINE, held_until_go, paused_in, run_a
from test_nvme_unlocked_disk_work import disk_of, run_b

from tiers.errors import BlockNotStored, MediaIOError

N = 64 << 10


def crash(t) -> None:
    """Leave ``t`` as a killed process would: no close steps, only the folder released
    (its index written, as the page cache holds it after a SIGKILL)."""
    t._closed = True
    t._folder.close()


def stored(t, key: bytes, n: int = N) -> bool:
    """``key`` is stored with its own payload (never another block's bytes)."""
    if key not in t:
        return False
    assert read(t, key) == payload(key, n)
    return True


def evicted(t, key: bytes) -> int:
    """Evict ``key``; returns its file's inode (the file stays, parked)."""
    inode = file_of(t, key).stat().st_ino
    used = t.used_bytes
    t.evict(key)
    assert key not in t and t.used_bytes == used - disk_bytes(N)      # gone, its space back, at once
    with pytest.raises(BlockNotStored):
        read(t, key)
    return inode


def claimed_by(t, key: bytes) -> None:
    """K(1) put and evicted; ``key`` reserved, claiming K(1)'s parked file."""
    put(t, K(1), payload(K(1), N))
    evicted(t, K(1))
    t.reserve(key, N)


def paused_a(monkeypatch, name: str, path: str | None, target):
    """Run ``target`` on thread "A", paused at its first ``os.<name>`` (on ``path``); returns
    once it is there: (thread, its result dict, the event that releases it)."""
    inside, go = paused_in(monkeypatch, name, path)
    a, a_out = run_a(target)
    assert inside.wait(DEADLINE)
    return a, a_out, go


def test_the_next_reservation_reuses_an_evicted_blocks_file(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    inode = evicted(t, K(1))
    assert t.spare_bytes == disk_bytes(N)              # counted beside the blocks, like a spare file
    put(t, K(2), payload(K(2), N))
    assert file_of(t, K(2)).stat().st_ino == inode and not file_of(t, K(1)).exists()
    assert t.spare_bytes == 0 and stored(t, K(2))
    t.close()
    t = open_nvme()
    assert t.recovery.dropped == 0 and t.recovery.adopted == 0   # the index agreed with the files
    assert K(1) not in t and stored(t, K(2))


def test_a_crash_while_a_file_is_parked_brings_the_block_back_whole(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    evicted(t, K(1))
    crash(t)
    t = open_nvme()
    assert stored(t, K(1))


def test_a_graceful_close_or_a_delete_leaves_no_evicted_block_to_come_back(open_nvme):
    t = open_nvme()
    for i in (1, 2):
        put(t, K(i), payload(K(i), N))
    for i in (1, 2):
        evicted(t, K(i))
    t.forget_evicted(K(1))                              # a deleted block: moved away at once
    assert block_files(t.path) == [str(file_of(t, K(2)).relative_to(os.path.join(t.path, "blocks")))]
    crash(t)
    t = open_nvme()
    assert K(1) not in t and stored(t, K(2))            # K(2) was only evicted: back whole
    evicted(t, K(2))
    t.close()
    t = open_nvme()
    assert len(t) == 0 and block_files(t.path) == []
    assert t.used_bytes + t.spare_bytes <= t.capacity_bytes


def test_a_crash_once_the_file_is_reused_serves_neither_block(open_nvme):
    t = open_nvme()
    claimed_by(t, K(2))                                # K(1) evicted, its file claimed
    t.write(K(2), 0, payload(K(2), N)[: N // 2])       # K(1)'s file is K(2)'s temp file now
    assert not file_of(t, K(1)).exists()
    crash(t)
    t = open_nvme()
    assert len(t) == 0 and block_files(t.path) == []
    assert t.recovery.dropped == 1 and t.recovery.temps_removed + (t.spare_bytes > 0) >= 1


@pytest.mark.parametrize("order", ["own key first", "other key first"])
def test_a_put_of_the_evicted_key_takes_its_file_from_another_reservation(open_nvme, order):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    inode = evicted(t, K(1))
    t.reserve(K(2), N)                                  # claims K(1)'s parked file
    t.reserve(K(1), N)                                  # the file of its own name: taken over
    keys = [K(1), K(2)] if order == "own key first" else [K(2), K(1)]
    for k in keys:
        t.write(k, 0, payload(k, N))
        t.commit(k)
    assert file_of(t, K(1)).stat().st_ino == inode and stored(t, K(1)) and stored(t, K(2))
    t.close()
    t = open_nvme()
    assert stored(t, K(1)) and stored(t, K(2)) and t.recovery.adopted == 0


def test_a_commit_of_a_key_waits_while_its_old_file_is_moving(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    inode = evicted(t, K(1))
    t.reserve(K(2), N)                                  # claims K(1)'s file
    a, a_out, go = paused_a(monkeypatch, "rename", str(file_of(t, K(1))),   # moving K(1)'s old file
                            lambda: (t.write(K(2), 0, payload(K(2), N)), t.commit(K(2))))
    b_out = held_until_go(lambda: put(t, K(1), payload(K(1), N)), go, a)   # not renamed under A's move
    monkeypatch.undo()
    assert a_out.get("result") == "done" and b_out.get("result") == "done"
    assert file_of(t, K(2)).stat().st_ino == inode and stored(t, K(1)) and stored(t, K(2))
    t.close()
    t = open_nvme()
    assert stored(t, K(1)) and stored(t, K(2)) and t.recovery.dropped == 0


def test_an_aborted_reservation_leaves_its_claimed_file_parked(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    inode = evicted(t, K(1))
    t.reserve(K(2), N)
    t.abort(K(2))
    assert t.spare_bytes == disk_bytes(N)               # parked again, counted again
    put(t, K(3), payload(K(3), N))
    assert file_of(t, K(3)).stat().st_ino == inode and stored(t, K(3)) and K(2) not in t


@pytest.mark.parametrize("fsync", [False, True])
def test_evicting_to_make_room_keeps_the_capacity_and_every_block(open_nvme, fsync):
    sizes = [N, 4 * N, N // 2, 2 * N, N, 3 * N]        # mixed: a file a reservation cannot reuse too
    cap = 3 * disk_bytes(4 * N)
    t = open_nvme(capacity=cap, fsync=fsync)
    live: list[tuple[bytes, int]] = []
    for i in range(40):
        n = sizes[i % len(sizes)]
        while t.used_bytes + disk_bytes(n) > cap:
            t.evict(live.pop(0)[0])
        put(t, K(i), payload(K(i), n))
        live.append((K(i), n))
        assert t.used_bytes + t.spare_bytes <= cap and disk_of(t) <= cap
    assert all(stored(t, k, n) for k, n in live)
    t.close()
    t = open_nvme(capacity=cap, fsync=fsync)
    assert sorted(k for k, _ in live) == sorted(k for k, _ in t.recover())
    assert all(stored(t, k, n) for k, n in live) and t.recovery.adopted == 0 and t.recovery.dropped == 0


def test_evictions_and_puts_from_several_threads_lose_nothing(open_nvme):
    cap = 8 * disk_bytes(N)
    t = open_nvme(capacity=cap)
    lock = threading.Lock()
    live: list[bytes] = []
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(40):
                key = K(1000 * w + i)
                with lock:                              # room made and reserved together, as the store does
                    while t.used_bytes + disk_bytes(N) > cap:
                        t.evict(live.pop(0))
                    t.reserve(key, N)
                t.write(key, 0, payload(key, N))
                t.commit(key)
                with lock:
                    live.append(key)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE * 4)
    assert errors == [] and all(stored(t, k) for k in live)
    assert t.used_bytes + t.spare_bytes <= cap and disk_of(t) <= cap
    t.close()
    t = open_nvme(capacity=cap)
    assert sorted(live) == sorted(k for k, _ in t.recover()) and all(stored(t, k) for k in live)


def test_a_re_put_of_an_evicted_key_too_small_for_its_file_keeps_the_capacity(open_nvme):
    big = 256 << 10
    cap = 2 * disk_bytes(big)
    t = open_nvme(capacity=cap)
    put(t, K(1), payload(K(1), big))
    put(t, K(2), payload(K(2), big))
    t.evict(K(2))
    t.reserve(K(2), 16 << 10)                           # its old file is too large to reuse: moved away now
    assert not file_of(t, K(2)).exists()
    n3 = big - (24 << 10)
    put(t, K(3), payload(K(3), n3))                     # fits the space the eviction gave back
    assert t.used_bytes + t.spare_bytes <= cap and disk_of(t) <= cap
    t.write(K(2), 0, payload(K(2), 16 << 10))
    t.commit(K(2))
    assert stored(t, K(1), big) and stored(t, K(2), 16 << 10) and stored(t, K(3), n3)


def test_a_delete_waits_for_the_move_of_its_parked_file_then_never_comes_back(open_nvme, monkeypatch):
    t = open_nvme()
    claimed_by(t, K(2))                                # K(1) evicted, its file claimed
    a, a_out, go = paused_a(monkeypatch, "rename", str(file_of(t, K(1))),
                            lambda: t.write(K(2), 0, payload(K(2), N)))
    b_out = held_until_go(lambda: t.forget_evicted(K(1)), go, a)    # the delete waits while it moves
    monkeypatch.undo()
    assert a_out.get("result") == "done" and b_out.get("result") == "done"
    crash(t)                                            # before K(2)'s commit drops K(1)'s entry
    t = open_nvme()
    assert K(1) not in t and K(2) not in t and block_files(t.path) == []


@pytest.mark.parametrize("at", ["rename", "pwritev"])
def test_a_close_during_a_write_into_an_evicted_blocks_file_leaves_the_index_agreeing(open_nvme, monkeypatch, at):
    t = open_nvme()
    claimed_by(t, K(2))                                # K(1) evicted, its file claimed
    a, a_out, go = paused_a(monkeypatch, at, str(file_of(t, K(1))) if at == "rename" else None,
                            lambda: t.write(K(2), 0, payload(K(2), N)))     # moving K(1)'s file, or writing after
    closed, c_out = run_b(t.close)
    closed.join(0.3 if at == "rename" else DEADLINE)    # a close waits for a move, not for a write
    go.set()
    closed.join(DEADLINE)
    a.join(DEADLINE)
    monkeypatch.undo()
    assert c_out.get("result") == "done" and a_out.get("result") is not None
    t = open_nvme()
    assert len(t) == 0 and t.recovery.dropped == 0 and t.recovery.adopted == 0


def test_with_explicit_spare_bytes_the_files_stay_within_the_capacity(open_nvme):
    big, small = 200_000, 20_000
    cap = disk_bytes(big) + disk_bytes(small)
    t = open_nvme(capacity=cap, spare_bytes=cap)       # spare files limited on their own
    for k, n in ((K(1), big), (K(2), small)):
        put(t, k, payload(k, n))
    t.evict(K(1))
    put(t, K(1), payload(K(1), small))                 # its own file too large: deleted, not a spare
    assert t.used_bytes + t.spare_bytes <= cap and disk_of(t) <= cap
    assert stored(t, K(1), small) and stored(t, K(2), small)


def test_a_close_racing_a_commit_into_an_evicted_blocks_file_leaves_the_index_agreeing(open_nvme, monkeypatch):
    t = open_nvme()
    claimed_by(t, K(2))                                # K(1) evicted, its file claimed
    t.write(K(2), 0, payload(K(2), N))                 # K(1)'s file is K(2)'s temp file
    a, a_out, go = paused_a(monkeypatch, "rename", str(file_of(t, K(2))) + ".tmp",
                            lambda: t.commit(K(2)))                         # sealed, paused before its rename
    threading.Timer(0.3, go.set).start()
    t.close()
    a.join(DEADLINE)
    monkeypatch.undo()
    assert a_out.get("result") is not None
    t = open_nvme()
    assert t.recovery.dropped == 0 and K(1) not in t


def test_a_reservation_racing_the_close_is_refused_and_the_index_agrees(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    evicted(t, K(1))
    real, refused = t._writes.frees.drop_parked, []

    def reserve_then_drop(key=None):                    # another thread reserves during the close
        with pytest.raises(MediaIOError, match="closed"):
            t.reserve(K(2), N)
        refused.append(True)
        real(key)
    monkeypatch.setattr(t._writes.frees, "drop_parked", reserve_then_drop)
    t.close()
    assert refused == [True]
    t = open_nvme()
    assert len(t) == 0 and t.recovery.dropped == 0 and block_files(t.path) == []


def test_a_delete_taking_a_claimed_file_leaves_its_reservation_room_and_the_capacity(open_nvme):
    cap = 2 * disk_bytes(N)
    t = open_nvme(capacity=cap, spare_bytes=cap)       # spare files limited on their own
    put(t, K(1), payload(K(1), N))
    put(t, K(2), payload(K(2), N))
    t.evict(K(1))
    t.reserve(K(3), N)                                  # claims K(1)'s file
    t.forget_evicted(K(1))                              # deleted: the file goes, not to the spare files
    put_rest(t, K(3))
    assert stored(t, K(2)) and stored(t, K(3)) and K(1) not in t
    assert t.used_bytes + t.spare_bytes <= cap and disk_of(t) <= cap


def test_a_reservation_whose_claimed_file_a_delete_takes_waits_for_it_to_go(open_nvme, monkeypatch):
    t = open_nvme()
    claimed_by(t, K(3))                                # K(1) evicted, its file claimed
    a, a_out, go = paused_a(monkeypatch, "unlink", str(file_of(t, K(1))),
                            lambda: t.forget_evicted(K(1)))                 # deleting it, paused
    b_out = held_until_go(lambda: put_rest(t, K(3)), go, a)   # no new file while the old one goes
    monkeypatch.undo()
    assert a_out.get("result") == "done" and b_out.get("result") == "done"
    assert stored(t, K(3)) and K(1) not in t


def put_rest(t, key: bytes) -> None:
    t.write(key, 0, payload(key, N))
    t.commit(key)


def test_an_eviction_after_the_close_frees_the_block_for_good(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), N))
    t.close()
    t.evict(K(1))                                       # nothing would move a parked file now
    t = open_nvme()
    assert K(1) not in t and t.recovery.adopted == 0


def test_a_reservation_whose_file_its_key_took_back_does_not_wait_on_later_moves(open_nvme, monkeypatch):
    t = open_nvme()
    for i in (2, 1):
        put(t, K(i), payload(K(i), N))
    for i in (2, 1):
        t.evict(K(i))
    t.reserve(K(500), N)                                # claims K(1)'s file
    t.reserve(K(1), N)                                  # takes it back; K(500) gets K(2)'s
    put_rest(t, K(1))
    t.evict(K(1))
    a, a_out, go = paused_a(monkeypatch, "rename", str(file_of(t, K(1))),
                            lambda: t.forget_evicted(K(1)))                 # an unrelated delete, paused
    b, b_out = run_b(lambda: put_rest(t, K(500)))
    b.join(DEADLINE)
    assert b_out.get("result") == "done"                # did not wait for it
    go.set()
    a.join(DEADLINE)
    monkeypatch.undo()
    assert a_out.get("result") == "done" and stored(t, K(500)) and K(1) not in t
