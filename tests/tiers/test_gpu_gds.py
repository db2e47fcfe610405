"""GPUDirect Storage helpers on a GPU (kvikio): the file format is the POSIX tier's."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from kvstore.errors import CorruptBlock
from tiers.gds import gds_available, gds_info, padded_size, read_block_file, write_block_file

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
    with pytest.raises(CorruptBlock, match="truncated"):
        read_block_file(p, cupy.empty(200, dtype=cupy.uint8), 200)
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
        assert t.read(k2) == data
        assert os.path.getsize(p) % 4096 == 0
    finally:
        t.close()
