"""Torch reference of the gather/scatter between a paged KV cache and block buffers.

Paged cache of one layer (vLLM's layout), either stride order:

    NHD: (2, num_blocks, block_size, num_heads, head_dim)    # k|v, block, token, head, dim
    HND: (2, num_blocks, num_heads, block_size, head_dim)

Store block buffer (``docs/block_layout.md``), per block and for the selected layers
and heads::

    (num_layers_sel, 2, num_heads_sel, block_size, head_dim)   # [layer][k|v][head][token][dim]

so a batch of ``n`` blocks is ``(n, num_layers_sel, 2, num_heads_sel, block_size, head_dim)``.

These are the semantics the CUDA kernels (:mod:`kernels.cuda`) must reproduce exactly;
the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

LAYOUTS = ("NHD", "HND")


def _check(caches: Sequence[torch.Tensor], layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not caches:
        raise ValueError("at least one layer cache is needed")
    shape = caches[0].shape
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"a layer cache must be (2, num_blocks, ...) with 5 dims, got {tuple(shape)}")
    for c in caches:
        if c.shape != shape or c.dtype != caches[0].dtype:
            raise ValueError("all layer caches must share shape and dtype")


def _dims(cache: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_heads, head_dim) of one layer cache."""
    if layout == "NHD":
        _, nb, bs, nh, hd = cache.shape
    else:
        _, nb, nh, bs, hd = cache.shape
    return nb, bs, nh, hd


def num_blocks(cache: torch.Tensor, layout: str) -> int:
    """Blocks of one layer cache in ``layout`` (``"NHD"`` or ``"HND"``)."""
    return _dims(cache, layout)[0]


def resolve_selection(caches: Sequence[torch.Tensor], layers: Sequence[int] | None,
                      heads: tuple[int, int] | None, layout: str) -> tuple[list[int], int, int, int, int, int]:
    """Check a gather/scatter's caches and selection; the CUDA kernels share it (same errors).

    Returns ``(layer_ids, h0, h1, num_blocks, block_size, head_dim)`` with the defaults
    (all layers, all heads) filled in. Raises ValueError for a bad layout, cache shapes,
    or a layer or head outside the caches.
    """
    _check(caches, layout)
    nb, bs, nh, hd = _dims(caches[0], layout)
    layer_ids = range(len(caches)) if layers is None else layers
    for l in layer_ids:
        if not 0 <= l < len(caches):
            raise ValueError(f"layer {l} outside [0, {len(caches)})")
    h0, h1 = (0, nh) if heads is None else heads
    if not 0 <= h0 < h1 <= nh:
        raise ValueError(f"head range [{h0}, {h1}) outside [0, {nh})")
    return list(layer_ids), h0, h1, nb, bs, hd


@dataclass(frozen=True, eq=False)
class DeviceIds:
    """Block ids checked once and kept on a device, for the launches of many layers (a step's
    saves or loads): no check, copy or host sync per launch. Made by
    :func:`kernels.cuda.device_ids`; accepted wherever ``block_ids`` is.

    ``ids``: ``(n,)`` int64 on the device; every id is in ``[0, num_blocks)`` and, with
    ``distinct``, none is repeated. They were copied on one stream: launches on another are
    not ordered after that copy.
    """

    ids: torch.Tensor
    num_blocks: int
    distinct: bool


def block_index(block_ids, num_blocks: int, device) -> torch.Tensor:
    """``block_ids`` as a 1-D int64 tensor on ``device``; the CUDA kernels share it.

    Raises ValueError unless every id is in ``[0, num_blocks)`` (a :class:`DeviceIds` checked
    against at most ``num_blocks`` is taken as it is, on its own device).
    """
    if isinstance(block_ids, DeviceIds):
        if block_ids.num_blocks > num_blocks:
            raise ValueError(f"block ids checked against {block_ids.num_blocks} blocks, the cache has {num_blocks}")
        return block_ids.ids
    idx = torch.as_tensor(block_ids, dtype=torch.long, device=device)
    if idx.ndim != 1:
        raise ValueError("block_ids must be 1-D")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_blocks):
        raise ValueError(f"block id outside [0, {num_blocks})")
    return idx


