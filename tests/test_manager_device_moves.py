"""Manager: HBM <-> NVMe copies take the device path (kvikio) by capability, the host path otherwise.

The device path is exercised here with stub tiers whose "device arrays" are host bytes
behind a ``__cuda_array_interface__``; the real GDS round trips are in
``tests/tiers/test_gpu_gds.py`` (GPU only).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.manager import TierManager, _move_bytes
from kvstore.policy import make_policy
from tiers.base import TierKind
from tiers.gds import gds_available
from tiers.gpu import GPUUnavailable
from tiers.null import NullTier


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i, n=100):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class FakeCudaArray:
    """Host bytes dressed as a CUDA array (the dispatch only looks for the interface)."""

    def __init__(self, host: np.ndarray):
        self.host = host

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.host.size,), "typestr": "|u1", "data": (self.host.ctypes.data, False),
                "version": 3}


class DeviceMemTier(NullTier):
    """Stands in for the HBM tier on a GPU: ``device_array`` and ``mark_written``; records calls."""

    def __init__(self, capacity, device=True):
        super().__init__(TierKind.HBM, capacity)
        self.device = device
        self.bufs, self.data, self.calls = {}, {}, []

    def reserve(self, key, nbytes):
        super().reserve(key, nbytes)
        self.bufs[key] = np.zeros(nbytes, dtype=np.uint8)

    def write(self, key, offset, data):
        super().write(key, offset, data)
        self.calls.append("write")
        src = np.frombuffer(data, dtype=np.uint8)
        self.bufs[key][offset:offset + src.size] = src

    def mark_written(self, key, nbytes):
        self.calls.append(("mark_written", nbytes))

    def commit(self, key):
        super().commit(key)
        self.data[key] = self.bufs.pop(key)

    def abort(self, key):
        super().abort(key)
        self.bufs.pop(key, None)

    def read(self, key, ranges=None):
        return self.data[key].tobytes()

    def view(self, key):
        self.calls.append("view")
        return memoryview(self.data[key])

    def device_array(self, key):
        arr = self.bufs[key] if key in self.bufs else self.data[key]
        return FakeCudaArray(arr) if self.device else arr      # numpy: like the CPU stand-in

    def free(self, key):
        super().free(key)
        del self.data[key]


class DeviceFileTier(NullTier):
    """Stands in for the NVMe tier with ``io = "gds"``: ``device_io``, ``write_device``,
    ``read_into_device``; records calls."""

    def __init__(self, capacity, device_io=True):
        super().__init__(TierKind.NVME, capacity)
        self.device_io = device_io
        self.bufs, self.data, self.calls = {}, {}, []

    def reserve(self, key, nbytes):
        super().reserve(key, nbytes)
        self.bufs[key] = bytearray(nbytes)

    def write(self, key, offset, data):
        super().write(key, offset, data)
        self.calls.append("write")
        self.bufs[key][offset:offset + len(data)] = data

    def write_device(self, key, buf):
        self.calls.append("write_device")
        self.bufs[key][:] = buf.host[:len(self.bufs[key])].tobytes()

    def read_into_device(self, key, buf):
        self.calls.append("read_into_device")
        data = self.data[key]
        buf.host[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def commit(self, key):
        super().commit(key)
        self.data[key] = bytes(self.bufs.pop(key))

    def abort(self, key):
        super().abort(key)
        self.bufs.pop(key, None)

    def read(self, key, ranges=None):
        return self.data[key]

    def view(self, key):
        self.calls.append("view")
        return memoryview(self.data[key])

    def free(self, key):
        super().free(key)
        del self.data[key]


@pytest.fixture(params=["inline", "async"])
def manager(request):
    made = []

    def make(hbm, nvme):
        m = TierManager([hbm, nvme], [make_policy("lru", t.capacity_bytes) for t in (hbm, nvme)],
                        async_moves=request.param == "async")
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# ---------------------------------------------------------------- the dispatch, one copy at a time


def stored(tier, key, data):
    tier.reserve(key, len(data))
    tier.write(key, 0, data)
    tier.commit(key)
    tier.calls.clear()


def test_hbm_to_nvme_uses_write_device():
    hbm, nvme = DeviceMemTier(1000), DeviceFileTier(1000)
    stored(hbm, K(1), payload(1))
    nvme.reserve(K(1), 100)
    _move_bytes(hbm, nvme, K(1), None)
    nvme.commit(K(1))
    assert nvme.calls == ["write_device"] and hbm.calls == []
    assert nvme.data[K(1)] == payload(1)


def test_nvme_to_hbm_uses_read_into_device_then_mark_written():
    hbm, nvme = DeviceMemTier(1000), DeviceFileTier(1000)
    stored(nvme, K(1), payload(1))
    hbm.reserve(K(1), 100)
    _move_bytes(nvme, hbm, K(1), None)
    hbm.commit(K(1))
    assert nvme.calls == ["read_into_device"] and hbm.calls == [("mark_written", 100)]
    assert hbm.read(K(1)) == payload(1)


@pytest.mark.parametrize("case", ["bytes in hand", "no device_io", "stand-in arrays"])
def test_host_path_otherwise(case):
    hbm = DeviceMemTier(1000, device=case != "stand-in arrays")
    nvme = DeviceFileTier(1000, device_io=case != "no device_io")
    data = payload(1) if case == "bytes in hand" else None
    stored(hbm, K(1), payload(1))
    stored(nvme, K(2), payload(2))
    nvme.reserve(K(1), 100)
    hbm.reserve(K(2), 100)
    _move_bytes(hbm, nvme, K(1), data)
    _move_bytes(nvme, hbm, K(2), payload(2) if data else None)
    nvme.commit(K(1))
    hbm.commit(K(2))
    expect_view = [] if data else ["view"]
    assert hbm.calls == expect_view + ["write"] and nvme.calls == ["write"] + expect_view
    assert nvme.data[K(1)] == payload(1) and hbm.read(K(2)) == payload(2)


# ---------------------------------------------------------------- through the manager


def test_manager_demotes_and_promotes_through_the_device_path(manager):
    hbm, nvme = DeviceMemTier(200), DeviceFileTier(1000)
    m = manager(hbm, nvme)
    for i in range(3):
        m.put(K(i), payload(i))
    m.drain()
    assert K(0) in nvme.data and nvme.data[K(0)] == payload(0)     # evicted from HBM to NVMe
    assert "write_device" in nvme.calls and "write" not in nvme.calls and "view" not in hbm.calls
    assert m.promote(K(0)) is True
    m.drain()
    assert m.tier_of(K(0)) == TierKind.HBM and m.get(K(0)).data == payload(0)
    assert "read_into_device" in nvme.calls and ("mark_written", 100) in hbm.calls


def test_manager_on_cpu_tiers_takes_the_host_path(manager, tmp_path, monkeypatch):
    from tiers.hbm import HBMTier
    from tiers.nvme import NVMeTier

    def refuse(*args):
        raise AssertionError("device path taken on a CPU machine")

    monkeypatch.setattr(NVMeTier, "write_device", refuse)
    monkeypatch.setattr(NVMeTier, "read_into_device", refuse)
    hbm = HBMTier(2 * 4096, backend="shm")
    nvme = NVMeTier(tmp_path / "nvme", 1 << 20, io="posix")
    assert not nvme.device_io
    m = manager(hbm, nvme)
    blocks = {K(i): payload(i, 3000) for i in range(4)}
    for k, v in blocks.items():
        m.put(k, v)
    m.drain()
    assert len(nvme) >= 2
    for k in blocks:
        m.promote(k)
        m.drain()
        assert m.get(k).data == blocks[k]


# ---------------------------------------------------------------- configuration on a CPU machine


@pytest.mark.skipif(gds_available(), reason="this machine has a CUDA GPU and kvikio")
def test_gds_io_without_a_gpu_is_a_config_error(tmp_path):
    from tiers.nvme import NVMeTier

    with pytest.raises(ConfigError, match=r"io = gds needs a CUDA GPU and kvikio \(.+\)"):
        NVMeTier(tmp_path / "a", 1 << 20, io="gds")
    t = NVMeTier(tmp_path / "b", 1 << 20, io="auto")
    try:
        assert t.io == "posix" and not t.device_io
        t.reserve(K(1), 10)
        with pytest.raises(GPUUnavailable, match="io = gds"):
            t.write_device(K(1), FakeCudaArray(np.zeros(10, dtype=np.uint8)))
        with pytest.raises(GPUUnavailable, match="io = gds"):
            t.read_into_device(K(1), FakeCudaArray(np.zeros(10, dtype=np.uint8)))
    finally:
        t.close()
