"""NVMe block file format and ranged reads: the header, per-chunk checksums, reading only
the chunks a range needs, every byte served verified, buffers of any alignment."""

from __future__ import annotations

import mmap
import struct

import pytest

from nvme_support import K, file_of, payload, put, read
from tiers.errors import BlockCorrupt
from tiers.nvme.format import (
    MAGIC,
    PAGE,
    HeaderError,
    IndexEntry,
    chunk_sums,
    decode_header,
    encode_header,
    file_bytes,
    header_bytes,
    read_header,
)
from tiers.nvme.read import HeaderCache, plan_spans

C = 16 << 10


def test_header_geometry():
    assert header_bytes(0, C) == PAGE and file_bytes(0, C) == PAGE
    assert header_bytes(501 * C, C) == PAGE                  # 88 + 8 * 501 = 4096
    assert header_bytes(501 * C + 1, C) == 2 * PAGE
    assert file_bytes(100_003, C) == PAGE + 102_400
    assert file_bytes(4 << 20, 4096) == 3 * PAGE + (4 << 20)  # 1,024 checksums: 8,280 header bytes
    e = IndexEntry(100_003, C, 1.5)
    assert (e.header_bytes, e.file_bytes) == (PAGE, PAGE + 102_400)
    assert IndexEntry.unpack(e.pack()) == e


def test_header_round_trip_and_every_check():
    data = memoryview(payload(K(1), 70_000))
    sums = chunk_sums(data, C)
    assert len(sums) == 5
    buf = bytearray(PAGE)
    assert encode_header(memoryview(buf), K(1), 70_000, C, 123.25, sums) == PAGE
    assert buf[:8] == MAGIC
    h = decode_header(memoryview(buf), K(1))
    assert (h.key, h.size, h.chunk_bytes, h.written_at, list(h.sums), h.header_bytes) == \
        (K(1), 70_000, C, 123.25, sums, PAGE)
    with pytest.raises(HeaderError, match="names block"):
        decode_header(memoryview(buf), K(2))
    for offset, match in ((0, "magic"), (8, "version"), (12, "header length"), (90, "checksum"),
                          (48, "geometry|checksum")):
        bad = bytearray(buf)
        bad[offset] ^= 0x01
        with pytest.raises(HeaderError, match=match):
            decode_header(memoryview(bad), K(1))
    with pytest.raises(HeaderError, match="truncated"):
        decode_header(memoryview(buf)[:100], K(1))
    with pytest.raises(ValueError):
        encode_header(memoryview(buf), K(1), 70_000, C, 1.0, sums[:-1])


def test_plan_spans_merges_touching_chunks_only():
    spans = plan_spans(10 * C, C, [(5 * C + 10, 20), (0, 1), (C - 1, 2), (9 * C, C)])
    assert [(s.c0, s.c1, s.start, s.end) for s in spans] == [(0, 2, 0, 2 * C), (5, 6, 5 * C, 6 * C), (9, 10, 9 * C, 10 * C)]
    assert [p[2] for p in spans[0].pieces] == [20, 21]        # positions in out follow the request order
    whole = plan_spans(10 * C + 5, C, None)
    assert [(s.c0, s.c1, s.end) for s in whole] == [(0, 11, 10 * C + 5)]


def test_file_holds_the_header_then_the_payload(open_nvme):
    t = open_nvme()
    data = payload(K(1), 3 * C + 5)
    put(t, K(1), data, chunk=1000)                            # streamed in odd pieces
    raw = file_of(t, K(1)).read_bytes()
    h = decode_header(memoryview(raw), K(1))
    assert list(h.sums) == chunk_sums(memoryview(data), C)   # checksums over the payload's chunks
    assert raw[PAGE:PAGE + len(data)] == data and len(raw) == file_bytes(len(data), C)
    assert read_header(str(file_of(t, K(1))), K(1)) == h


@pytest.mark.parametrize("cached", [True, False])
def test_a_ranged_read_reads_only_its_chunks(open_nvme, io_mode, cached):
    t = open_nvme(header_cache_bytes=1 << 20 if cached else 0)
    size = 64 * C + 611                                       # a short last chunk
    data = payload(K(1), size)
    put(t, K(1), data)
    header = 0 if cached else PAGE
    cases = [([(3 * C + 100, 50)], C),                        # inside chunk 3
             ([(3 * C - 10, 20)], 2 * C),                     # across chunks 2 and 3
             ([(0, C)], C),                                   # exactly chunk 0
             ([(64 * C, 611)], PAGE if io_mode == "direct" else 611),      # the short last chunk
             ([(C, 10), (5 * C, 10), (9 * C, 10)], 3 * C)]    # three separate chunks
    for ranges, chunks in cases:
        before = t.read_counters()
        assert read(t, K(1), ranges) == b"".join(data[o:o + n] for o, n in ranges)
        after = t.read_counters()
        assert after.bytes_read - before.bytes_read == header + chunks, ranges
        assert after.bytes_served - before.bytes_served == sum(n for _, n in ranges)
    before = t.read_counters()
    assert read(t, K(1)) == data
    assert t.read_counters().bytes_read - before.bytes_read == header + file_bytes(size, C) - PAGE - \
        (0 if io_mode == "direct" else (-size) % PAGE)


