"""The Mooncake remote tier against a real master on loopback: the tier protocol, batch
calls, two nodes sharing blocks, and corrupted remote copies."""

import numpy as np
import pytest

from tiers.base import RemoteStore, TierKind, read_bytes
from tiers.errors import BlockCorrupt, BlockExists, BlockNotStored, InvalidAccess, NoRoom
from tiers.mooncake.object_format import HEADER_BYTES, encode_into, object_bytes


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i, n):
    """``n`` bytes that differ between blocks ``i`` and between positions."""
    return ((np.arange(n, dtype=np.int64) * 7 + 13 * i) % 251).astype(np.uint8).tobytes()


def put(tier, key, data, chunk=300_000):
    tier.reserve(key, len(data))
    for off in range(0, len(data), chunk):
        tier.write(key, off, data[off:off + chunk])
    tier.commit(key)


def test_round_trip_is_byte_exact(make_tier):
    tier = make_tier()
    assert tier.kind is TierKind.REMOTE and not tier.volatile
    assert isinstance(tier.capabilities.remote, RemoteStore) and tier.capabilities.remote is tier
    blocks = {K(i): payload(i, n) for i, n in enumerate([1 << 20, 4 << 20, 1, 0, 12345])}
    for key, data in blocks.items():
        put(tier, key, data)
    for key, data in blocks.items():
        assert key in tier and tier.size_of(key) == len(data)
        out = bytearray(len(data) + 10)
        assert tier.read_into(key, out) == len(data)
        assert bytes(out[:len(data)]) == data
    assert len(tier) == 5
    assert tier.used_bytes == sum(object_bytes(len(d)) for d in blocks.values())


def test_ranged_reads(make_tier):
    tier = make_tier()
    data = payload(3, 1 << 20)
    put(tier, K(3), data)
    ranges = [(0, 10), (4096, 8192), ((1 << 20) - 5, 5), (77, 0)]
    assert read_bytes(tier, K(3), ranges) == b"".join(data[o:o + n] for o, n in ranges)
    with pytest.raises(InvalidAccess):
        tier.read_into(K(3), bytearray(10), [(1 << 20, 1)])
    with pytest.raises(InvalidAccess):
        tier.read_into(K(3), bytearray(10))                   # out smaller than the block


def test_two_phase_protocol_errors(make_tier):
    tier = make_tier(capacity_bytes=3 << 20, segment_bytes=16 << 20)
    tier.reserve(K(1), 100)
    with pytest.raises(BlockExists):
        tier.reserve(K(1), 100)
    with pytest.raises(InvalidAccess):
        tier.write(K(1), 5, b"x")                             # out of order
    tier.write(K(1), 0, b"x" * 50)
    with pytest.raises(InvalidAccess):
        tier.commit(K(1))                                     # 50 of 100 bytes
    tier.abort(K(1))
    assert K(1) not in tier and tier.used_bytes == 0
    with pytest.raises(BlockNotStored):
        tier.write(K(1), 0, b"x")
    with pytest.raises(NoRoom):
        tier.reserve(K(2), 3 << 20)                           # the header does not fit either
    with pytest.raises(InvalidAccess):
        tier.reserve(b"short", 10)
    put(tier, K(2), b"y" * 100)
    with pytest.raises(BlockExists):
        tier.reserve(K(2), 100)
    tier.free(K(2))                                           # forgotten at once, removed in the background
    assert K(2) not in tier and tier.used_bytes == 0
    assert tier.flush(30)
    assert tier.exists_many([K(2)]) == [False]
    tier.free(K(2))                                           # freeing an absent block is a no-op
    with pytest.raises(BlockNotStored):
        tier.read_into(K(2), bytearray(100))


def test_exists_get_and_put_in_batches(make_tier):
    tier = make_tier(staging_bytes=9 << 20)                  # two 4 MiB blocks per library call
    items = [(K(i), payload(i, 4 << 20)) for i in range(5)]
    assert tier.put_many(items + [items[0]]) == [True] * 6   # a repeated key is stored once
    assert tier.put_many(items[:2]) == [True, True]          # already there
    assert tier.used_bytes == 5 * object_bytes(4 << 20)
    keys = [K(i) for i in range(7)]
    assert tier.exists_many(keys) == [True] * 5 + [False] * 2
    assert tier.exists_many([]) == []
    outs = [np.zeros(4 << 20, np.uint8) for _ in keys]
    got = tier.get_many_into(keys, outs)
    assert got == [4 << 20] * 5 + [None, None]
    for i in range(5):
        assert outs[i].tobytes() == items[i][1]
    with pytest.raises(InvalidAccess):
        tier.get_many_into(keys, outs[:2])
    with pytest.raises(NoRoom):
        tier.put_many([(K(99), bytes(64 << 20))])            # larger than the staging buffer


def test_two_nodes_see_each_others_blocks(make_tier):
    a, b = make_tier(), make_tier()
    data = payload(7, 1 << 20)
    put(a, K(7), data)
    assert K(7) not in b                                      # b did not put it ...
    assert b.exists_many([K(7)]) == [True]                    # ... but the cluster has it
    assert b.size_of(K(7)) == len(data)
    assert read_bytes(b, K(7)) == data
    out = bytearray(len(data))
    assert b.get_many_into([K(7)], [out]) == [len(data)] and bytes(out) == data
    assert b.put_many([(K(8), payload(8, 1000))]) == [True]
    assert read_bytes(a, K(8)) == payload(8, 1000)
    b.free(K(7))                                              # any node may drop a block
    assert b.flush(30)
    assert a.exists_many([K(7)]) == [False]
    assert K(7) not in a                                      # a forgot what the cluster lost
    assert a.used_bytes == 0


def _overwrite(raw, tier, key, obj: bytes):
    name = tier.object_name(key)
    raw.remove(name, True)
    assert raw.put(name, obj) == 0


def _object(key, data):
    buf = bytearray(object_bytes(len(data)))
    encode_into(memoryview(buf), key, memoryview(data))
    return bytes(buf)


@pytest.mark.parametrize("damage", ["flipped", "other_key", "truncated", "longer", "foreign"])
def test_corrupted_remote_copy_is_never_served(make_tier, raw_store, damage):
    a, b = make_tier(), make_tier()
    data = payload(5, 1 << 20)
    put(a, K(5), data)
    good = _object(K(5), data)
    bad = {"flipped": good[:HEADER_BYTES + 999] + bytes([good[HEADER_BYTES + 999] ^ 1]) + good[HEADER_BYTES + 1000:],
           "other_key": _object(K(6), data),
           "truncated": good[:-4096],
           "longer": good + b"\0" * 4096,
           "foreign": data}[damage]
    _overwrite(raw_store, a, K(5), bad)
    for tier in (a, b):                                       # the writer (knows the size) and a peer
        with pytest.raises(BlockCorrupt):
            tier.read_into(K(5), bytearray(len(data) + 8192))
    assert a.health.corrupt_blocks == 1 and b.health.corrupt_blocks == 1
    out = bytearray(len(data))
    if damage == "longer":           # b cannot tell a longer copy from a block larger than its out
        assert b.get_many_into([K(5)], [out]) == [None] and b.health.oversize_reads == 1
    assert a.get_many_into([K(5)], [out]) == [None]           # a miss in a batch ...
    assert a.health.corrupt_blocks == 2
    assert b.exists_many([K(5)]) == [False]                   # ... and the bad copy is gone
    assert K(5) not in a
