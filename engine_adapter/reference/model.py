"""The Llama-architecture decoder of one TP rank, attending over a paged KV cache.

Same math as Hugging Face ``LlamaForCausalLM`` (Touvron et al., 2023): pre-norm
RMSNorm (computed in float32, as HF does), rotary position embeddings with the
``rotate_half`` convention (Su et al., 2021), grouped-query attention (Ainslie et al.,
2023), SwiGLU MLP (Shazeer, 2020). Tensor parallelism is Megatron's (see
:mod:`engine_adapter.reference.weights`): each rank computes its query/KV heads and MLP slice;
the attention output projection and the MLP down projection are summed over ranks
by an all-reduce, two per layer.

One call of :meth:`LlamaModel.forward` runs ``n`` consecutive tokens of one sequence
(a prefill chunk, or one decode token): their K/V go into the paged cache, then
their queries attend to every cached position up to their own (causal).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from engine_adapter.reference.config import ModelConfig
from engine_adapter.reference.paged_cache import PagedKVCache, Sequence
from engine_adapter.reference.tp import TPGroup
from engine_adapter.reference.weights import RankWeights

LayerHook = Callable[[int], None]
"""Called with the layer index after that layer's QKV projection and before its
attention reads the cache (the page-back wait point). It may raise to abort the pass."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, cast back, then scaled (HF order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """One TP rank's share of the decoder.

    Args:
        cfg: architecture.
        weights: this rank's weights (:func:`engine_adapter.reference.weights.load_rank_weights`).
        tp: this rank's collectives.
    """

    def __init__(self, cfg: ModelConfig, weights: RankWeights, tp: TPGroup):
        cfg.check_tp(tp.world_size)
        self.cfg = cfg
        self.w = weights
        self.tp = tp
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.q_heads = cfg.num_heads // tp.world_size
        self.kv_heads = cfg.num_kv_heads // tp.world_size
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device)
                                                  / hd))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` ``(n,)``: each ``(n, 1, head_dim)`` in the model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return t
        if t.dtype == torch.float32:
            return self.tp.all_reduce_sum_(t)
        return self.tp.all_reduce_sum_(t.float()).to(t.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, seq: Sequence, cache: PagedKVCache,
                hook: LayerHook | None = None, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions ``[start, start + n)`` of ``seq``; write their KV to ``cache``.

        ``seq.block_table`` must already cover ``start + n`` tokens, and positions
        ``[0, start)`` must be in the cache (computed earlier or paged back) by the
        time ``hook(layer)`` returns for each layer.

        Args:
            tokens: ``(n,)`` int64 token ids on the model's device.
            start: position of ``tokens[0]`` (tokens before it are read from the cache).
            hook: see :data:`LayerHook`.
            all_logits: return logits of every position, else of the last only.
        Returns:
            float32 logits, ``(n, vocab_size)`` or ``(vocab_size,)``, identical on every rank.
        """
        cfg, w = self.cfg, self.w
        n = tokens.numel()
        end = start + n
        hd, hq, hkv = cfg.head_dim, self.q_heads, self.kv_heads
        positions = torch.arange(start, end, device=self.device)
        cos, sin = self.rope(positions)
        slots = cache.slots(seq, start, end)
        mask = None
        if n > 1:
            mask = torch.arange(end, device=self.device)[None, :] <= positions[:, None]   # (n, end): causal
        x = F.embedding(tokens, w.embed)                                  # (n, hidden)
        for li, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, lw.qkv)
            q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
            q = q.view(n, hq, hd)
            k = k.view(n, hkv, hd)
            v = v.view(n, hkv, hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if hook is not None:
                hook(li)
            cache.write(li, slots, k, v)
            kc, vc = cache.context(li, seq, end)                          # (end, hkv, hd)
            attn = F.scaled_dot_product_attention(                       # query head h reads
                q.transpose(0, 1)[None], kc.transpose(0, 1)[None],        # KV head h // rep
                vc.transpose(0, 1)[None], attn_mask=mask, enable_gqa=hq != hkv)   # (1, hq, n, hd)
            o = F.linear(attn[0].transpose(0, 1).reshape(n, hq * hd), lw.o)
            x = x + self._all_reduce(o)
            h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)
            x = x + self._all_reduce(F.linear(F.silu(gate) * up, lw.down))
        if not all_logits:
            x = x[-1:]
        logits = F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head).float()
        return logits if all_logits else logits[0]
