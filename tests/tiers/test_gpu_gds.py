"""GPUDirect Storage on a GPU (kvikio): the helpers of tiers.gds, and the NVMe tier's device
path in the block file format of the POSIX path (tiers.nvme.format). The same tier code
runs on CPU, with a host-memory backend, in test_nvme_device.py."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from tiers.base import read_bytes
from tiers.errors import BlockCorrupt
from tiers.gds import gds_available, gds_info, padded_size, read_block_file, write_block_file
from tiers.nvme.format import block_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gds_available(), reason=gds_info().reason or "no kvikio")]


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def to_device(data: bytes):
    import cupy
    return cupy.asarray(np.frombuffer(data, dtype=np.uint8))


def test_gds_write_gives_the_posix_format(tmp_path):
    data = payload(1, 10_000)
    p = tmp_path / "blk"
    assert write_block_file(p, to_device(data)) == 12_288
    raw = p.read_bytes()
    assert len(raw) == 12_288 and raw[:10_000] == data and raw[10_000:] == bytes(2_288)
    q = tmp_path / "blk2"
    assert write_block_file(q, to_device(data), 5_000, pad=False, fsync=True) == 5_000
    assert q.read_bytes() == data[:5_000]
    r = tmp_path / "blk3"                                 # after a header page, into an existing file
    r.write_bytes(b"h" * 4096)
    assert write_block_file(r, to_device(data), file_offset=4096, truncate=False) == 4096 + 12_288
    raw = r.read_bytes()
    assert raw[:4096] == b"h" * 4096 and raw[4096:14_096] == data and raw[14_096:] == bytes(2_288)


@pytest.mark.parametrize("padded", [True, False])
def test_posix_written_file_read_by_gds(tmp_path, padded):
    import cupy
    data = payload(2, 65_537)
    p = tmp_path / "blk"
    p.write_bytes(data + (bytes(padded_size(len(data)) - len(data)) if padded else b""))
    buf = cupy.full(70_000, 0xAB, dtype=cupy.uint8)
    read_block_file(p, buf, len(data))
    host = cupy.asnumpy(buf).tobytes()
    assert host[:len(data)] == data and host[len(data):] == b"\xab" * (70_000 - len(data))


def test_short_file_is_corrupt_and_missing_file_raises(tmp_path):
    import cupy
    p = tmp_path / "blk"
    p.write_bytes(b"x" * 100)
    with pytest.raises(BlockCorrupt, match="truncated"):
        read_block_file(p, cupy.empty(200, dtype=cupy.uint8), 200)
    with pytest.raises(BlockCorrupt, match="truncated"):
        read_block_file(p, cupy.empty(100, dtype=cupy.uint8), 100, file_offset=4096)
    with pytest.raises(FileNotFoundError):
        read_block_file(tmp_path / "none", cupy.empty(10, dtype=cupy.uint8), 10)
    with pytest.raises(ValueError):
        read_block_file(p, cupy.empty(10, dtype=cupy.uint8), 50)


def test_hbm_block_to_file_and_back_without_a_host_copy(tmp_path):
    from tiers.hbm import HBMTier
    t = HBMTier(1 << 22)
    try:
        data = payload(3, 300_000)
        k1, k2 = hashlib.sha256(b"1").digest(), hashlib.sha256(b"2").digest()
        t.reserve(k1, len(data))
        t.write(k1, 0, data)
        t.commit(k1)
        p = tmp_path / "blk"
        assert write_block_file(p, t.device_array(k1)) == padded_size(len(data))
        t.reserve(k2, len(data))
        read_block_file(p, t.device_array(k2), len(data))
        t.mark_written(k2, len(data))
        t.commit(k2)
        assert read_bytes(t, k2) == data
        assert os.path.getsize(p) % 4096 == 0
    finally:
        t.close()


# ---------------------------------------------------------------- the NVMe tier's device path

def K(i: int) -> bytes:
    return hashlib.sha256(b"gds-%d" % i).digest()


# sizes: below a page, not page aligned, and larger than the checksum staging buffer (8 MiB)
SIZES = [1_000, 300_001, (9 << 20) + 123]


@pytest.fixture
def hbm():
    from tiers.hbm import HBMTier
    t = HBMTier(1 << 26)
    yield t
    t.close()


def hbm_block(hbm, k: bytes, data: bytes):
    hbm.reserve(k, len(data))
    hbm.write(k, 0, data)
    hbm.commit(k)


def file_of(nvme, key: bytes) -> str:
    return block_path(os.path.join(nvme.path, "blocks"), key)


@pytest.mark.parametrize("direct", [None, False])
def test_nvme_gds_write_read_by_posix_and_back(tmp_path, hbm, direct):
    from tiers.nvme.tier import NVMeTier
    from tiers.nvme.format import DEFAULT_CHUNK_BYTES, file_bytes
    path = tmp_path / "nvme"
    nvme = NVMeTier(path, 1 << 27, io="gds", direct=direct)
    assert nvme.io == "gds" and nvme.capabilities.device_files is nvme
    blocks = {K(i): payload(10 + i, n) for i, n in enumerate(SIZES)}
    try:
        for k, data in blocks.items():                    # HBM -> NVMe through GDS
            hbm_block(hbm, k, data)
            nvme.reserve(k, len(data))
            nvme.write_from_device(k, hbm.device_array(k))
            nvme.commit(k)
            assert os.path.getsize(file_of(nvme, k)) == file_bytes(len(data), DEFAULT_CHUNK_BYTES)
            assert read_bytes(nvme, k) == data            # POSIX read, every chunk verified
        posix = [K(10 + i) for i in range(len(SIZES))]
        for k, data in zip(posix, blocks.values()):       # POSIX write -> HBM through GDS
            nvme.reserve(k, len(data))
            nvme.write(k, 0, data)
            nvme.commit(k)
            hbm.reserve(k, len(data))
            assert nvme.read_into_device(k, hbm.device_array(k)) == len(data)
            hbm.mark_written(k, len(data))
            hbm.commit(k)
            assert read_bytes(hbm, k) == data
    finally:
        nvme.close()
    again = NVMeTier(path, 1 << 27, io="posix", direct=direct)  # a restart on the POSIX path
    try:
        assert {k for k, _ in again.recover()} == set(blocks) | set(posix)
        for k, data in blocks.items():
            assert read_bytes(again, k) == data
    finally:
        again.close()


def test_nvme_gds_read_verifies_the_checksum(tmp_path, hbm):
    from tiers.nvme.tier import NVMeTier
    nvme = NVMeTier(tmp_path / "nvme", 1 << 24, io="gds")
    try:
        data = payload(20, 50_000)
        nvme.reserve(K(1), len(data))
        nvme.write(K(1), 0, data)
        nvme.commit(K(1))
        with open(file_of(nvme, K(1)), "r+b") as f:
            f.seek(4096 + 1234)                           # the payload starts after the header page
            f.write(bytes([data[1234] ^ 0xFF]))
        hbm.reserve(K(1), len(data))
        with pytest.raises(BlockCorrupt, match="checksum"):
            nvme.read_into_device(K(1), hbm.device_array(K(1)))
        os.truncate(file_of(nvme, K(1)), 4096 + 100)
        with pytest.raises(BlockCorrupt, match="truncated"):
            nvme.read_into_device(K(1), hbm.device_array(K(1)))
        os.unlink(file_of(nvme, K(1)))
        with pytest.raises(BlockCorrupt, match="missing"):
            nvme.read_into_device(K(1), hbm.device_array(K(1)))
    finally:
        nvme.close()


# The manager test below is the lead's to port with the v2 manager (it dispatches by
# capabilities.device_files); the tier-side names are already the v2 ones.
def test_manager_moves_hbm_nvme_through_gds(tmp_path, monkeypatch):
    from kvstore.store.manager import TierManager
    from kvstore.policy import make_policy
    from tiers.base import TierKind
    from tiers.hbm import HBMTier
    from tiers.nvme.tier import NVMeTier

    nvme = NVMeTier(tmp_path / "nvme", 1 << 26, io="auto")
    assert nvme.capabilities.device_files is nvme
    calls = []
    for name in ("write_from_device", "read_into_device", "write"):
        method = getattr(nvme, name)
        monkeypatch.setattr(nvme, name, lambda *a, _m=method, _n=name: (calls.append(_n), _m(*a))[1])
    small = HBMTier(3 << 20)                              # room for one 2 MiB block
    m = TierManager([small, nvme], [make_policy("lru", t.capacity_bytes) for t in (small, nvme)],
                    async_moves=True)
    try:
        blocks = {K(30 + i): payload(30 + i, 2 << 20) for i in range(3)}
        for k, data in blocks.items():
            m.put(k, data)
        m.drain()
        assert calls.count("write_from_device") >= 2 and "write" not in calls
        first = next(iter(blocks))
        assert m.promote(first) is True
        m.drain()
        assert "read_into_device" in calls and m.tier_of(first) == TierKind.HBM
        for k, data in blocks.items():
            assert m.get(k).data == data
    finally:
        m.close()
