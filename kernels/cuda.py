"""CUDA gather/scatter between paged KV caches and block buffers (CuPy RawKernel).

Same signatures, checks, errors and results as :mod:`kernels.reference` (the tests
compare them bit for bit); the layouts are drawn in that module's docstring. One
kernel launch moves every selected layer, block, K/V half, head and token:

    thread idx -> (i block, j layer, kv, h head, t token, u unit of the head_dim row)
    buffer unit  buf[idx]                                  (contiguous, in order)
    cache unit   layer_ptr[j] + kv*s_kv + block_ids[i]*s_blk + t*s_tok + (h0+h)*s_head + u*s_dim

with every stride in bytes and per layer, so NHD and HND differ only in which
stride is the token's and which the head's, and non-contiguous layer caches work.
The copy is bitwise, in units of 16, 8, 4, 2 or 1 bytes: the widest that divides
the row, every stride and every base address (fp16 with head_dim 128 moves 16-byte
vectors). Kernels run on torch's current stream of the caches' device, so they
are ordered with the caller's torch work, and a launch never makes the host wait for
the device: block ids given as a list or host tensor are checked on the host, and the
kernel's argument arrays go to the device from pinned memory without a sync (a forward
pass that saves or loads KV per layer keeps queueing its kernels ahead of the GPU).

Import needs no GPU; calling needs CuPy and CUDA tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from kernels import reference

_UNIT_TYPES = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_THREADS = 256
_MAX_GRID = 1 << 16   # grid-stride loop beyond this

_SOURCE = r"""
extern "C" __global__ void kv_copy(
    const unsigned long long layer_ptrs,     // (L,) int64 base addresses of the selected layer caches
    const unsigned long long layer_strides,  // (L, 5) int64 byte strides: kv, block, token, head, unit
    const unsigned long long block_ids,      // (n,) int64 cache block ids
    const unsigned long long buf,            // (n, L, 2, H, bs, row_units) units, contiguous
    const long long n, const int L, const int H, const int bs, const int row_units,
    const long long head0, const int to_cache)
{
    typedef UNIT unit_t;
    const long long* ptrs = (const long long*)layer_ptrs;
    const long long* strides = (const long long*)layer_strides;
    const long long* ids = (const long long*)block_ids;
    unit_t* b = (unit_t*)buf;
    const long long total = n * L * 2 * (long long)H * bs * row_units;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)blockDim.x * gridDim.x) {
        long long r = idx;
        const long long u = r % row_units; r /= row_units;
        const long long t = r % bs; r /= bs;
        const long long h = r % H; r /= H;
        const long long kv = r % 2; r /= 2;
        const int j = (int)(r % L);
        const long long i = r / L;
        const long long* s = strides + 5 * j;
        char* c = (char*)ptrs[j] + kv * s[0] + ids[i] * s[1] + t * s[2] + (head0 + h) * s[3] + u * s[4];
        if (to_cache) {
            *(unit_t*)c = b[idx];
        } else {
            b[idx] = *(const unit_t*)c;
        }
    }
}
"""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when CuPy imports (the kernels' compiler and launcher). Cached."""
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernel(unit: int):
    import cupy

    return cupy.RawKernel(_SOURCE.replace("UNIT", _UNIT_TYPES[unit]), "kv_copy")


def _byte_strides(cache: torch.Tensor, layout: str) -> list[int]:
    """Byte strides (kv, block, token, head, dim) of one layer cache."""
    esz = cache.element_size()
    s = [x * esz for x in cache.stride()]
    kv, blk, a, b, dim = s
    token, head = (a, b) if layout == "NHD" else (b, a)
    return [kv, blk, token, head, dim]


def _pick_unit(caches: Sequence[torch.Tensor], strides: list[list[int]], buf: torch.Tensor,
               head_dim: int) -> int:
    """Widest copy unit in bytes that divides every row, stride and base address."""
    esz = buf.element_size()
    if any(s[4] != esz for s in strides):          # head_dim not contiguous: element by element
        return esz
    values = [head_dim * esz, buf.data_ptr()]
    for c, s in zip(caches, strides):
        values.append(c.data_ptr())
        values.extend(s[:4])
    for unit in (16, 8, 4, 2):
        if all(v % unit == 0 for v in values):
            return unit
    return 1


@dataclass(frozen=True)
class LaunchPlan:
    """Arguments of one ``kv_copy`` launch (all sizes in copy units, strides in bytes).

    ``strides[j]`` is ``[kv, block, token, head, unit step]`` of selected layer ``j``;
    ``total`` threads' worth of units, ``grid`` blocks of ``_THREADS`` threads.
    """

    unit: int
    row_units: int
    ptrs: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    n: int
    num_layers: int
    num_heads: int
    block_size: int
    head0: int
    total: int
    grid: int


