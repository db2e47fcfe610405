"""The stored block payload layout and the store namespace of a runner.

One block's payload (``docs/block_layout.md`` is the reference) holds the KV of
``block_tokens`` tokens for **all** layers and **all** KV heads, C order::

    [layer][k|v][kv_head][token][head_dim]     dtype = the KV dtype, little-endian

so, for one (layer, k|v), the KV heads ``[h0, h1)`` of any TP rank are one
contiguous byte range. A rank pages back only its heads with two byte ranges per
layer (k and v; :meth:`BlockLayout.group_ranges` for several layers at once), and a
block written at one TP size is read at any other.

The namespace (:class:`kvstore.common.keys.Namespace`) holds the model id, the dtype, this
layout's id, ``block_tokens``, the shape fields (layers, KV heads, head dim), the weights'
identity and the model config's fingerprint (RoPE base, norm epsilon, ...); it
deliberately leaves out the TP size.

What the layout and the namespace read of a runner is declared here as two protocols,
:class:`KVShape` (the architecture's KV shape) and :class:`StoreSettings` (the serving
fields that name the stored blocks); the reference runner's
``engine_adapter.reference.config.ModelConfig`` and ``EngineConfig`` satisfy them, so
this shared module never imports a plug-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvstore.common.keys import Namespace

from engine_adapter.model_identity import WeightsIdentity, model_extra

LAYOUT_ID = "layer.kv.head.token.dim/v1"


class KVShape(Protocol):
    """The architecture fields a block's layout depends on (e.g. ``reference.config.ModelConfig``).

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: KV heads of the whole model (not a TP rank's).
        head_dim: per-head width, elements.
    """

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class StoreSettings(Protocol):
    """The serving fields that name a runner's stored blocks (e.g. ``reference.config.EngineConfig``).

    Attributes:
        model_id: model id of the namespace.
        dtype: KV dtype name (``"float32"``, ``"bfloat16"``); torch_dtype: the same as a torch dtype.
        block_tokens: tokens per block.
        tenant: tenant salt of the namespace.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def torch_dtype(self) -> torch.dtype: ...

    @property
    def block_tokens(self) -> int: ...

    @property
    def tenant(self) -> str: ...


@dataclass(frozen=True)
class BlockLayout:
    """Sizes and byte offsets of the payload layout.

    Attributes:
        num_layers, num_kv_heads (all of them, not a rank's), block_tokens, head_dim: sizes.
        dtype: KV dtype.
    """

    num_layers: int
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: KVShape, engine: StoreSettings) -> "BlockLayout":
        """The layout of ``model``'s KV served with ``engine``'s block size and dtype."""
        return cls(model.num_layers, model.num_kv_heads, engine.block_tokens, model.head_dim, engine.torch_dtype)

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def head_bytes(self) -> int:
        """Bytes of one (layer, k|v, KV head): ``block_tokens * head_dim`` elements."""
        return self.block_tokens * self.head_dim * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of a whole block payload."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_bytes

    def block_shape(self, heads: int | None = None, layers: int | None = None) -> tuple[int, ...]:
        """``(layers, 2, heads, block_tokens, head_dim)`` of one block (defaults: all)."""
        return (self.num_layers if layers is None else layers, 2,
                self.num_kv_heads if heads is None else heads, self.block_tokens, self.head_dim)

    def layer_ranges(self, layer: int, heads: tuple[int, int]) -> list[tuple[int, int]]:
        """``(offset, length)`` byte ranges of KV heads ``[h0, h1)`` of ``layer``: k, then v.

        Fetched and concatenated, they form a ``(1, 2, h1 - h0, block_tokens, head_dim)``
        buffer. Raises ValueError for a layer or head range outside the layout.
        """
        h0, h1 = heads
        if not 0 <= layer < self.num_layers or not 0 <= h0 < h1 <= self.num_kv_heads:
            raise ValueError(f"layer {layer} / heads [{h0}, {h1}) outside the block layout")
        per_kv = self.num_kv_heads * self.head_bytes
        return [((layer * 2 + kv) * per_kv + h0 * self.head_bytes, (h1 - h0) * self.head_bytes)
                for kv in (0, 1)]

    def head_major_ranges(self, layer: int, heads: tuple[int, int]) -> list[tuple[int, int]]:
        """``(offset, length)`` byte ranges of KV heads ``[h0, h1)`` of ``layer``, head by head:
        head ``h0``'s k, its v, then head ``h0 + 1``'s k, ...

        Fetched and concatenated, they form a ``(h1 - h0, 2, block_tokens, head_dim)`` buffer:
        one block of vLLM's CPU cache layer (``engine_adapter.vllm.kv_views``, ``"cpu"``), so
        a page back can copy straight into it. Raises ValueError as :meth:`layer_ranges`.
        """
        (k, n), (v, _) = self.layer_ranges(layer, heads)
        hb = self.head_bytes
        return [(base + j * hb, hb) for j in range(n // hb) for base in (k, v)]

    def group_ranges(self, layers: tuple[int, int], heads: tuple[int, int]) -> list[tuple[int, int]]:
        """``(offset, length)`` byte ranges of KV heads ``[h0, h1)`` of layers ``[l0, l1)``.

        The k and v ranges of each layer in order (:meth:`layer_ranges`), with ranges
        that touch merged (all heads of consecutive layers are one range). Fetched and
        concatenated, they form a ``(l1 - l0, 2, h1 - h0, block_tokens, head_dim)``
        buffer. Raises ValueError for layers or heads outside the layout.
        """
        l0, l1 = layers
        if not 0 <= l0 < l1 <= self.num_layers:
            raise ValueError(f"layers [{l0}, {l1}) outside the block layout")
        merged: list[tuple[int, int]] = []
        for layer in range(l0, l1):
            for off, n in self.layer_ranges(layer, heads):
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
        return merged

    def to_payload(self, block: torch.Tensor) -> bytes:
        """Payload bytes of one block ``(num_layers, 2, num_kv_heads, block_tokens, head_dim)``.

        Raises ValueError for a wrong shape or dtype.
        """
        if tuple(block.shape) != self.block_shape() or block.dtype != self.dtype:
            raise ValueError(f"a block is {self.block_shape()} {self.dtype}, got {tuple(block.shape)} {block.dtype}")
        return block.contiguous().view(torch.uint8).numpy().tobytes()

    def copy_payload(self, data: bytes | memoryview, out: torch.Tensor) -> None:
        """Copy payload bytes (a whole block or the ranges of one request) into ``out``.

        ``out`` is a contiguous tensor of this layout's dtype whose byte size equals
        ``len(data)``. Raises ValueError when the sizes differ (a truncated or
        corrupt payload).
        """
        dst = out.view(torch.uint8).view(-1).numpy()
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != dst.size:
            raise ValueError(f"payload is {src.size} bytes, expected {dst.size}")
        dst[:] = src


def namespace(model: KVShape, engine: StoreSettings, *, weights: WeightsIdentity | None = None,
              model_config: str = "") -> Namespace:
    """The store namespace of a runner: model id, dtype, layout, block_tokens, tenant, the KV
    shape (layers, KV heads, head dim) and, when given, the weights' identity (``weights``)
    and a fingerprint of every model config field (``model_config``: RoPE base, norm
    epsilon, ...). The TP size is not part of it."""
    extra = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    extra.update(model_extra(weights or WeightsIdentity("", ""), model_config=model_config))
    return Namespace(model=engine.model_id, dtype=engine.dtype, layout=LAYOUT_ID,
                     block_tokens=engine.block_tokens, tenant=engine.tenant, extra=extra)
