"""Shared cases for the kernel tests: random paged caches and a naive per-row copy."""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def make_caches(num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                layout: str, dtype: torch.dtype, device="cpu", seed: int = 0,
                strided: bool = False) -> list[torch.Tensor]:
    """Random layer caches. ``strided``: each is a permuted view of a ``(num_blocks, 2, ...)``
    tensor (FlashInfer-like), so k|v is not the outermost stride."""
    g = torch.Generator().manual_seed(seed)
    inner = (block_size, num_heads, head_dim) if layout == "NHD" else (num_heads, block_size, head_dim)
    caches = []
    for _ in range(num_layers):
        if strided:
            base = torch.randn((num_blocks, 2) + inner, generator=g).to(dtype)
            caches.append(base.to(device).transpose(0, 1))
        else:
            caches.append(torch.randn((2, num_blocks) + inner, generator=g).to(dtype).to(device))
    return caches


def naive_gather(caches, block_ids, heads, layers, layout):
    """``(n, L, 2, H, bs, hd)`` built one (block, layer, kv, head, token) row at a time."""
    c0 = caches[0]
    if layout == "NHD":
        _, _, bs, nh, hd = c0.shape
    else:
        _, _, nh, bs, hd = c0.shape
    h0, h1 = heads if heads is not None else (0, nh)
    layer_ids = list(range(len(caches))) if layers is None else list(layers)
    out = torch.empty((len(block_ids), len(layer_ids), 2, h1 - h0, bs, hd), dtype=c0.dtype)
    for i, b in enumerate(block_ids):
        for j, l in enumerate(layer_ids):
            for kv in range(2):
                for h in range(h0, h1):
                    for t in range(bs):
                        row = caches[l][kv, b, t, h] if layout == "NHD" else caches[l][kv, b, h, t]
                        out[i, j, kv, h - h0, t] = row.cpu()
    return out


def naive_scatter(caches, block_ids, src, heads, layers, layout):
    """In place, one row at a time: the inverse of :func:`naive_gather`."""
    nh = caches[0].shape[3] if layout == "NHD" else caches[0].shape[2]
    h0, h1 = heads if heads is not None else (0, nh)
    layer_ids = list(range(len(caches))) if layers is None else list(layers)
    bs = src.shape[4]
    for i, b in enumerate(block_ids):
        for j, l in enumerate(layer_ids):
            for kv in range(2):
                for h in range(h0, h1):
                    for t in range(bs):
                        row = src[i, j, kv, h - h0, t]
                        if layout == "NHD":
                            caches[l][kv, b, t, h] = row
                        else:
                            caches[l][kv, b, h, t] = row
