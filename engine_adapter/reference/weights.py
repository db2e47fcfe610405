"""Weights of the reference runner: from a seed or a Hugging Face safetensors checkpoint,
split Megatron-style over TP ranks.

Tensor names are the Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight``
...), so a seeded model can be loaded into ``transformers.LlamaForCausalLM`` and a
checkpoint saved by ``save_pretrained`` can be loaded here.

Megatron splits (Shoeybi et al., 2019, "Megatron-LM", section 3) for TP rank ``r`` of
``T``; ``nn.Linear`` weights are ``(out_features, in_features)``:

=================  ============  ==========================================
weight             split         this rank keeps
=================  ============  ==========================================
q_proj             rows          query heads ``[r*Hq/T, (r+1)*Hq/T)``
k_proj, v_proj     rows          KV heads ``[r*Hkv/T, (r+1)*Hkv/T)``
o_proj             columns       the same query heads; output all-reduced
gate_proj, up_proj rows          ``[r*I/T, (r+1)*I/T)`` of the MLP width
down_proj          columns       the same slice; output all-reduced
embeddings, norms  replicated
lm_head            replicated    (a tiny vocab here; Megatron splits it by vocab)
=================  ============  ==========================================
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_adapter.model_identity import WeightsIdentity, fingerprint_checkpoint
from engine_adapter.reference.config import ModelConfig
from engine_adapter.reference.tp import shard_bounds


class TensorSource(Protocol):
    """Reads one (slice of a) named weight tensor, and names the weights for the store namespace."""

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``[start, end)`` slice along ``dim``, as float32 or its stored dtype."""
        ...

    def identity(self) -> WeightsIdentity:
        """What names these weights in the namespace (computed once, cheap)."""
        ...


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name and full shape."""
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * hd, d),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": (d, cfg.num_heads * hd),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
        })
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


class SeededWeights:
    """Deterministic random weights: tensor ``name`` is drawn from a generator seeded by
    ``SHA-256(seed, name)``, so it is the same on every TP rank, at every TP size and in
    any reading order. Matrices ~ N(0, ``init_std``); norm weights ~ 1 + N(0, 0.1)
    (not all ones, so a norm applied wrongly shows in the logits).
    """

    def __init__(self, cfg: ModelConfig, seed: int, init_std: float = 0.02):
        self.shapes = hf_shapes(cfg)
        self.seed = seed
        self.init_std = init_std

    def identity(self) -> WeightsIdentity:
        """``seed:<seed>/std=<init_std>``: the draw is a function of these (and of the shapes,
        which the namespace holds through the model config)."""
        return WeightsIdentity(f"seed:{self.seed}/std={self.init_std!r}", "seeded random weights")

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"no weight named {name!r}")
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        shape = self.shapes[name]
        if len(shape) == 1:
            full = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            full = self.init_std * torch.randn(shape, generator=gen)
        return full if dim is None else full.narrow(dim, start, (end or shape[dim]) - start)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights by Hugging Face name, float32 (for ``LlamaForCausalLM.load_state_dict``)."""
        return {name: self.read(name) for name in self.shapes}


class SafetensorsWeights:
    """Weights of a Hugging Face checkpoint folder (``*.safetensors``, sharded or not).

    Slices are read with ``safe_open(...).get_slice``, so a TP rank reads only its
    share of each split tensor from disk. The checkpoint's fingerprint
    (:func:`engine_adapter.model_identity.fingerprint_checkpoint`: headers and sampled
    bytes) is computed here, once.

    Raises:
        FileNotFoundError: the folder holds no ``.safetensors`` file.
        ValueError: a malformed safetensors header.
    """

    def __init__(self, path: str | pathlib.Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        root = pathlib.Path(path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: root / f for name, f in weight_map.items()}
        else:
            self.files = {}
            for f in sorted(root.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    self.files.update({name: f for name in fh.keys()})
        if not self.files:
            raise FileNotFoundError(f"no .safetensors weights in {str(root)!r}")
        self._identity = WeightsIdentity(*fingerprint_checkpoint(root))

    def identity(self) -> WeightsIdentity:
        return self._identity

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        with self._safe_open(str(self.files[name]), framework="pt") as fh:
            if dim is None:
                return fh.get_tensor(name)
            sl = fh.get_slice(name)
            stop = end if end is not None else sl.get_shape()[dim]
            return sl[start:stop] if dim == 0 else sl[:, start:stop]


@dataclass
class LayerWeights:
    """One decoder layer's weights on one TP rank (``q_r``/``kv_r`` heads, ``i_r`` MLP width).

    Attributes:
        attn_norm, mlp_norm: ``(hidden,)``.
        qkv: ``((q_r + 2*kv_r) * head_dim, hidden)``, rows q | k | v.
        o: ``(hidden, q_r * head_dim)``.
        gate_up: ``(2 * i_r, hidden)``, rows gate | up.
        down: ``(hidden, i_r)``.
    """

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class RankWeights:
    """A TP rank's weights: embedding ``(vocab, hidden)``, layers, final norm ``(hidden,)``,
    LM head ``(vocab, hidden)`` (the embedding itself when tied)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def load_rank_weights(cfg: ModelConfig, source: TensorSource, rank: int, world_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu") -> RankWeights:
    """Read TP rank ``rank``'s share of every weight (see the module docstring), cast to
    ``dtype``, on ``device``.

    Raises ValueError when heads or the MLP width do not split over ``world_size``,
    KeyError when a tensor is missing.
    """
    cfg.check_tp(world_size)
    hd = cfg.head_dim
    q0, q1 = shard_bounds(cfg.num_heads, rank, world_size)
    k0, k1 = shard_bounds(cfg.num_kv_heads, rank, world_size)
    i0, i1 = shard_bounds(cfg.intermediate_size, rank, world_size)

    def rd(name, dim=None, start=0, end=None):
        return source.read(name, dim, start, end).to(dtype=dtype, device=device).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([rd(p + "self_attn.q_proj.weight", 0, q0 * hd, q1 * hd),
                         rd(p + "self_attn.k_proj.weight", 0, k0 * hd, k1 * hd),
                         rd(p + "self_attn.v_proj.weight", 0, k0 * hd, k1 * hd)])
        gate_up = torch.cat([rd(p + "mlp.gate_proj.weight", 0, i0, i1),
                             rd(p + "mlp.up_proj.weight", 0, i0, i1)])
        layers.append(LayerWeights(
            attn_norm=rd(p + "input_layernorm.weight"),
            qkv=qkv,
            o=rd(p + "self_attn.o_proj.weight", 1, q0 * hd, q1 * hd),
            mlp_norm=rd(p + "post_attention_layernorm.weight"),
            gate_up=gate_up,
            down=rd(p + "mlp.down_proj.weight", 1, i0, i1),
        ))
    embed = rd("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else rd("lm_head.weight")
    return RankWeights(embed=embed, layers=layers, norm=rd("model.norm.weight"), lm_head=lm_head)