def test_every_byte_served_was_verified(open_nvme):
    t = open_nvme(header_cache_bytes=0)
    data = payload(K(1), 10 * C)
    put(t, K(1), data)
    with open(file_of(t, K(1)), "r+b") as f:                  # one altered byte in chunk 5
        f.seek(PAGE + 5 * C + 777)
        f.write(bytes([data[5 * C + 777] ^ 0x40]))
    assert read(t, K(1), [(0, 5 * C), (6 * C, 4 * C)]) == data[:5 * C] + data[6 * C:]
    for ranges in ([(5 * C, 1)], [(6 * C - 1, 1)], [(4 * C, C + 1)], None):
        with pytest.raises(BlockCorrupt, match="checksum in chunk 5"):
            read(t, K(1), ranges)


def _aligned(n: int, shift: int = 0) -> memoryview:
    return memoryview(mmap.mmap(-1, n + PAGE))[shift:shift + n]


@pytest.mark.parametrize("shift", [0, 1, 512], ids=["page-aligned", "odd", "512"])
def test_reads_into_buffers_of_any_alignment(open_nvme, shift):
    t = open_nvme()
    size = 5 * C + 123
    data = payload(K(1), size)
    put(t, K(1), data)
    out = _aligned(size, shift)
    assert t.read_into(K(1), out) == size and bytes(out) == data
    tiles = [(0, C), (C, 2 * C), (3 * C, size - 3 * C)]      # ranges that tile the block in order
    out = _aligned(size, shift)
    assert t.read_into(K(1), out, tiles) == size and bytes(out) == data
    mixed = [(3 * C + 5, 100), (0, 10), (3 * C + 50, 100), (size - 1, 1), (C, 0)]   # overlapping, unordered
    out = _aligned(211, shift)
    assert t.read_into(K(1), out, mixed) == 211
    assert bytes(out) == b"".join(data[o:o + n] for o, n in mixed)


def test_tp_rank_ranges_in_parallel_match_one_by_one(open_nvme):
    size = 1 << 20
    ranges = [((layer * 2 + kv) * (size // 64), size // 512) for layer in range(32) for kv in range(2)]
    data = payload(K(1), size)
    one = open_nvme(read_threads=1)
    put(one, K(1), data)
    expect = b"".join(data[o:o + n] for o, n in ranges)
    assert read(one, K(1), ranges) == expect
    one.close()
    many = open_nvme(read_threads=4)
    assert read(many, K(1), ranges) == expect
    counts = many.read_counters()
    assert counts.bytes_served == size // 8 and counts.bytes_read == PAGE + 64 * C   # header + one chunk per range


def test_blocks_of_other_chunk_sizes_stay_readable(open_nvme):
    t = open_nvme(chunk_bytes=4096)
    put(t, K(1), payload(K(1), 50_000))
    t.close()
    t2 = open_nvme(chunk_bytes=64 << 10)
    put(t2, K(2), payload(K(2), 200_000))
    assert read(t2, K(1), [(40_000, 100)]) == payload(K(1), 50_000)[40_000:40_100]
    assert read(t2, K(2)) == payload(K(2), 200_000)
    assert struct.unpack_from("<I", file_of(t2, K(1)).read_bytes(), 56)[0] == 4096
    assert struct.unpack_from("<I", file_of(t2, K(2)).read_bytes(), 56)[0] == 64 << 10


def test_header_cache_is_bounded_and_drops_freed_blocks():
    cache = HeaderCache(1000)
    cache.put(K(1), 10, C, (1,))
    assert cache.get(K(1), 10, C) == (1,) and cache.get(K(1), 11, C) is None
    cache.put(K(2), 10, C, tuple(range(20)))                 # 960 bytes: K(1) goes
    assert cache.get(K(1), 10, C) is None and cache.get(K(2), 10, C) is not None
    cache.drop(K(2))
    assert cache.get(K(2), 10, C) is None
    cache.put(K(3), 10, C, tuple(range(100)))                # larger than the cache: not kept
    assert cache.get(K(3), 10, C) is None


def test_streamed_writes_from_aligned_and_unaligned_memory(open_nvme):
    """Page-aligned pieces go straight to the file, others through the staging buffer."""
    t = open_nvme()
    size = 3 * (1 << 20) + 5000
    data = payload(K(1), size)
    src = _aligned(size)
    src[:] = data
    t.reserve(K(1), size)
    cuts = [0, 1 << 20, (1 << 20) + 100, 2 << 20, (2 << 20) + PAGE, size]   # aligned, odd, aligned after a tail
    for a, b in zip(cuts, cuts[1:]):
        t.write(K(1), a, src[a:b])
    t.commit(K(1))
    assert read(t, K(1)) == data
    assert list(read_header(str(file_of(t, K(1))), K(1)).sums) == chunk_sums(memoryview(data), C)