def plan_launch(caches: Sequence[torch.Tensor], layer_ids: Sequence[int], h0: int, layout: str,
                buf: torch.Tensor) -> LaunchPlan:
    """Work out a launch for block buffer ``buf`` ``(n, L, 2, H, bs, head_dim)`` (contiguous).

    Pure host arithmetic on pointers and strides: the CPU tests run it and emulate the
    kernel's address formula with it.
    """
    n, L, _, H, bs, hd = buf.shape
    sel = [caches[l] for l in layer_ids]
    strides = [_byte_strides(c, layout) for c in sel]
    unit = _pick_unit(sel, strides, buf, hd)
    esz = buf.element_size()
    if all(s[4] == esz for s in strides):
        for s in strides:
            s[4] = unit          # contiguous rows: step one unit; else keep the element stride
    row_units = hd * esz // unit
    total = n * L * 2 * H * bs * row_units
    return LaunchPlan(unit=unit, row_units=row_units, ptrs=tuple(c.data_ptr() for c in sel),
                      strides=tuple(tuple(s) for s in strides), n=n, num_layers=L, num_heads=H,
                      block_size=bs, head0=h0, total=total, grid=min(-(-total // _THREADS), _MAX_GRID))


def _on_stream(stream: torch.cuda.Stream, index: int):
    """CuPy's handle of torch's current stream: ``Stream.from_external`` (CuPy >= 14, through the
    CUDA stream protocol), else ``ExternalStream`` (deprecated in CuPy 14)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, index)


def _launch(caches: Sequence[torch.Tensor], layer_ids: list[int], idx: torch.Tensor, h0: int,
            layout: str, buf: torch.Tensor, to_cache: bool) -> None:
    import cupy

    if buf.numel() == 0:
        return
    device = caches[0].device
    p = plan_launch(caches, layer_ids, h0, layout, buf)
    stream = torch.cuda.current_stream(device)
    ptrs, strides = _launch_args(p, device, stream)
    ids = idx.to(device=device, dtype=torch.int64).contiguous()
    with cupy.cuda.Device(device.index), _on_stream(stream, device.index):
        _kernel(p.unit)((p.grid,), (_THREADS,), (
            cupy.uint64(ptrs.data_ptr()), cupy.uint64(strides.data_ptr()), cupy.uint64(ids.data_ptr()),
            cupy.uint64(buf.data_ptr()), cupy.int64(p.n), cupy.int32(p.num_layers),
            cupy.int32(p.num_heads), cupy.int32(p.block_size), cupy.int32(p.row_units),
            cupy.int64(p.head0), cupy.int32(1 if to_cache else 0)))


_ARGS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
ARGS_KEPT = 4096
"""Launch argument arrays kept on the device (per stream, layer pointers and strides): a
serving engine's caches never move, so each layer's arrays are copied once."""


def _launch_args(p: LaunchPlan, device: torch.device, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_copy``'s int64 arrays of layer pointers and strides on ``device``, copied on
    ``stream`` (so they precede its launches; kept per stream and never freed while kept, up
    to :data:`ARGS_KEPT`; beyond, made per launch: a tensor freed after the launch is reused
    only by later work on this stream)."""
    key = (stream.cuda_stream, p.ptrs, p.strides)
    got = _ARGS.get(key)
    if got is None:
        got = (to_device(torch.tensor(p.ptrs, dtype=torch.int64), device),
               to_device(torch.tensor(p.strides, dtype=torch.int64), device))
        if len(_ARGS) < ARGS_KEPT:
            _ARGS[key] = got
    return got


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private copy of ``t`` on ``device``. From the host it is queued on the current stream
    without the host waiting: through a pinned copy of ``t`` made here (never ``t``'s own
    memory, which its owner may rewrite before the stream reaches the copy), which torch's
    host allocator keeps until the copy has run. A tensor already on ``device`` is returned as
    is; one on another device is copied there."""
    if t.device == device:
        return t
    if t.device.type != "cpu":
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


def _checked(block_ids, num_blocks: int) -> torch.Tensor:
    """``block_ids`` as a 1-D int64 tensor, checked against ``num_blocks``: on the host for a
    list or host tensor, on its device for a device tensor (the host waits for it), as is for
    :class:`~kernels.reference.DeviceIds` (:func:`kernels.reference.block_index` takes them)."""
    on_device = isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu"
    return reference.block_index(block_ids, num_blocks, block_ids.device if on_device else "cpu")


def _check_distinct(block_ids, idx: torch.Tensor) -> None:
    if isinstance(block_ids, reference.DeviceIds):
        if not block_ids.distinct:
            raise ValueError("destination block ids must be distinct (these were not checked for it)")
    elif idx.numel() != torch.unique(idx).numel():
        raise ValueError("destination block ids must be distinct")


def device_index(block_ids, num_blocks: int, device: torch.device, distinct: bool = False) -> torch.Tensor:
    """``block_ids`` as a 1-D int64 tensor on ``device`` (:func:`kernels.reference.block_index`'s
    checks, and with ``distinct`` no id twice). Ids given as a list or host tensor are checked
    on the host and copied without a sync; a device tensor is checked where it is (the host
    waits for it).

    Raises ValueError for an id outside ``[0, num_blocks)``, ids not 1-D, or (``distinct``)
    a repeated id.
    """
    idx = _checked(block_ids, num_blocks)
    if distinct:
        _check_distinct(block_ids, idx)
    return to_device(idx, device)


def device_ids(block_ids, num_blocks: int, device: torch.device, distinct: bool = False) -> reference.DeviceIds:
    """``block_ids`` checked (as :func:`device_index`) and copied to ``device`` on the current
    stream once, for the launches of many layers on that stream (use them on no other stream:
    nothing orders the copy before another stream's launches). Raises as :func:`device_index`."""
    return reference.DeviceIds(device_index(block_ids, num_blocks, device, distinct), num_blocks, distinct)


def _check_cuda(caches: Sequence[torch.Tensor]) -> None:
    for c in caches:
        if not c.is_cuda or c.device != caches[0].device:
            raise ValueError("the CUDA kernels need every layer cache on one CUDA device")


def gather_blocks(caches: Sequence[torch.Tensor], block_ids, *, heads: tuple[int, int] | None = None,
                  layers: Sequence[int] | None = None, layout: str = "NHD",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA twin of :func:`kernels.reference.gather_blocks` (same arguments and result).

    ``out`` may live anywhere (e.g. pinned host memory): when it is not a contiguous
    tensor on the caches' device the blocks are gathered into a temporary there and
    copied into it.
    Raises:
        ValueError: as the reference, and for caches not all on one CUDA device.
    """
    layer_ids, h0, h1, nb, bs, hd = reference.resolve_selection(caches, layers, heads, layout)
    _check_cuda(caches)
    device = caches[0].device
    idx = device_index(block_ids, nb, device)
    shape = (idx.numel(), len(layer_ids), 2, h1 - h0, bs, hd)
    dtype = caches[0].dtype
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(f"out must be {shape} {dtype}, got {tuple(out.shape)} {out.dtype}")
    direct = out is not None and out.device == device and out.is_contiguous()
    buf = out if direct else torch.empty(shape, dtype=dtype, device=device)
    _launch(caches, layer_ids, idx, h0, layout, buf, to_cache=False)
    if out is None:
        return buf
    if not direct:
        out.copy_(buf)
    return out


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids, src: torch.Tensor, *,
                   heads: tuple[int, int] | None = None, layers: Sequence[int] | None = None,
                   layout: str = "NHD") -> None:
    """CUDA twin of :func:`kernels.reference.scatter_blocks` (same arguments and effect).

    ``src`` may live anywhere; it is copied to the caches' device first when needed.
    Raises:
        ValueError: as the reference, and for caches not all on one CUDA device.
    """
    layer_ids, h0, h1, nb, bs, hd = reference.resolve_selection(caches, layers, heads, layout)
    _check_cuda(caches)
    device = caches[0].device
    checked = _checked(block_ids, nb)                 # the reference's order of checks
    shape = (checked.numel(), len(layer_ids), 2, h1 - h0, bs, hd)
    if tuple(src.shape) != shape or src.dtype != caches[0].dtype:
        raise ValueError(f"src must be {shape} {caches[0].dtype}, got {tuple(src.shape)} {src.dtype}")
    _check_distinct(block_ids, checked)
    idx = to_device(checked, device)
    if len(set(layer_ids)) != len(layer_ids):
        # a layer listed twice: the reference's sequential "last one wins" is not a race
        reference.scatter_blocks(caches, idx, src, heads=heads, layers=layers, layout=layout)
        return
    # a host src is copied before this returns (its owner may reuse it at once); a caller that
    # wants no wait copies it to the device itself (non_blocking, from memory it leaves alone)
    buf = src.to(device).contiguous()
    _launch(caches, layer_ids, idx, h0, layout, buf, to_cache=True)
