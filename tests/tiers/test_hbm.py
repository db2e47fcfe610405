"""HBM tier on its CPU stand-in (shared memory): accounting, two-phase writes, IPC
handles, and a second process reading a block in place through its handle (leases are
the catalogue's: tests/kvstore/test_manager.py).

The CUDA backend runs the same code with a device slab; see ``test_gpu_hbm.py``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import pathlib

import numpy as np
import pytest

from kvstore.client.ipc import close_attachments, open_block
from tiers.base import TierKind, read_bytes
from tiers.errors import BlockNotStored, NoRoom
from tiers.hbm import ALIGNMENT, HBMTier

ROOT = pathlib.Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def tier():
    t = HBMTier(64 * 1024, backend="shm")
    yield t
    t.close()
    close_attachments()


def put(t: HBMTier, i: int, n: int, chunks: int = 1) -> bytes:
    data = payload(i, n)
    t.reserve(key(i), n)
    step = -(-n // chunks)
    for off in range(0, n, step):
        t.write(key(i), off, data[off:off + step])
    t.commit(key(i))
    return data


def test_stand_in_is_the_default_without_a_gpu():
    from tiers.gpu import gpu_available
    if gpu_available():
        pytest.skip("a GPU is present: the default backend is cuda")
    t = HBMTier(8192)
    try:
        assert t.backend == "shm" and t.device == -1 and t.kind is TierKind.HBM
    finally:
        t.close()


def test_put_read_ranges_view_and_extent_accounting(tier):
    assert tier.capacity_bytes == 64 * 1024 and tier.used_bytes == 0
    a = put(tier, 1, 5000, chunks=3)
    b = put(tier, 2, 4096)
    assert key(1) in tier and key(2) in tier and len(tier) == 2
    assert tier.used_bytes == 2 * ALIGNMENT + ALIGNMENT      # 5000 -> 8192, 4096 -> 4096
    assert read_bytes(tier, key(1)) == a and read_bytes(tier, key(2)) == b
    assert read_bytes(tier, key(1), [(10, 5), (4999, 1)]) == a[10:15] + a[4999:]
    assert bytes(tier.view(key(2))) == b
    assert tier.size_of(key(1)) == 5000
    out = np.zeros(6000, dtype=np.uint8)
    assert tier.read_into(key(1), out) == 5000
    assert out[:5000].tobytes() == a and not out[5000:].any()
    assert tier.device_array(key(1)).tobytes() == a
    tier.free(key(1))
    assert key(1) not in tier and tier.used_bytes == ALIGNMENT
    with pytest.raises(KeyError):
        read_bytes(tier, key(1))


def test_full_tier_raises_and_fits_is_exact(tier):
    for i in range(16):
        put(tier, i, 4096)
    assert tier.used_bytes == tier.capacity_bytes
    assert not tier.fits(1)
    with pytest.raises(NoRoom):
        tier.reserve(key(99), 1)
    tier.free(key(3))
    tier.free(key(4))
    assert tier.fits(8192) and not tier.fits(8193)        # neighbours merged into one extent


def test_two_phase_errors(tier):
    tier.reserve(key(1), 100)
    assert key(1) not in tier                              # invisible until commit
    with pytest.raises(KeyError):
        read_bytes(tier, key(1))
    with pytest.raises(ValueError, match="already present"):
        tier.reserve(key(1), 100)
    with pytest.raises(ValueError, match="offset 10"):
        tier.write(key(1), 10, b"x")
    tier.write(key(1), 0, b"x" * 60)
    with pytest.raises(ValueError, match="overruns"):
        tier.write(key(1), 60, b"x" * 41)
    with pytest.raises(ValueError, match="60 of 100"):
        tier.commit(key(1))
    tier.abort(key(1))
    assert tier.used_bytes == 0
    tier.abort(key(1))                                     # unknown key: no-op
    with pytest.raises(BlockNotStored, match="not reserved"):
        tier.write(key(2), 0, b"x")
    with pytest.raises(KeyError):
        tier.free(key(2))
    with pytest.raises(ValueError):
        tier.reserve(key(3), 0)


def test_mark_written_after_filling_in_place(tier):
    tier.reserve(key(1), 300)
    tier.device_array(key(1))[:] = 7
    tier.mark_written(key(1), 300)
    tier.commit(key(1))
    assert read_bytes(tier, key(1)) == bytes([7]) * 300
    tier.reserve(key(2), 10)
    with pytest.raises(ValueError):
        tier.mark_written(key(2), 11)


def test_slots():
    t = HBMTier(10_000, backend="shm", slot_bytes=3000)
    try:
        assert t.capacity_bytes == 9000 and t.max_block_bytes == 3000
        put(t, 1, 10)
        assert t.used_bytes == 3000
        assert not t.fits(3001)
        with pytest.raises(NoRoom, match="largest block"):
            t.reserve(key(2), 3001)
        put(t, 2, 3000)
        put(t, 3, 2999)
        assert not t.fits(1)
        t.free(key(2))
        assert t.fits(3000)
        d = put(t, 4, 1234)
        assert read_bytes(t, key(4)) == d and read_bytes(t, key(3)) == payload(3, 2999)
    finally:
        t.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        HBMTier(100, backend="shm")                         # less than one 4096-byte unit
    with pytest.raises(ValueError):
        HBMTier(1 << 20, backend="tpu")
    with pytest.raises(ValueError):
        HBMTier(1 << 20, backend="shm", slot_bytes=0)


# ---------------------------------------------------------------------- IPC handles

def test_ipc_handles_locate_blocks(tier):
    a = put(tier, 1, 5000)
    put(tier, 2, 100)
    tier.reserve(key(3), 10)                                # reserved, not committed
    h1, h2 = tier.ipc_handle(key(1)), tier.ipc_handle(key(2))
    assert (h1.size, h1.device) == (5000, -1)
    assert h1.offset % ALIGNMENT == 0 and h2.offset % ALIGNMENT == 0 and h1.offset != h2.offset
    assert h1.handle == h2.handle and h1.handle
    with pytest.raises(BlockNotStored):
        tier.ipc_handle(key(3))
    arr = open_block(h1)
    assert arr.tobytes() == a
    assert not arr.flags.writeable                         # workers get a read-only mapping


def test_block_read_in_place_by_another_process(tier):
    """A separate Python process maps the slab by its name and reads the block zero-copy."""
    data = put(tier, 7, 12_345)
    put(tier, 8, 100)
    h = tier.ipc_handle(key(7))
    script = textwrap.dedent("""
        import hashlib, json, sys
        from kvstore.client.ipc import open_block
        from tiers.base import IpcHandle
        d = json.loads(sys.argv[1])
        arr = open_block(IpcHandle(d["handle"].encode(), d["offset"], d["size"], d["device"]))
        print(hashlib.sha256(arr).hexdigest(), arr.size, arr.flags.writeable)
    """)
    arg = json.dumps({"handle": h.handle.decode(), "offset": h.offset, "size": h.size, "device": h.device})
    res = subprocess.run([sys.executable, "-c", script, arg], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    digest, size, writeable = res.stdout.split()
    assert digest == hashlib.sha256(data).hexdigest() and int(size) == 12_345 and writeable == "False"
    assert "resource_tracker" not in res.stderr            # the reader did not adopt the segment
    assert read_bytes(tier, key(7)) == data                  # still there after the reader exited


def test_capabilities_of_the_stand_in(tier):
    caps = tier.capabilities
    assert caps.device is tier and caps.host is tier and caps.shared is None and caps.device_files is None


def test_close_with_outstanding_views():
    t = HBMTier(8192, backend="shm")
    put(t, 1, 10)
    v = t.view(key(1))
    t.close()                                              # must not raise although v is alive
    assert bytes(v) == payload(1, 10)
