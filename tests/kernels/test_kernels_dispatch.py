"""``kernels.gather_blocks`` / ``scatter_blocks`` pick the implementation by the caches' device."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernel_cases import make_caches


def test_cpu_tensors_use_the_reference():
    caches = make_caches(2, 4, 4, 2, 4, "NHD", torch.float16)
    assert kernels.implementation(caches) is reference
    got = kernels.gather_blocks(caches, [3, 0], heads=(1, 2), layers=[1])
    assert torch.equal(got, reference.gather_blocks(caches, [3, 0], heads=(1, 2), layers=[1]))
    kernels.scatter_blocks(caches, [1], got[:1], heads=(1, 2), layers=[1])
    assert torch.equal(caches[1][:, 1, :, 1:2], caches[1][:, 3, :, 1:2])


def test_dispatch_passes_errors_through():
    caches = make_caches(1, 2, 4, 2, 4, "HND", torch.float32)
    with pytest.raises(ValueError, match="block id"):
        kernels.gather_blocks(caches, [2], layout="HND")
    with pytest.raises(ValueError, match="distinct"):
        kernels.scatter_blocks(caches, [0, 0], torch.empty(2, 1, 2, 2, 4, 4), layout="HND")


def test_cuda_module_imports_without_a_gpu():
    from kernels import cuda
    assert isinstance(cuda.available(), bool)
    with pytest.raises(ValueError, match="CUDA device"):
        cuda.gather_blocks(make_caches(1, 2, 4, 2, 4, "NHD", torch.float32), [0])
