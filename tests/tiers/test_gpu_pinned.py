"""Pinned host arena on a GPU machine (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from tiers.gpu import PinnedRegion, gpu_available, gpu_info
from tiers.memory import allocate_host_buffer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason=gpu_info().reason or "no CUDA GPU")]


def _is_pinned(array: np.ndarray) -> bool:
    import torch
    return torch.from_numpy(array).is_pinned()      # cudaPointerGetAttributes: registered host memory


@pytest.mark.parametrize("alignment", [64, 4096, 1 << 21])
def test_one_pinned_allocation_aligned_and_usable_for_dma(alignment):
    n = 3 * (1 << 20) + 5
    buf = allocate_host_buffer(n, alignment=alignment, pinned=True)
    assert buf.pinned and buf.nbytes == n and buf.array.size == n and buf.array.dtype == np.uint8
    assert buf.array.ctypes.data % alignment == 0
    region = buf.owner
    assert isinstance(region, PinnedRegion) and region.registered
    assert region.nbytes == n + (alignment if alignment > 4096 else 0)   # exact size: no power-of-two rounding
    assert _is_pinned(buf.array)
    buf.array[:] = np.arange(n, dtype=np.int64) % 251
    import torch
    dev = torch.from_numpy(buf.array).to("cuda", non_blocking=True)
    back = torch.empty(n, dtype=torch.uint8).pin_memory()
    back.copy_(dev)
    torch.cuda.synchronize()
    assert np.array_equal(back.numpy(), buf.array)
    region.close()
    assert not region.registered and not _is_pinned(buf.array)
    region.close()                                                     # idempotent
    assert int(buf.array[12345]) == 12345 % 251                         # memory still valid, now pageable