def gather_blocks(caches: Sequence[torch.Tensor], block_ids, *, heads: tuple[int, int] | None = None,
                  layers: Sequence[int] | None = None, layout: str = "NHD",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks out of a paged cache into the store's block layout.

    Args:
        caches: one tensor per layer, shape as in the module docstring, any dtype.
        block_ids: ``(n,)`` cache block indices (any order, repeats allowed).
        heads: ``[h0, h1)`` of the cache's heads to take (default all).
        layers: which layers (indices into ``caches``) to take, in order (default all).
        layout: ``"NHD"`` or ``"HND"``, the cache's stride order.
        out: optional destination ``(n, L, 2, H, block_size, head_dim)``, same dtype/device.
    Returns:
        ``(n, L, 2, H, block_size, head_dim)`` contiguous tensor (``out`` when given).
    Raises:
        ValueError: bad layout, shapes, block ids, layer or head ranges.
    """
    layer_ids, h0, h1, nb, bs, hd = resolve_selection(caches, layers, heads, layout)
    idx = block_index(block_ids, nb, caches[0].device)
    shape = (idx.numel(), len(layer_ids), 2, h1 - h0, bs, hd)
    if out is None:
        out = torch.empty(shape, dtype=caches[0].dtype, device=caches[0].device)
    elif tuple(out.shape) != shape or out.dtype != caches[0].dtype:
        raise ValueError(f"out must be {shape} {caches[0].dtype}, got {tuple(out.shape)} {out.dtype}")
    for j, l in enumerate(layer_ids):
        # (2, n, ...); select along dim 0 of the transpose: index_select(1) on a permuted view
        # (vLLM's CPU and flash-attn caches) copied the whole cache
        sel = caches[l].transpose(0, 1).index_select(0, idx).transpose(0, 1)
        if layout == "NHD":
            sel = sel[:, :, :, h0:h1, :].permute(1, 0, 3, 2, 4)   # (n, 2, H, bs, hd)
        else:
            sel = sel[:, :, h0:h1, :, :].permute(1, 0, 2, 3, 4)
        out[:, j].copy_(sel)
    return out


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids, src: torch.Tensor, *,
                   heads: tuple[int, int] | None = None, layers: Sequence[int] | None = None,
                   layout: str = "NHD") -> None:
    """Copy block buffers into a paged cache (the inverse of :func:`gather_blocks`).

    Args:
        src: ``(n, L, 2, H, block_size, head_dim)`` with ``H = h1 - h0`` and ``L = len(layers)``.
        block_ids: ``(n,)`` destination cache block indices (distinct).
        Other arguments as in :func:`gather_blocks`.
    Raises:
        ValueError: shape/dtype mismatch, bad ids or ranges, repeated destination blocks.
    """
    layer_ids, h0, h1, nb, bs, hd = resolve_selection(caches, layers, heads, layout)
    idx = block_index(block_ids, nb, caches[0].device)
    shape = (idx.numel(), len(layer_ids), 2, h1 - h0, bs, hd)
    if tuple(src.shape) != shape or src.dtype != caches[0].dtype:
        raise ValueError(f"src must be {shape} {caches[0].dtype}, got {tuple(src.shape)} {src.dtype}")
    if idx.numel() != torch.unique(idx).numel():
        raise ValueError("destination block ids must be distinct")
    for j, l in enumerate(layer_ids):
        blk = src[:, j]                                      # (n, 2, H, bs, hd)
        if layout == "NHD":
            caches[l][:, idx, :, h0:h1, :] = blk.permute(1, 0, 3, 2, 4).to(caches[l].device)
        else:
            caches[l][:, idx, h0:h1, :, :] = blk.permute(1, 0, 2, 3, 4).to(caches[l].device)
