"""The NVMe tier's device path (GPUDirect Storage) on CPU: the same code as on a GPU, with
kvikio and CUDA memcpy replaced by a backend over host memory that exposes
``__cuda_array_interface__``. Checks the file format is the POSIX path's both ways, the
checksums, and the error contract. On a GPU, test_gpu_gds.py runs the real backend."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from nvme_support import K, block_files, disk_bytes, file_of, payload, put, read
from tiers.nvme import tier as nvme
from tiers.nvme import device as nvme_device
from tiers.base import DeviceFileIO
from tiers.errors import BlockCorrupt, BlockNotStored, DiskFull, InvalidAccess
from tiers.gpu import cuda_buffer
from tiers.nvme.tier import NVMeTier
from tiers.nvme.format import read_header


class HostDeviceArray:
    """Host memory dressed as a CUDA array (the interface is all the tier reads)."""

    def __init__(self, nbytes: int, fill: int = 0):
        self.host = np.full(nbytes, fill, dtype=np.uint8)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                         "data": (self.host.ctypes.data, False), "strides": None}

    @classmethod
    def of(cls, data: bytes) -> "HostDeviceArray":
        a = cls(len(data))
        a.host[:] = np.frombuffer(data, dtype=np.uint8)
        return a


def _view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * max(n, 1)).from_address(ptr)).cast("B")[:n]


class HostBackend:
    """kvikio's compatibility io_mode, in host memory: POSIX I/O at the device address."""

    def __init__(self):
        self.calls = []

    def to_host(self, host, device_buf, offset):
        ptr, _ = cuda_buffer(device_buf)
        ctypes.memmove(host.ctypes.data, ptr + offset, host.size)

    def write_file(self, path, device_buf, nbytes, file_offset):
        self.calls.append("write")
        ptr, _ = cuda_buffer(device_buf)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, _view(ptr, nbytes), file_offset)
        finally:
            os.close(fd)

    def read_file(self, path, device_buf, nbytes, file_offset):
        self.calls.append("read")
        if os.path.getsize(path) < file_offset + nbytes:
            raise BlockCorrupt(f"block file {path!r} is truncated")
        ptr, _ = cuda_buffer(device_buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [_view(ptr, nbytes)], file_offset)
        finally:
            os.close(fd)

    def host_buffer(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8), None


@pytest.fixture
def backend(monkeypatch):
    b = HostBackend()
    monkeypatch.setattr(nvme, "gds_available", lambda: True)
    monkeypatch.setattr(nvme_device, "kvikio_backend", lambda: b)
    return b


@pytest.fixture
def gds_tier(tmp_path, io_mode, backend):
    opened = []

    def make(**kw):
        t = NVMeTier(tmp_path / "nvme", 1 << 30, io="gds", direct=None if io_mode == "direct" else False, **kw)
        opened.append(t)
        return t

    yield make
    for t in opened:
        t.close()


# sizes: below a page, not page aligned, larger than the checksum staging buffer (8 MiB)
SIZES = [1_000, 300_001, (9 << 20) + 123]


def test_capability_is_declared_only_with_gds(gds_tier, tmp_path):
    t = gds_tier()
    assert t.io == "gds" and t.capabilities.device_files is t and isinstance(t, DeviceFileIO)
    posix = NVMeTier(tmp_path / "other", 1 << 20, io="posix")
    assert posix.capabilities.device_files is None
    posix.close()


