"""The mover: how bytes move between two tiers is chosen once per pair from their
declared capabilities (device path by GPUDirect Storage, zero-copy host views, reads
straight into a reservation, or a bounded bounce buffer).

The device path runs here with fake tiers whose "device arrays" are host bytes behind
a ``__cuda_array_interface__``; the real GDS round trips are in
``tests/tiers/test_gpu_gds.py`` (GPU only).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.fake_tiers import MemTier

from kvstore.config import from_dict
from kvstore.common.errors import ConfigError
from kvstore.store.manager import TierManager
from kvstore.store.mover import BOUNCE_BYTES, copy_plan
from kvstore.policy import make_policy
from tiers.base import Capabilities, TierKind, read_bytes


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i, n=100):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class FakeCudaArray:
    """Host bytes dressed as a CUDA array."""

    def __init__(self, host: np.ndarray):
        self.host = host

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.host.size,), "typestr": "|u1", "data": (self.host.ctypes.data, False),
                "version": 3}


class DeviceTier(MemTier):
    """Stands in for the HBM tier on a GPU (the ``device`` capability); records calls."""

    def __init__(self, capacity):
        super().__init__(TierKind.HBM, capacity)
        self.calls = []
        self._caps = Capabilities(device=self)

    def device_array(self, key):
        buf = self._reserved.get(key)
        return FakeCudaArray(np.frombuffer(buf, dtype=np.uint8) if buf is not None
                             else np.frombuffer(self.data[key], dtype=np.uint8))

    def ipc_handle(self, key):  # pragma: no cover - not used by the mover
        raise NotImplementedError

    def mark_written(self, key, nbytes):
        self.calls.append(("mark_written", nbytes))
        super().mark_written(key, nbytes)

    def write(self, key, offset, data):
        self.calls.append("write")
        super().write(key, offset, data)


class FileTier(MemTier):
    """Stands in for the NVMe tier with GPUDirect Storage (``device_files``); records calls."""

    def __init__(self, capacity):
        super().__init__(TierKind.NVME, capacity)
        self.calls = []
        self._caps = Capabilities(device_files=self)

    def write_from_device(self, key, buf):
        self.calls.append("write_from_device")
        size = len(self._reserved[key])
        self.write_view(key)[:] = buf.host[:size].tobytes()
        self.mark_written(key, size)

    def read_into_device(self, key, buf):
        self.calls.append("read_into_device")
        data = self.data[key]
        buf.host[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def write(self, key, offset, data):
        self.calls.append("write")
        super().write(key, offset, data)


def stored(tier, key, data):
    tier.reserve(key, len(data))
    tier.write(key, 0, data)
    tier.commit(key)
    tier.calls = [] if hasattr(tier, "calls") else None


def moved(src, dst, key):
    name, copy = copy_plan(src, dst)
    dst.reserve(key, src.size_of(key))
    copy(key)
    dst.commit(key)
    return name


def test_plans_by_capability():
    hbm, files = DeviceTier(1000), FileTier(1000)
    host, plain = MemTier(TierKind.HOST, 1000, host=True), MemTier(TierKind.NVME, 1000)
    assert copy_plan(hbm, files)[0] == "device->files"
    assert copy_plan(files, hbm)[0] == "files->device"
    assert copy_plan(host, plain)[0] == "view->write"
    assert copy_plan(plain, host)[0] == "read->reservation"
    assert copy_plan(plain, MemTier(TierKind.NVME, 10))[0] == "bounce"


def test_hbm_to_nvme_by_gds_and_back():
    hbm, files = DeviceTier(1000), FileTier(1000)
    stored(hbm, K(1), payload(1))
    assert moved(hbm, files, K(1)) == "device->files"
    assert files.calls == ["write_from_device"] and "write" not in hbm.calls
    assert files.data[K(1)] == payload(1)
    stored(files, K(2), payload(2))
    assert moved(files, hbm, K(2)) == "files->device"
    assert files.calls == ["read_into_device"] and hbm.calls == [("mark_written", 100)]
    assert read_bytes(hbm, K(2)) == payload(2)


def test_nvme_to_host_reads_straight_into_the_reservation():
    host, disk = MemTier(TierKind.HOST, 1000, host=True), MemTier(TierKind.NVME, 1000)
    stored(disk, K(1), payload(1))
    assert moved(disk, host, K(1)) == "read->reservation"
    assert host.writes == 0 and disk.bytes_read == 100 and host.data[K(1)] == payload(1)


def test_bounce_moves_large_blocks_in_bounded_pieces():
    a, b = MemTier(TierKind.NVME, 1 << 24), MemTier(TierKind.NVME, 1 << 24, name="other")
    data = payload(3, BOUNCE_BYTES * 2 + 5)
    stored(a, K(3), data)
    assert moved(a, b, K(3)) == "bounce"
    assert b.writes == 3 and b.data[K(3)] == data


@pytest.mark.parametrize("async_moves", [False, True])
def test_manager_demotes_and_promotes_through_the_device_path(async_moves):
    hbm, files = DeviceTier(200), FileTier(1000)
    m = TierManager([hbm, files], [make_policy("lru", t.capacity_bytes) for t in (hbm, files)],
                    async_moves=async_moves, watermarks=(1.0, 1.0))
    try:
        for i in range(3):
            m.put(K(i), payload(i))
        m.drain()
        assert files.data[K(0)] == payload(0)                       # evicted from HBM to NVMe
        assert "write_from_device" in files.calls and "write" not in files.calls
        assert m.promote(K(0)) is True
        m.drain()
        assert m.tier_of(K(0)) == TierKind.HBM and bytes(m.get(K(0)).data) == payload(0)
        assert "read_into_device" in files.calls and ("mark_written", 100) in hbm.calls
    finally:
        m.close()


def test_gds_without_a_gpu_is_a_config_error(tmp_path):
    from tiers.gds import gds_available
    if gds_available():
        pytest.skip("this machine has a CUDA GPU and kvikio")
    from kvstore.service.build import build_tiers
    cfg = from_dict({"tiers": {"host": {"capacity": "1MiB"},
                               "nvme": {"path": str(tmp_path / "n"), "capacity": "1MiB", "io": "gds"}}})
    with pytest.raises(ConfigError, match=r"tiers.nvme: io = gds needs a CUDA GPU and kvikio"):
        build_tiers(cfg)
