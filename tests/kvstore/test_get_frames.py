"""GetRaw frames read in place: every byte of every requested block comes back once, in
order, in frames under the limit, whatever the chunking, the ranges and the failures;
on both ways a frame is built (by the sending thread for memory tiers, read ahead on the
reader pool for the others: ``kind`` HOST and NVME)."""

from __future__ import annotations

import threading

import pytest
from support.fake_tiers import MemTier

from kvstore.common import wire
from kvstore.common.wire import FAILED, FOUND, HEADER, RECORD, OutFrame, decode, encode
from kvstore.policy import make_policy
from kvstore.service.get_frames import raw_frames
from kvstore.service.get_stream import GetPlan
from kvstore.store.manager import TierManager
from tiers.base import TierKind
from tiers.errors import MediaIOError


def K(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(i: int, n: int) -> bytes:
    return bytes((i * 7 + j * 13) % 256 for j in range(n))


class FailingPieces(MemTier):
    """A MemTier whose reads of ``bad`` fail (medium error: the copy is kept) once the
    piece starts at or after ``from_offset`` of the block."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bad: bytes | None = None
        self.from_offset = 0

    def read_into(self, key, out, ranges=None):
        if key == self.bad and ranges and ranges[0][0] >= self.from_offset:
            raise MediaIOError(f"{self.name}: injected read failure")
        return super().read_into(key, out, ranges)


KINDS = pytest.mark.parametrize("kind", [TierKind.HOST, TierKind.NVME])


def store(sizes, tier_cls=MemTier, kind=TierKind.NVME):
    tier = tier_cls(kind, 64 << 20)
    m = TierManager([tier], [make_policy("lru", 64 << 20)])
    for i, n in enumerate(sizes):
        if n is not None:
            m.put(K(i), payload(i, n))
    return m, tier


def records(m, keys, step, limit, ranges=None, stop_at_miss=False):
    frames = list(raw_frames(GetPlan(m, keys, lambda k: k, ranges, stop_at_miss, step, limit)))
    assert all(len(f) <= limit for f in frames)
    return frames, [r for f in frames for r in decode(f)]


def selected(data: bytes, ranges) -> bytes:
    return b"".join(data[o:o + n] for o, n in ranges) if ranges else data


def assemble(recs):
    """key -> (bytes, tier codes) from records at increasing offsets (asserts the order)."""
    out: dict[bytes, tuple[bytearray, set]] = {}
    for r in recs:
        if not r.found:
            continue
        buf, tiers = out.setdefault(r.key, (bytearray(), set()))
        assert r.offset == len(buf)
        buf += bytes(r.data)
        tiers.add(r.tier)
    return {k: (bytes(b), t) for k, (b, t) in out.items()}


@KINDS
@pytest.mark.parametrize("ranges", [None, [(100, 5000), (9000, 3000), (12_000, 4_100)]])
def test_a_block_larger_than_a_message_comes_back_whole_across_frames(ranges, kind):
    """A 16,100-byte block in 4 KiB pieces (the last one shorter), and ranges that cross
    piece boundaries: every byte once, in order, one piece per frame of at most the limit."""
    m, _ = store([16_100, 10, 16_100], kind=kind)
    keys = [K(0), K(1), K(2)]
    step = 4096
    frames, recs = records(m, keys, step, step + 4096, ranges)
    got = assemble(recs)
    for i in (0, 2):
        want = selected(payload(i, 16_100), ranges)
        assert got[K(i)] == (want, {int(kind)})
        mine = [r for r in recs if r.key == K(i)]
        assert [len(r.data) for r in mine] == [min(step, len(want) - o) for o in range(0, len(want), step)]
        assert all(r.total == len(want) for r in mine)
    if ranges is None:
        assert got[K(1)][0] == payload(1, 10)
    else:                                  # too short for the ranges: a miss, not an error
        assert [r.found for r in recs if r.key == K(1)] == [False]
    assert [r.key for r in recs if r.offset == 0] == keys          # key order


@KINDS
def test_small_blocks_and_misses_share_frames_under_the_limit(kind):
    """600 blocks of 1-300 bytes with every third key missing: one record each, in key
    order, packed into frames that never exceed the limit (misses' records counted)."""
    sizes = [None if i % 3 == 2 else 1 + (i * 37) % 300 for i in range(600)]
    m, _ = store(sizes, kind=kind)
    keys = [K(i) for i in range(600)]
    limit = 8192
    frames, recs = records(m, keys, 4096, limit)
    assert len(frames) > 1
    assert [r.key for r in recs] == keys
    assert [r.found for r in recs] == [n is not None for n in sizes]
    assert all(bytes(r.data) == payload(i, sizes[i]) for i, r in enumerate(recs) if r.found)
    assert all(len(f) > limit - RECORD.size - 300 for f in frames[:-1])    # full frames, but for the last


@KINDS
def test_stop_at_miss_ends_the_get_at_the_first_miss(kind):
    m, tier = store([5000, None, 100], kind=kind)
    frames, recs = records(m, [K(0), K(1), K(2)], 1024, 4096, stop_at_miss=True)
    assert [(r.key, r.found) for r in recs if r.offset == 0] == [(K(0), True), (K(1), False)]
    assert assemble(recs)[K(0)][0] == payload(0, 5000)
    assert m.catalogue.get(K(0)).pins == 0 and m.catalogue.get(K(2)).pins == 0


@KINDS
@pytest.mark.parametrize("stop_at_miss", [False, True])
def test_a_block_failing_mid_way_gets_one_failed_record_and_nothing_after(stop_at_miss, kind):
    """Block 1 (10,000 bytes, 1 KiB pieces) fails from its fourth piece: its first three
    pieces, one FAILED record at offset 3072 and none of its later pieces; the blocks after
    it are served whole (or, with stop_at_miss, the Get ends there). Every pin is released."""
    m, tier = store([3000, 10_000, 2500], FailingPieces, kind)
    tier.bad, tier.from_offset = K(1), 3072
    frames, recs = records(m, [K(0), K(1), K(2)], 1024, 3 * 1024 + 512, stop_at_miss=stop_at_miss)
    mine = [r for r in recs if r.key == K(1)]
    assert [(r.offset, r.flags) for r in mine] == [(0, FOUND), (1024, FOUND), (2048, FOUND), (3072, FAILED)]
    assert all(len(r.data) == 0 for r in mine if r.failed)
    got = assemble(recs)
    assert got[K(0)][0] == payload(0, 3000)
    if stop_at_miss:
        assert K(2) not in got and recs[-1].failed
    else:
        assert got[K(2)][0] == payload(2, 2500)
    assert all(m.catalogue.get(K(i)).pins == 0 for i in range(3))
    assert m.catalogue.get(K(1)) is not None                  # a medium error keeps the copy


@KINDS
def test_a_get_closed_early_releases_every_pin(kind):
    """A client that goes away after the first frame: the frames planned (and, from NVMe,
    read) ahead are waited for and every block opened for them is unpinned (the next
    block's reader included)."""
    m, tier = store([4096] * 40, kind=kind)
    keys = [K(i) for i in range(40)]
    gen = raw_frames(GetPlan(m, keys, lambda k: k, None, False, 4096, 4096 + 1024))
    first = next(gen)
    assert decode(first)[0].key == K(0)
    assert any(m.catalogue.get(k).pins for k in keys[1:])             # frames built ahead hold pins
    gen.close()
    assert all(m.catalogue.get(k).pins == 0 for k in keys)


class GatedKey(MemTier):
    """A MemTier whose reads of ``slow`` wait for ``gate`` (a medium stuck on one block)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.slow: bytes | None = None
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def read_into(self, key, out, ranges=None):
        if key == self.slow:
            self.waiting.set()
            self.gate.wait(60)
        return super().read_into(key, out, ranges)


def test_a_get_closed_while_a_read_is_stuck_waits_for_it_then_unpins():
    """A read ahead (NVMe) is stuck on its medium when the Get ends: closing waits for
    that read (its frame's memory is still being written), then releases every pin."""
    m, tier = store([2048] * 8, GatedKey)
    keys = [K(i) for i in range(8)]
    tier.slow = K(3)
    gen = raw_frames(GetPlan(m, keys, lambda k: k, None, False, 2048, 4096))
    assert decode(next(gen))[0].key == K(0)
    assert tier.waiting.wait(60)
    closer = threading.Thread(target=gen.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                               # waiting on the stuck read
    assert m.catalogue.get(K(3)).pins == 1
    tier.gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert all(m.catalogue.get(k).pins == 0 for k in keys)


@pytest.mark.parametrize("nbytes", [HEADER.size + RECORD.size, wire.IN_PLACE_MIN - 1, wire.IN_PLACE_MIN, 3 << 20])
def test_an_out_frame_is_the_frame_encode_makes(nbytes):
    """In place (CPython, large frames) or copied once (small frames), an OutFrame holds
    exactly the bytes of the same frame built by encode, and finishes as bytes."""
    n = nbytes - HEADER.size - RECORD.size
    data = payload(5, n)
    f = OutFrame(nbytes)
    pos = f.write_records([(K(3), FOUND, 2, n + 10, 10, n)])
    f.array[pos:] = memoryview(data)
    got = f.finish()
    assert type(got) is bytes and f.array is None
    assert got == encode([(K(3), FOUND, 2, n + 10, 10, data)])


def test_blocks_on_host_and_on_nvme_in_one_get_come_back_in_order():
    """A Get mixing blocks in host memory (frames built when due) and on NVMe (frames read
    ahead), 3000 bytes each in frames of two blocks: every block whole, in key order,
    with the tier it was read from."""
    host, nvme = MemTier(TierKind.HOST, 8192), MemTier(TierKind.NVME, 1 << 20)
    m = TierManager([host, nvme], [make_policy("lru", 8192), make_policy("lru", 1 << 20)])
    keys = [K(i) for i in range(10)]
    for i, k in enumerate(keys):
        m.put(k, payload(i, 3000))
    on_host = {k for k in keys if m.catalogue.get(k).tiers[0] == 0}
    assert on_host and len(on_host) < len(keys)               # demoted ones are on NVMe only
    frames, recs = records(m, keys[::-1], 4096, 2 * (3000 + RECORD.size) + HEADER.size)
    assert [r.key for r in recs] == keys[::-1]
    for i, k in enumerate(keys):
        kind = TierKind.HOST if k in on_host else TierKind.NVME
        assert assemble(recs)[k] == (payload(i, 3000), {int(kind)})
    assert all(m.catalogue.get(k).pins == 0 for k in keys)
