"""Host tier: extent allocator (against a unit-map model), two-phase writes, reads, views."""

import random
import threading

import numpy as np
import pytest

from tiers.base import read_bytes

from tiers.errors import BlockNotStored, NoRoom
from tiers.base import TierKind
from tiers.allocator import ExtentAllocator
from tiers.host import HostTier


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i, n):
    """``n`` bytes that differ between blocks ``i`` and between positions."""
    return ((np.arange(n) + 7 * i) % 251).astype(np.uint8).tobytes()


def put(tier, key, data):
    tier.reserve(key, len(data))
    tier.write(key, 0, data)
    tier.commit(key)


# ---------------------------------------------------------------- allocator


def test_allocator_rounds_to_alignment_and_returns_to_empty():
    a = ExtentAllocator(1000, 64)
    assert a.capacity == 960                      # rounded down to 15 units of 64 bytes
    assert a.allocate(1) == (0, 64)
    assert a.allocate(64) == (64, 64)
    assert a.allocate(65) == (128, 128)
    assert a.allocate(0) == (256, 64)             # a zero-byte block still takes one unit
    assert a.used == 320
    for start, size in [(64, 64), (0, 64), (256, 64), (128, 128)]:
        a.release(start, size)
    assert a.used == 0
    assert a.free_extents() == [(0, 960)]


def test_allocator_best_fit_picks_smallest_hole():
    a = ExtentAllocator(64 * 10, 64)
    blocks = [a.allocate(64) for _ in range(10)]  # units 0..9
    a.release(*blocks[1])                         # hole of 1 unit at 64
    a.release(*blocks[3]); a.release(*blocks[4])  # hole of 2 units at 192
    a.release(*blocks[6]); a.release(*blocks[7]); a.release(*blocks[8])  # 3 units at 384
    assert a.free_extents() == [(64, 64), (192, 128), (384, 192)]
    assert a.allocate(100) == (192, 128)          # the 2-unit hole, not the first or largest
    assert a.allocate(10) == (64, 64)
    assert not a.can_allocate(193)
    with pytest.raises(NoRoom):
        a.allocate(193)


def test_allocator_coalesces_both_neighbours():
    a = ExtentAllocator(64 * 4, 64)
    x = [a.allocate(64) for _ in range(4)]
    a.release(*x[0])
    a.release(*x[2])
    assert a.free_bytes == 128 and a.largest_free == 64
    assert not a.can_allocate(128)                # 128 bytes free but not contiguous
    a.release(*x[1])                              # joins 0, 1 and 2
    assert a.free_extents() == [(0, 192)]
    assert a.allocate(192) == (0, 192)


def _model_fits(units, need):
    run = 0
    for used in units:
        run = 0 if used else run + 1
        if run >= need:
            return True
    return False


