"""tiers.host_copy: every copy is exact, whichever loop it takes, and the choice follows the
configured mode or the measurement."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tiers import host_copy


@pytest.fixture(params=["words", "memcpy"])
def mode(request, monkeypatch):
    monkeypatch.setattr(host_copy, "_words", request.param == "words")
    return request.param


def page_aligned(n: int):
    m = mmap.mmap(-1, n + 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 7, 4096, 16 << 10, (16 << 10) + 3, 32 << 10, 256 << 10, 1 << 20])
@pytest.mark.parametrize("shift", [0, 16, 24, 64, 4095])
def test_copy_is_exact_at_every_size_and_distance(mode, size, shift):
    m1, src_all = page_aligned(size)
    m2, dst_all = page_aligned(size)
    src_all[:] = np.random.default_rng(size + shift).integers(0, 256, src_all.size, dtype=np.uint8)
    dst_all[:] = 0xAB
    src, dst = src_all[:size], dst_all[shift:shift + size]
    host_copy.copy(dst, src)
    assert np.array_equal(dst, src)
    assert (dst_all[:shift] == 0xAB).all() and (dst_all[shift + size:] == 0xAB).all()   # nothing else written
    del src, dst, src_all, dst_all
    m1.close()
    m2.close()


def test_the_word_loop_is_taken_only_in_the_slow_case(monkeypatch):
    monkeypatch.setattr(host_copy, "_words", True)
    calls = []
    real = np.positive
    monkeypatch.setattr(host_copy.np, "positive", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    base = 1 << 20
    src, dst = np.ones(64 << 10, np.uint8), np.zeros(64 << 10, np.uint8)
    host_copy.copy(dst, src, base + 16, base)           # 16 bytes past: the slow case
    host_copy.copy(dst, src, base + host_copy.ALIAS_WINDOW, base)   # past the window
    host_copy.copy(dst[:4096], src[:4096], base + 16, base)   # too short to matter
    host_copy.copy(dst[:(16 << 10) + 1], src[:(16 << 10) + 1], base + 16, base)   # not whole words
    assert len(calls) == 1 and np.array_equal(dst, src)


def test_copy_spans_matches_slices_and_refuses_a_span_outside(mode):
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    spans = [(0, 4096 * 3, 32 << 10), (40 << 10, 16, 20000), (200 << 10, 500 << 10, 64 << 10)]
    host_copy.copy_spans(dst, [d for d, _, _ in spans], src, [s for _, s, _ in spans], [n for _, _, n in spans])
    want = np.zeros_like(dst)
    for d, s, n in spans:
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)
    with pytest.raises(ValueError):
        host_copy.copy_spans(dst, [dst.size - 10], src, [0], [20])
    with pytest.raises(ValueError):
        host_copy.copy(dst[:10], src[:11])


def test_spans_back_to_back_in_both_arrays_are_one_copy_and_the_same_bytes(mode, monkeypatch):
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    # three blocks back to back in both; one continuing in dst only; one in src only; an empty one
    spans = [(0, 4096, 32 << 10), (32 << 10, 4096 + (32 << 10), 32 << 10), (64 << 10, 4096 + (64 << 10), 32 << 10),
             (96 << 10, 300 << 10, 8192), (200 << 10, (300 << 10) + 8192, 8192), (208 << 10, 0, 0)]
    assert host_copy._runs(*zip(*[(d, s, n) for d, s, n in spans])) == [
        (0, 4096, 96 << 10), (96 << 10, 300 << 10, 8192), (200 << 10, (300 << 10) + 8192, 8192), (208 << 10, 0, 0)]
    calls = []
    real = host_copy.np.copyto
    monkeypatch.setattr(host_copy.np, "copyto", lambda *a, **k: (calls.append(a[0].size), real(*a, **k))[1])
    host_copy.copy_spans(dst, [d for d, _, _ in spans], src, [s for _, s, _ in spans], [n for _, _, n in spans])
    want = np.zeros_like(dst)
    for d, s, n in spans:
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)
    if mode == "memcpy":
        assert calls == [96 << 10, 8192, 8192, 0]
    # many spans (compared in numpy): the same runs as the loop, on back-to-back blocks with breaks
    rng = np.random.default_rng(5)
    for _ in range(200):
        k = int(rng.integers(16, 60))
        n = rng.choice([0, 8, 4096], size=k).tolist()
        d = np.concatenate(([0], np.cumsum(n)[:-1] + rng.choice([0, 0, 0, 8], size=k - 1))).tolist()
        s = np.concatenate(([64], np.cumsum(n)[:-1] + 64 + rng.choice([0, 0, 0, 16], size=k - 1))).tolist()
        want, d_end, s_end = [], -1, -1
        for dd, ss, nn in zip(d, s, n):
            if dd == d_end and ss == s_end and nn > 0 and want and want[-1][2] > 0:
                want[-1] = (want[-1][0], want[-1][1], want[-1][2] + nn)
            else:
                want.append((dd, ss, nn))
            d_end, s_end = dd + nn, ss + nn
        assert host_copy._runs(d, s, n) == want
    big = 1 << 62                                       # two back-to-back spans whose int64 sum would wrap
    far = [0, big] + [4096 * (2 * i + 2) for i in range(14)]
    with pytest.raises(ValueError):                     # refused, never a negative no-op copy
        host_copy.copy_spans(dst, far, src, far, [big, big] + [1] * 14)
    with pytest.raises(ValueError):                     # a negative size
        host_copy.copy_spans(dst, [0] * 16, src, [0] * 16, [8] * 15 + [-8])
    with pytest.raises(ValueError):                     # a merged run is checked as a whole
        host_copy.copy_spans(dst, [dst.size - 20, dst.size - 10], src, [0, 10], [10, 20])


def test_copy_slots_matches_slices_copies_each_run_once_and_refuses_a_block_outside(mode, monkeypatch):
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    stride = 8192
    # blocks 0-2 back to back, then a jump, then 4-5 back to back, then one earlier in src
    offsets = [4096, 4096 + stride, 4096 + 2 * stride, 300 << 10, (300 << 10) + stride, 0]
    calls = []
    real = host_copy.copy
    monkeypatch.setattr(host_copy, "copy", lambda d, s, *a: (calls.append(d.size), real(d, s, *a))[1])
    for given in (offsets, np.array(offsets, dtype=np.int64)):
        calls.clear()
        dst = np.full(len(offsets) * stride + 100, 0xAB, np.uint8)
        host_copy.copy_slots(dst, src, given, stride)
        want = np.full_like(dst, 0xAB)
        for j, off in enumerate(offsets):
            want[j * stride:(j + 1) * stride] = src[off:off + stride]
        assert np.array_equal(dst, want)                    # the tail past the slots untouched
        assert calls == [3 * stride, 2 * stride, stride]
    host_copy.copy_slots(dst, src, [], stride)              # nothing to copy
    for bad in ([src.size - stride + 1], [-8], [1 << 63]):  # past the end, negative, not an int64
        with pytest.raises(ValueError):
            host_copy.copy_slots(dst, src, bad, stride)
    with pytest.raises(ValueError):                         # more slots than the destination holds
        host_copy.copy_slots(dst[:stride], src, [0, stride], stride)


@pytest.mark.parametrize("env,want", [("memcpy", False), ("words", True), ("WORDS", True)])
def test_the_mode_can_be_forced(monkeypatch, env, want):
    monkeypatch.setattr(host_copy, "_words", None)
    monkeypatch.setenv("KVSTORE_HOST_COPY", env)
    assert host_copy.words_enabled() is want


def test_auto_follows_the_measurement(monkeypatch):
    monkeypatch.delenv("KVSTORE_HOST_COPY", raising=False)
    for (near, far), want in (((4.0, 1.0), True), ((1.1, 1.0), False)):
        monkeypatch.setattr(host_copy, "_words", None)
        monkeypatch.setattr(host_copy, "probe", lambda near=near, far=far: (near, far))
        assert host_copy.words_enabled() is want


def test_the_probe_measures_both_cases():
    near, far = host_copy.probe(size=16 << 10, pieces=8, reps=1)
    assert near > 0 and far > 0


def _gathered(dst, dst_offsets, src, src_offsets, ranges):
    want = dst.copy()
    for d, s in zip(dst_offsets, src_offsets):
        pos = d
        for off, m in ranges:
            want[pos:pos + m] = src[s + off:s + off + m]
            pos += m
    return want


def test_gather_ranges_matches_the_loop_on_runs_breaks_and_reversed_blocks(mode):
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    ranges = [(0, 512), (4096, 512), (1024, 256), (8000, 0), (6000, 100)]     # out of order, an empty one
    want_bytes = sum(m for _, m in ranges)
    block = 8192
    cases = [
        (list(range(0, 40 * block, block)), [j * want_bytes for j in range(40)]),                 # one run
        (list(range(39 * block, -1, -block)), [j * 2000 for j in range(40)]),                       # src descending
        ([3 * block, 4 * block, 9 * block, 10 * block, 11 * block, 0],                               # breaks in src
         [0, want_bytes, 2 * want_bytes, 5 * want_bytes, 6 * want_bytes, 3 * want_bytes]),          # and in dst
        ([5 * block], [100]),                                                                        # one block
        ([0, block, 2 * block], [0, 600, 1200]),         # slots closer than a slot's bytes: block by block, in order
    ]
    for src_offsets, dst_offsets in cases:
        dst = rng.integers(0, 256, 100_000, dtype=np.uint8)
        expect = _gathered(dst, dst_offsets, src, src_offsets, ranges)
        host_copy.gather_ranges(dst, dst_offsets, src, np.array(src_offsets), ranges)
        assert np.array_equal(dst, expect), (src_offsets, dst_offsets)


def test_gather_ranges_copies_a_run_with_one_call_per_range_and_refuses_bytes_outside(monkeypatch):
    monkeypatch.setattr(host_copy, "_words", False)
    src = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    calls = []
    real = host_copy.np.copyto
    monkeypatch.setattr(host_copy.np, "copyto", lambda d, s, *a, **k: (calls.append(d.shape), real(d, s, *a, **k))[1])
    host_copy.gather_ranges(dst, [j * 64 for j in range(16)], src, [j * 1024 for j in range(16)], [(0, 32), (512, 32)])
    assert calls == [(16, 32), (16, 32)]
    calls.clear()
    before = dst.copy()
    for d, s, r in [([0], [src.size - 16], [(0, 32)]),        # past the source
                    ([dst.size - 8], [0], [(0, 16)]),         # past the destination
                    ([0], [0], [(-8, 16)]),                   # a negative range
                    ([0, 64], [0], [(0, 16)]),                # lists of unequal lengths
                    ([1 << 63], [0], [(0, 16)])]:             # not an int64
        with pytest.raises(ValueError):
            host_copy.gather_ranges(dst, d, src, s, r)
    assert calls == [] and np.array_equal(dst, before)        # nothing copied
