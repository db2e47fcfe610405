"""The torch reference gather/scatter against a naive row-by-row copy (CPU, runs in CI)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernel_cases import DTYPES, make_caches, naive_gather, naive_scatter

LAYOUTS = ("NHD", "HND")
# (heads, layers, block_ids): full and partial head ranges, layer subsets out of order,
# non-contiguous and repeated block ids
SELECTIONS = [
    (None, None, [0, 1, 2]),
    ((1, 3), None, [4, 0, 2]),
    ((0, 1), [2, 0], [3]),
    ((2, 4), [1, 2], [5, 1, 3, 0]),
    (None, [1], [2, 2]),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,layers,block_ids", SELECTIONS)
def test_gather_matches_naive_copy(layout, dtype, heads, layers, block_ids):
    caches = make_caches(3, 6, 4, 4, 3, layout, dtype, seed=1)
    got = reference.gather_blocks(caches, block_ids, heads=heads, layers=layers, layout=layout)
    want = naive_gather(caches, block_ids, heads, layers, layout)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,layers,block_ids", [s for s in SELECTIONS if len(set(s[2])) == len(s[2])])
def test_scatter_matches_naive_copy_and_touches_nothing_else(layout, dtype, heads, layers, block_ids):
    caches = make_caches(3, 6, 4, 4, 3, layout, dtype, seed=2)
    expected = [c.clone() for c in caches]
    n_layers = 3 if layers is None else len(layers)
    n_heads = 4 if heads is None else heads[1] - heads[0]
    src = torch.randn(len(block_ids), n_layers, 2, n_heads, 4, 3, generator=torch.Generator().manual_seed(9)).to(dtype)
    reference.scatter_blocks(caches, block_ids, src, heads=heads, layers=layers, layout=layout)
    naive_scatter(expected, block_ids, src, heads, layers, layout)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_caches(layout):
    """Layer caches that are views with k|v not outermost (FlashInfer-like memory order)."""
    caches = make_caches(2, 5, 4, 2, 8, layout, torch.float16, seed=3, strided=True)
    assert not caches[0].is_contiguous()
    got = reference.gather_blocks(caches, [4, 1], heads=(1, 2), layout=layout)
    assert torch.equal(got, naive_gather(caches, [4, 1], (1, 2), None, layout))
    src = torch.randn(got.shape).to(torch.float16)
    expected = [c.clone() for c in caches]
    reference.scatter_blocks(caches, [0, 3], src, heads=(1, 2), layout=layout)
    naive_scatter(expected, [0, 3], src, (1, 2), None, layout)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_known_values_nhd_and_hnd():
    """Hand-checkable: element (kv, block, token, head, dim) holds its own coordinates."""
    nb, bs, nh, hd = 3, 2, 2, 2

    def coded(layout):
        c = torch.empty((2, nb, bs, nh, hd) if layout == "NHD" else (2, nb, nh, bs, hd), dtype=torch.float32)
        for kv in range(2):
            for b in range(nb):
                for t in range(bs):
                    for h in range(nh):
                        for d in range(hd):
                            v = kv * 10000 + b * 1000 + t * 100 + h * 10 + d
                            if layout == "NHD":
                                c[kv, b, t, h, d] = v
                            else:
                                c[kv, b, h, t, d] = v
        return c

    for layout in LAYOUTS:
        out = reference.gather_blocks([coded(layout)], [2], heads=(1, 2), layout=layout)
        assert out.shape == (1, 1, 2, 1, 2, 2)
        # block 2, head 1: [kv][token][dim]
        assert out[0, 0, 0, 0].tolist() == [[2010, 2011], [2110, 2111]]
        assert out[0, 0, 1, 0].tolist() == [[12010, 12011], [12110, 12111]]


def test_gather_into_out_and_roundtrip():
    caches = make_caches(2, 4, 4, 2, 4, "HND", torch.bfloat16, seed=4)
    out = torch.zeros(2, 2, 2, 2, 4, 4, dtype=torch.bfloat16)
    ret = reference.gather_blocks(caches, [3, 1], layout="HND", out=out)
    assert ret is out
    fresh = [torch.zeros_like(c) for c in caches]
    reference.scatter_blocks(fresh, [0, 2], out, layout="HND")
    again = reference.gather_blocks(fresh, [0, 2], layout="HND")
    assert torch.equal(again, out)
    assert torch.count_nonzero(fresh[0][:, [1, 3]]) == 0


def test_empty_block_list():
    caches = make_caches(1, 2, 4, 2, 4, "NHD", torch.float32)
    assert reference.gather_blocks(caches, []).shape == (0, 1, 2, 2, 4, 4)


@pytest.mark.parametrize("call,message", [
    (lambda c: reference.gather_blocks(c, [0], layout="XYZ"), "layout"),
    (lambda c: reference.gather_blocks([], [0]), "at least one"),
    (lambda c: reference.gather_blocks(c, [4]), "block id"),
    (lambda c: reference.gather_blocks(c, [-1]), "block id"),
    (lambda c: reference.gather_blocks(c, [0], heads=(1, 3)), "head range"),
    (lambda c: reference.gather_blocks(c, [0], heads=(1, 1)), "head range"),
    (lambda c: reference.gather_blocks(c, [0], layers=[2]), "layer"),
    (lambda c: reference.gather_blocks(c, [0], out=torch.empty(1, 2, 2, 2, 4, 5)), "out must be"),
    (lambda c: reference.gather_blocks(c, [0], out=torch.empty(1, 2, 2, 2, 4, 4, dtype=torch.float16)),
     "out must be"),
    (lambda c: reference.scatter_blocks(c, [1, 1], torch.empty(2, 2, 2, 2, 4, 4)), "distinct"),
    (lambda c: reference.scatter_blocks(c, [0], torch.empty(1, 2, 2, 2, 4, 4, dtype=torch.float64)),
     "src must be"),
    (lambda c: reference.gather_blocks(c + [torch.empty(2, 4, 4, 2, 4, dtype=torch.float16)], [0]), "share"),
])
def test_errors(call, message):
    caches = make_caches(2, 4, 4, 2, 4, "NHD", torch.float32)
    with pytest.raises(ValueError, match=message):
        call(caches)


def test_device_ids_serve_as_block_ids_and_are_checked_once():
    """``kernels.cuda.device_ids`` (pure torch: it runs on the CPU too) checks ids once; the
    reference takes the result wherever it takes ids, refusing a cache with fewer blocks than
    they were checked against, and a scatter refuses ids not checked for being distinct."""
    from kernels import cuda
    caches = make_caches(2, 8, 4, 2, 8, "NHD", torch.float32, seed=3)
    ids = cuda.device_ids([5, 1, 7], 8, torch.device("cpu"), distinct=True)
    assert torch.equal(reference.gather_blocks(caches, ids), reference.gather_blocks(caches, [5, 1, 7]))
    with pytest.raises(ValueError, match="checked against 8 blocks"):
        reference.gather_blocks([c[:, :6] for c in caches], ids)
    with pytest.raises(ValueError, match="block id outside"):
        cuda.device_ids([8], 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be distinct"):
        cuda.device_ids([1, 1], 8, torch.device("cpu"), distinct=True)
    with pytest.raises(ValueError, match="must be distinct"):
        cuda.device_index(cuda.device_ids([1, 2], 8, torch.device("cpu")), 8, torch.device("cpu"), distinct=True)
