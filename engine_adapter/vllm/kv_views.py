"""Views of vLLM's per-layer KV cache tensors in the shape ``kernels`` gather from and scatter to.

``kernels.gather_blocks`` / ``scatter_blocks`` take one tensor per layer of shape
``(2, num_blocks, num_kv_heads, block_size, head_dim)`` ("HND") or
``(2, num_blocks, block_size, num_kv_heads, head_dim)`` ("NHD"). vLLM hands the
connector other shapes; each is turned into such a *view* (no copy, writes land in
vLLM's cache):

``token``  (vLLM >= 0.32 GPU backends, e.g. flash-attn)
    logical ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)`` whose last axis is
    ``[k | v]`` of one token (any physical stride order): ``k = kv[..., :head_dim]``.
``cpu``    (vLLM's CPU backend)
    the same logical shape, but the memory of one (block, KV head) is all the block's
    keys, then all its values, and the keys' ``(token, dim)`` interior is in the CPU
    kernel's own order (measured: transposed for the fp32 ``vec`` kernel). The view
    therefore copies each (block, head, k|v) region verbatim; such blocks are only
    valid for the same CPU kernel, which the namespace records (``kv_format``).
``kv_first`` (older flash-attn) ``(2, num_blocks, block_size, num_kv_heads, head_dim)``.
"""

from __future__ import annotations

import torch

KV_LAYOUTS = ("token", "cpu", "kv_first")


def detect_layout(kv: torch.Tensor) -> str:
    """The layout name of a vLLM layer cache: 4-D on CPU is ``cpu``, 4-D elsewhere ``token``,
    5-D with a leading 2 ``kv_first``. Raises ValueError for anything else."""
    if kv.dim() == 4:
        return "cpu" if kv.device.type == "cpu" else "token"
    if kv.dim() == 5 and kv.shape[0] == 2:
        return "kv_first"
    raise ValueError(f"unsupported vLLM KV cache shape {tuple(kv.shape)}")


def kernel_view(kv: torch.Tensor, layout: str, head_dim: int) -> tuple[torch.Tensor, str]:
    """``(view, kernels_layout)`` of one layer cache for ``kernels.gather/scatter_blocks``.

    Raises ValueError when the tensor does not have the layout's shape or cannot be
    viewed without a copy.
    """
    if layout == "token":
        if kv.dim() != 4 or kv.shape[-1] != 2 * head_dim:
            raise ValueError(f"'token' layout needs (blocks, heads, block_size, {2 * head_dim}), got {tuple(kv.shape)}")
        return kv.unflatten(-1, (2, head_dim)).permute(3, 0, 1, 2, 4), "HND"
    if layout == "cpu":
        if kv.dim() != 4 or kv.shape[-1] != 2 * head_dim:
            raise ValueError(f"'cpu' layout needs (blocks, heads, block_size, {2 * head_dim}), got {tuple(kv.shape)}")
        nb, nh, bs, _ = kv.shape
        try:
            view = kv.view(nb, nh, 2, bs, head_dim)
        except RuntimeError as e:
            raise ValueError(f"a 'cpu' layout cache must be contiguous per (block, head): {e}") from None
        return view.permute(2, 0, 1, 3, 4), "HND"
    if layout == "kv_first":
        if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[-1] != head_dim:
            raise ValueError(f"'kv_first' layout needs (2, blocks, block_size, heads, {head_dim}), got {tuple(kv.shape)}")
        return kv, "NHD"
    raise ValueError(f"KV layout must be one of {KV_LAYOUTS}, got {layout!r}")
