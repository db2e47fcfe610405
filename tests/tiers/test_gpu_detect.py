"""GPU detection, the CPU behaviour of every GPU entry point, and the helpers that need no GPU."""

from __future__ import annotations

import pytest

from tiers import gds, gpu
from tiers.gpu import GPUUnavailable, cuda_buffer, gpu_available, gpu_info
from tiers.memory import allocate_host_buffer

no_gpu = pytest.mark.skipif(gpu_available(), reason="a GPU is present: the CPU-only behaviour does not apply")


def test_detection_runs_once_and_is_consistent():
    info = gpu_info()
    assert gpu_info() is info                                   # cached
    assert gpu_available() is info.available
    assert info.available == (info.device_count > 0 and (info.cupy or info.torch))
    assert (info.reason == "") == info.available


@no_gpu
def test_cpu_machine_reports_why():
    info = gpu_info()
    assert not info.available and info.device_count == 0
    assert info.reason.startswith("no CUDA GPU:") and "torch" in info.reason and "cupy" in info.reason


@no_gpu
def test_gpu_entry_points_refuse_loudly_on_cpu(tmp_path):
    from tiers.hbm import HBMTier

    with pytest.raises(GPUUnavailable, match="pinned host memory needs a CUDA GPU"):
        allocate_host_buffer(1 << 20, pinned=True)
    with pytest.raises(GPUUnavailable, match="HBM tier needs a CUDA GPU"):
        HBMTier(1 << 20, backend="cuda")
    with pytest.raises(GPUUnavailable):
        gpu.require_gpu("x")
    assert not gds.gds_available() and gds.gds_info().mode == ""
    with pytest.raises(GPUUnavailable, match="GPUDirect Storage"):
        gds.write_block_file(tmp_path / "f", object(), 1)
    with pytest.raises(GPUUnavailable):
        gds.read_block_file(tmp_path / "f", object(), 1)
    assert not (tmp_path / "f").exists()


def test_pageable_buffer_unchanged():
    buf = allocate_host_buffer(10_000, alignment=4096)
    assert not buf.pinned and buf.nbytes == 10_000 and buf.array.size == 10_000
    assert buf.array.ctypes.data % 4096 == 0


def test_padded_size():
    assert gds.padded_size(0) == 4096
    assert gds.padded_size(1) == 4096
    assert gds.padded_size(4096) == 4096
    assert gds.padded_size(4097) == 8192
    assert gds.padded_size(10, page=512) == 512
    with pytest.raises(ValueError):
        gds.padded_size(-1)


class FakeCudaArray:
    def __init__(self, ptr, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": 3}


def test_cuda_buffer_reads_the_interface():
    assert cuda_buffer(FakeCudaArray(0x1000, (4, 8), "<f2")) == (0x1000, 64)
    assert cuda_buffer(FakeCudaArray(0x2000, (3,), "|u1", strides=(1,))) == (0x2000, 3)
    assert cuda_buffer(FakeCudaArray(0x2000, (4, 8), "<f4", strides=(32, 4))) == (0x2000, 128)
    assert cuda_buffer(FakeCudaArray(0x2000, (1, 8), "<f4", strides=(999, 4))) == (0x2000, 32)  # size-1 dim
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_buffer(FakeCudaArray(0x2000, (4, 8), "<f4", strides=(64, 4)))
    with pytest.raises(TypeError):
        cuda_buffer(b"host bytes")