def test_device_writes_read_by_posix_and_posix_writes_read_by_device(gds_tier, backend, tmp_path, io_mode):
    t = gds_tier()
    blocks = {K(i): payload(K(i), n) for i, n in enumerate(SIZES)}
    for k, data in blocks.items():                       # device -> NVMe
        t.reserve(k, len(data))
        t.write_from_device(k, HostDeviceArray.of(data))
        t.commit(k)
        assert os.path.getsize(file_of(t, k)) == disk_bytes(len(data))
        assert read_header(str(file_of(t, k)), k).size == len(data)
        assert read(t, k) == data                        # POSIX read, every chunk verified
        assert read(t, k, [(len(data) // 3, 300)]) == data[len(data) // 3:len(data) // 3 + 300]
    posix = {K(10 + i): payload(K(10 + i), n) for i, n in enumerate(SIZES)}
    for k, data in posix.items():                        # POSIX write -> device
        put(t, k, data, chunk=100_000)
        out = HostDeviceArray(len(data) + 5, fill=0xAB)
        assert t.read_into_device(k, out) == len(data)
        assert out.host[:len(data)].tobytes() == data and out.host[len(data):].tobytes() == b"\xab" * 5
    assert backend.calls.count("write") == 3 and backend.calls.count("read") == 3
    t.close()
    again = NVMeTier(tmp_path / "nvme", 1 << 30, io="posix", direct=None if io_mode == "direct" else False)
    try:                                                 # a restart on the POSIX path
        assert {k for k, _ in again.recover()} == set(blocks) | set(posix)
        assert all(read(again, k) == data for k, data in blocks.items())
    finally:
        again.close()


def test_device_write_reuses_spare_files_and_cuts_them(gds_tier):
    t = gds_tier()
    put(t, K(1), payload(K(1), 500_000))
    t.free(K(1))
    data = payload(K(2), 5_000)
    t.reserve(K(2), len(data))
    t.write_from_device(K(2), HostDeviceArray.of(data))
    t.commit(K(2))
    assert os.path.getsize(file_of(t, K(2))) == disk_bytes(5_000) and read(t, K(2)) == data


def open_descriptors() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return found


def test_a_device_write_after_the_file_is_open_opens_it_once(gds_tier):
    """A zero-length first write opens the reservation's file: the device write that follows
    uses it, never opens a second one (the first descriptor and its spare file would leak)."""
    t = gds_tier()
    put(t, K(9), payload(K(9), 65_536))
    t.free(K(9))                                         # one spare file
    data = payload(K(1), 65_536)
    before = open_descriptors()
    t.reserve(K(1), len(data))
    t.write(K(1), 0, b"")
    t.write_from_device(K(1), HostDeviceArray.of(data))
    t.commit(K(1))
    assert open_descriptors() - before == set()
    assert read(t, K(1)) == data and t.spare_bytes == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "symlink"])
def test_device_read_verifies_the_block(gds_tier, tmp_path, damage):
    t = gds_tier()
    data = payload(K(1), 50_000)
    put(t, K(1), data)
    path = file_of(t, K(1))
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[4096 + 40_000] ^= 0xFF
        path.write_bytes(raw)
        match = "checksum in chunk 2"
    elif damage == "truncate":
        os.truncate(path, 20_000)
        match = "truncated"
    elif damage == "missing":
        path.unlink()
        match = "missing"
    else:
        (tmp_path / "x").write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(tmp_path / "x")
        match = "symbolic link"
    with pytest.raises(BlockCorrupt, match=match):
        t.read_into_device(K(1), HostDeviceArray(50_000))


def test_device_error_contract(gds_tier, backend, monkeypatch):
    t = gds_tier()
    put(t, K(1), b"x" * 100)
    with pytest.raises(BlockNotStored):
        t.read_into_device(K(2), HostDeviceArray(100))
    with pytest.raises(InvalidAccess, match="smaller"):
        t.read_into_device(K(1), HostDeviceArray(99))
    with pytest.raises(InvalidAccess, match="not a CUDA array"):
        t.read_into_device(K(1), bytearray(100))
    with pytest.raises(BlockNotStored, match="not reserved"):
        t.write_from_device(K(3), HostDeviceArray(10))
    t.reserve(K(3), 10)
    with pytest.raises(InvalidAccess, match="device buffer has 9 bytes"):
        t.write_from_device(K(3), HostDeviceArray(9))
    t.write(K(3), 0, b"12345")
    with pytest.raises(InvalidAccess, match="already has 5 bytes"):
        t.write_from_device(K(3), HostDeviceArray(10))
    t.abort(K(3))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(backend, "write_file", full)
    t.reserve(K(4), 100_000)
    with pytest.raises(DiskFull):
        t.write_from_device(K(4), HostDeviceArray(100_000))
    assert K(4) not in t and t.used_bytes == disk_bytes(100) and len(block_files(t.path)) == 1


@pytest.mark.parametrize("reused", [False, True])
def test_a_device_read_racing_a_free_reports_the_block_not_stored(gds_tier, backend, monkeypatch, reused):
    """A block freed while its device read runs (its file moved away, or already reused by
    another block) is not stored: BlockNotStored, not BlockCorrupt (which drops copies)."""
    t = gds_tier()
    put(t, K(1), payload(K(1), 5_000))
    real = backend.read_file

    def freed_meanwhile(path, *args):
        if K(1) in t:
            t.free(K(1))
            if reused:                                   # the freed file holds another block now
                put(t, K(2), payload(K(2), 5_000))
        return real(str(file_of(t, K(2))) if reused else path, *args)
    monkeypatch.setattr(backend, "read_file", freed_meanwhile)
    with pytest.raises(BlockNotStored):
        t.read_into_device(K(1), HostDeviceArray(5_000))
