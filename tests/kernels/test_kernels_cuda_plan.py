"""The CUDA kernels' host-side planning, checked on CPU by emulating the kernel.

``kernels.cuda.plan_launch`` computes everything a launch needs (copy unit, byte
strides, pointers); :func:`emulate` below applies the kernel's address formula (the
one in ``kernels/cuda.py``'s ``_SOURCE``) to CPU tensors' bytes, so the layout and
stride logic is compared with the reference without a GPU. The real kernel is
compared on a GPU in ``test_kernels_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cuda, reference
from kernel_cases import DTYPES, make_caches


def _storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(st)
    return flat, st.data_ptr()


def emulate(caches, layer_ids, block_ids, h0, layout, buf, to_cache):
    """Run the kernel's index/address arithmetic over every thread index at once."""
    p = cuda.plan_launch(caches, layer_ids, h0, layout, buf)
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    idx = torch.arange(p.total, dtype=torch.int64)
    r = idx
    u = r % p.row_units; r = r // p.row_units
    t = r % p.block_size; r = r // p.block_size
    h = r % p.num_heads; r = r // p.num_heads
    kv = r % 2; r = r // 2
    j = r % p.num_layers
    i = r // p.num_layers
    lane = torch.arange(p.unit, dtype=torch.int64)
    buf_bytes = buf.view(-1).view(torch.uint8)
    for jj, l in enumerate(layer_ids):
        flat, base = _storage_bytes(caches[l])
        m = j == jj
        s = p.strides[jj]
        addr = (p.ptrs[jj] - base + kv[m] * s[0] + ids[i[m]] * s[1] + t[m] * s[2]
                + (p.head0 + h[m]) * s[3] + u[m] * s[4])
        cache_idx = (addr[:, None] + lane).reshape(-1)
        buf_idx = (idx[m][:, None] * p.unit + lane).reshape(-1)
        if to_cache:
            flat[cache_idx] = buf_bytes[buf_idx]
        else:
            buf_bytes[buf_idx] = flat[cache_idx]
    return p


CASES = [  # layers, blocks, block_size, heads, head_dim, head range, layer ids, block ids
    (3, 7, 4, 4, 8, (1, 3), [2, 0], [6, 1, 3]),
    (2, 5, 16, 2, 128, None, [0, 1], [4, 0]),
    (2, 4, 3, 3, 5, (2, 3), [1], [3, 2, 0]),
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_emulated_kernel_matches_reference(layout, dtype, strided, case):
    L, nb, bs, nh, hd, heads, layers, ids = case
    caches = make_caches(L, nb, bs, nh, hd, layout, dtype, seed=5, strided=strided)
    h0, h1 = heads or (0, nh)
    want = reference.gather_blocks(caches, ids, heads=heads, layers=layers, layout=layout)
    buf = torch.zeros_like(want)
    emulate(caches, layers, ids, h0, layout, buf, to_cache=False)
    assert torch.equal(buf, want)

    src = torch.randn(want.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    expected = [c.clone() for c in caches]
    reference.scatter_blocks(expected, ids, src, heads=heads, layers=layers, layout=layout)
    emulate(caches, layers, ids, h0, layout, src.contiguous(), to_cache=True)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_unit_is_16_bytes_for_fp16_head_dim_128():
    caches = make_caches(2, 4, 16, 8, 128, "NHD", torch.float16)
    buf = torch.empty(1, 2, 2, 8, 16, 128, dtype=torch.float16)
    p = cuda.plan_launch(caches, [0, 1], 0, "NHD", buf)
    assert p.unit == 16 and p.row_units == 128 * 2 // 16
    # byte strides (kv, block, token, head, unit step) of a contiguous NHD cache
    assert p.strides[0] == (4 * 16 * 8 * 128 * 2, 16 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 16)
    assert p.total == 1 * 2 * 2 * 8 * 16 * 16
    hnd = make_caches(1, 4, 16, 8, 128, "HND", torch.float16)
    q = cuda.plan_launch(hnd, [0], 0, "HND", buf[:, :1].contiguous())
    assert q.strides[0][2:4] == (128 * 2, 16 * 128 * 2)   # token, head swap places


@pytest.mark.parametrize("dtype,head_dim,unit", [
    (torch.float16, 3, 2),      # 6-byte rows: 2-byte units
    (torch.float32, 2, 8),      # 8-byte rows
    (torch.float32, 3, 4),
    (torch.bfloat16, 4, 8),
])
def test_unit_divides_rows_and_strides(dtype, head_dim, unit):
    caches = make_caches(1, 4, 4, 2, head_dim, "NHD", dtype)
    buf = torch.empty(1, 1, 2, 2, 4, head_dim, dtype=dtype)
    assert cuda.plan_launch(caches, [0], 0, "NHD", buf).unit == unit


def test_misaligned_buffer_falls_back_to_element_units():
    caches = make_caches(1, 4, 4, 2, 8, "NHD", torch.float16)
    flat = torch.empty(1 + 2 * 2 * 4 * 8, dtype=torch.float16)
    buf = flat[1:].view(1, 1, 2, 2, 4, 8)                   # starts 2 bytes into an allocation
    p = emulate(caches, [0], [3], 0, "NHD", buf, to_cache=False)
    assert p.unit == 2
    assert torch.equal(buf, reference.gather_blocks(caches, [3]))


def test_non_contiguous_head_dim_steps_by_element_stride():
    full = make_caches(1, 3, 4, 2, 8, "HND", torch.float32)[0]
    cache = full[..., ::2]                                  # head_dim 4 with element stride 2
    buf = torch.empty(2, 1, 2, 2, 4, 4, dtype=torch.float32)
    p = emulate([cache], [0], [2, 0], 0, "HND", buf, to_cache=False)
    assert p.unit == 4 and p.strides[0][4] == 8 and p.row_units == 4
    assert torch.equal(buf, reference.gather_blocks([cache], [2, 0], layout="HND"))