def test_allocator_random_sequence_against_unit_model():
    rng = random.Random(1234)
    align, num_units = 64, 200
    a = ExtentAllocator(align * num_units, align)
    units = [False] * num_units                   # the model: which units are taken
    live = {}
    for step in range(4000):
        if live and (rng.random() < 0.45 or len(live) > 60):
            start, size = live.pop(rng.choice(list(live)))
            a.release(start, size)
            for u in range(start // align, (start + size) // align):
                assert units[u]
                units[u] = False
        else:
            nbytes = rng.choice([1, 64, 65, 500, 1000, 2048, rng.randrange(1, 4000)])
            need = -(-nbytes // align)
            expected = _model_fits(units, need)
            assert a.can_allocate(nbytes) == expected, step
            if not expected:
                with pytest.raises(NoRoom):
                    a.allocate(nbytes)
                continue
            start, size = a.allocate(nbytes)
            assert size == need * align and start % align == 0
            for u in range(start // align, start // align + need):
                assert not units[u], "overlapping allocation"
                units[u] = True
            live[step] = (start, size)
        assert a.used == sum(units) * align
        free = a.free_extents()
        assert sum(s for _, s in free) == (num_units - sum(units)) * align
        # coalesced: no two free extents touch
        assert all(s0 + n0 < s1 for (s0, n0), (s1, _) in zip(free, free[1:]))
    for start, size in live.values():
        a.release(start, size)
    assert a.used == 0 and a.free_extents() == [(0, align * num_units)]


# ---------------------------------------------------------------- tier


def test_put_read_ranges_and_view():
    t = HostTier(1 << 20)
    assert t.kind is TierKind.HOST and t.name == "host"
    data = payload(3, 10_000)
    put(t, K(1), data)
    assert K(1) in t and len(t) == 1 and t.size_of(K(1)) == 10_000
    assert read_bytes(t, K(1)) == data
    assert read_bytes(t, K(1), [(0, 3), (9_990, 10), (500, 0)]) == data[:3] + data[9_990:]
    v = t.view(K(1))
    assert v.readonly and v.nbytes == 10_000 and bytes(v) == data
    assert t.used_bytes == 10_048                 # 10,000 rounded up to 64
    with pytest.raises(ValueError):
        read_bytes(t, K(1), [(9_999, 2)])
    with pytest.raises(KeyError):
        read_bytes(t, K(2))


def test_view_is_zero_copy_into_the_arena():
    t = HostTier(4096)
    put(t, K(1), b"a" * 100)
    off = t.offset_of(K(1))
    v = t.view(K(1))
    t._arena[off] = ord("z")                      # the arena itself, under the view
    assert bytes(v[:2]) == b"za"


def test_chunked_writes_and_write_errors():
    t = HostTier(1 << 16)
    data = payload(5, 3000)
    t.reserve(K(1), 3000)
    with pytest.raises(ValueError, match="offset 100 but 0"):
        t.write(K(1), 100, data[100:200])
    for off in range(0, 3000, 700):
        t.write(K(1), off, memoryview(data)[off:off + 700])
    with pytest.raises(ValueError, match="overruns"):
        t.write(K(1), 3000, b"x")
    assert K(1) not in t                          # invisible until commit
    t.commit(K(1))
    assert read_bytes(t, K(1)) == data
    with pytest.raises(BlockNotStored, match="not reserved"):
        t.write(K(9), 0, b"x")


def test_write_accepts_numpy_arrays_of_any_dtype():
    t = HostTier(1 << 16)
    arr = np.arange(256, dtype=np.float32)
    t.reserve(K(1), arr.nbytes)
    t.write(K(1), 0, arr)
    t.commit(K(1))
    assert np.array_equal(np.frombuffer(read_bytes(t, K(1)), dtype=np.float32), arr)


def test_commit_incomplete_and_duplicate_reserve():
    t = HostTier(1 << 16)
    t.reserve(K(1), 100)
    t.write(K(1), 0, b"x" * 50)
    with pytest.raises(ValueError, match="50 of 100"):
        t.commit(K(1))
    with pytest.raises(ValueError, match="already present"):
        t.reserve(K(1), 10)
    t.abort(K(1))
    assert t.used_bytes == 0 and K(1) not in t
    t.abort(K(1))                                 # unknown key: no-op
    put(t, K(1), b"y" * 10)
    with pytest.raises(ValueError, match="already present"):
        t.reserve(K(1), 10)


def test_capacity_never_exceeded_and_fits_matches_reserve():
    t = HostTier(64 * 8)
    assert t.fits(512) and not t.fits(513)
    for i in range(8):
        assert t.fits(60)
        t.reserve(K(i), 60)
        assert t.used_bytes == 64 * (i + 1) <= t.capacity_bytes
    assert not t.fits(1)
    with pytest.raises(NoRoom):
        t.reserve(K(99), 1)
    assert t.used_bytes == 512
    for i in range(8):
        t.abort(K(i))
    assert t.used_bytes == 0 and t.largest_free_extent == 512


def test_coalescing_makes_room_for_a_big_block_after_frees():
    t = HostTier(1024, alignment=64)
    for i in range(4):
        put(t, K(i), payload(i, 256))
    t.free(K(0))
    t.free(K(2))
    assert t.used_bytes == 512 and t.free_extents == 2
    assert t.fragmentation == pytest.approx(0.5)
    assert not t.fits(512)
    with pytest.raises(NoRoom):
        t.reserve(K(9), 512)
    t.free(K(1))                                  # 0, 1, 2 join into 768 bytes
    assert t.fits(768) and t.fragmentation == 0.0
    put(t, K(9), payload(9, 768))
    assert read_bytes(t, K(9)) == payload(9, 768) and read_bytes(t, K(3)) == payload(3, 256)
    t.free(K(9))
    t.free(K(3))
    assert t.used_bytes == 0 and t.free_extents == 1 and t.largest_free_extent == 1024


def test_random_blocks_keep_their_bytes():
    rng = random.Random(7)
    t = HostTier(64 * 1024, alignment=256)
    live = {}
    for step in range(600):
        if live and rng.random() < 0.4:
            key = rng.choice(list(live))
            assert read_bytes(t, key) == live.pop(key)
            t.free(key)
            continue
        n = rng.randrange(1, 5000)
        fits = t.fits(n)
        key = K(step)
        if not fits:
            with pytest.raises(NoRoom):
                t.reserve(key, n)
            continue
        data = rng.randbytes(n)
        put(t, key, data)
        live[key] = data
        assert t.used_bytes <= t.capacity_bytes
    for key, data in live.items():
        assert read_bytes(t, key) == data
        t.free(key)
    assert t.used_bytes == 0 and len(t) == 0


def test_concurrent_writes_and_reads_of_different_blocks():
    t = HostTier(8 << 20)
    lock = threading.Lock()                       # stands in for the manager's lock
    errors = []

    def worker(w):
        try:
            for i in range(50):
                key = K(w * 1000 + i)
                data = bytes([w]) * 4096 + bytes([i]) * 1000
                with lock:
                    t.reserve(key, len(data))
                t.write(key, 0, data[:3000])
                t.write(key, 3000, data[3000:])
                with lock:
                    t.commit(key)
                assert read_bytes(t, key) == data
                if i % 2:
                    with lock:
                        t.free(key)
        except Exception as e:                    # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(t) == 4 * 25 and t.used_bytes == 4 * 25 * 5120
