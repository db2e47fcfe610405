"""CUDA kernels against the torch reference on a GPU, bit for bit (skipped without one)."""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels import reference
from kernel_cases import DTYPES, make_caches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"),
]


def _cuda():
    from kernels import cuda
    if not cuda.available():
        pytest.skip("CuPy is not installed: the CUDA kernels cannot run")
    return cuda


def _random_case(rng: random.Random):
    L = rng.randint(1, 4)
    nb = rng.randint(2, 40)
    bs = rng.choice([1, 3, 16, 32])
    nh = rng.randint(1, 8)
    hd = rng.choice([1, 5, 64, 128])
    h0 = rng.randrange(nh)
    h1 = rng.randint(h0 + 1, nh)
    layers = rng.sample(range(L), rng.randint(1, L))
    n = rng.randint(1, nb)
    ids = rng.sample(range(nb), n)               # distinct, any order
    return L, nb, bs, nh, hd, (h0, h1), layers, ids


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_reference(layout, dtype, seed):
    cuda = _cuda()
    rng = random.Random(seed * 7919 + DTYPES.index(dtype))
    L, nb, bs, nh, hd, heads, layers, ids = _random_case(rng)
    caches = make_caches(L, nb, bs, nh, hd, layout, dtype, device="cuda", seed=seed, strided=seed % 3 == 2)
    want = reference.gather_blocks(caches, ids, heads=heads, layers=layers, layout=layout)
    got = cuda.gather_blocks(caches, ids, heads=heads, layers=layers, layout=layout)
    assert got.is_cuda and got.shape == want.shape
    assert torch.equal(got, want)

    src = torch.randn(want.shape, device="cuda").to(dtype)
    expected = [c.clone() for c in caches]
    reference.scatter_blocks(expected, ids, src, heads=heads, layers=layers, layout=layout)
    cuda.scatter_blocks(caches, ids, src, heads=heads, layers=layers, layout=layout)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_llama70b_shard_shape_uses_16_byte_units():
    cuda = _cuda()
    caches = make_caches(4, 64, 16, 8, 128, "NHD", torch.float16, device="cuda", seed=1)
    ids = torch.randperm(64, device="cuda")[:32]
    got = cuda.gather_blocks(caches, ids, heads=(2, 4), layers=[3, 1])
    assert torch.equal(got, reference.gather_blocks(caches, ids, heads=(2, 4), layers=[3, 1]))
    p = cuda.plan_launch(caches, [3, 1], 2, "NHD", got)
    assert p.unit == 16


def test_out_on_host_and_src_on_host():
    cuda = _cuda()
    caches = make_caches(2, 8, 16, 4, 64, "HND", torch.bfloat16, device="cuda", seed=2)
    out = torch.empty(3, 2, 2, 4, 16, 64, dtype=torch.bfloat16).pin_memory()
    ret = cuda.gather_blocks(caches, [7, 0, 5], layout="HND", out=out)
    assert ret is out
    assert torch.equal(out, reference.gather_blocks(caches, [7, 0, 5], layout="HND").cpu())
    fresh = [torch.zeros_like(c) for c in caches]
    cuda.scatter_blocks(fresh, [1, 2, 3], out, layout="HND")     # CPU src
    assert torch.equal(reference.gather_blocks(fresh, [1, 2, 3], layout="HND").cpu(), out)


def test_dispatch_uses_cuda_for_cuda_tensors():
    cuda = _cuda()
    caches = make_caches(1, 4, 4, 2, 8, "NHD", torch.float32, device="cuda")
    assert kernels.implementation(caches) is cuda
    assert kernels.implementation([c.cpu() for c in caches]) is reference


def test_empty_and_errors_match_reference():
    cuda = _cuda()
    caches = make_caches(2, 4, 4, 2, 8, "NHD", torch.float16, device="cuda")
    assert cuda.gather_blocks(caches, []).shape == (0, 2, 2, 2, 4, 8)
    for call in (lambda m: m.gather_blocks(caches, [4]),
                 lambda m: m.gather_blocks(caches, [0], heads=(0, 3)),
                 lambda m: m.gather_blocks(caches, [0], layers=[5]),
                 lambda m: m.scatter_blocks(caches, [1, 1], torch.empty(2, 2, 2, 2, 4, 8, dtype=torch.float16,
                                                                        device="cuda"))):
        with pytest.raises(ValueError) as want:
            call(reference)
        with pytest.raises(ValueError) as got:
            call(cuda)
        assert str(got.value) == str(want.value)


def test_kernels_run_in_order_on_torch_current_stream():
    """A gather launched on a side stream sees the fill queued just before it on that stream
    and a scatter's writes are seen by the copy queued after it, with no synchronisation in
    between: the kernels run on torch's current stream, not on CuPy's default one."""
    cuda = _cuda()
    caches = make_caches(2, 64, 16, 8, 128, "NHD", torch.float16, device="cuda", seed=1)
    ids = list(range(0, 64, 3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())     # the caches are made on the default stream
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)                 # hold the stream (~tens of ms) before the fill
        for c in caches:
            c.fill_(2.0)
        got = cuda.gather_blocks(caches, ids)
        src = torch.full_like(got, 3.0)
        cuda.scatter_blocks(caches, ids, src)
        after = torch.stack([c.clone() for c in caches])
    side.synchronize()
    assert bool((got == 2.0).all())
    picked = after[:, :, ids]
    assert bool((picked == 3.0).all()) and int((after == 3.0).sum()) == picked.numel()


def test_device_ids_and_launches_never_make_the_host_wait():
    """Block ids checked once (``device_ids``) serve every layer's launch; gathers and
    scatters given host ids or device ids queue without a host sync (torch raises on one in
    its ``error`` sync debug mode), and move what the reference moves."""
    cuda = _cuda()
    caches = make_caches(3, 32, 16, 4, 64, "HND", torch.bfloat16, device="cuda", seed=4)
    ids = [30, 2, 17, 9]
    want = reference.gather_blocks(caches, ids, layout="HND")
    fresh = [torch.zeros_like(c) for c in caches]
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_device = cuda.device_ids(ids, 32, caches[0].device, distinct=True)
        layers = [cuda.gather_blocks(caches, on_device, layers=[j], layout="HND") for j in range(3)]
        from_list = cuda.gather_blocks(caches, ids, layout="HND")
        for j in range(3):
            cuda.scatter_blocks(fresh, on_device, layers[j], layers=[j], layout="HND")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(torch.cat(layers, dim=1), want) and torch.equal(from_list, want)
    assert all(torch.equal(f[:, ids], c[:, ids]) for f, c in zip(fresh, caches))
    others = [b for b in range(32) if b not in ids]
    assert all(bool((f[:, others] == 0).all()) for f in fresh)
    with pytest.raises(ValueError, match="checked against 32 blocks"):
        cuda.gather_blocks([c[:, :16] for c in caches], on_device, layout="HND")
    with pytest.raises(ValueError, match="must be distinct"):
        cuda.scatter_blocks(fresh, cuda.device_ids(ids, 32, caches[0].device), want, layout="HND")
