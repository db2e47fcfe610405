"""Frozen configs of the reference runner: the model architecture and the engine settings.

:class:`ModelConfig` is the architecture (what a Hugging Face ``config.json`` of a
Llama model says); :class:`EngineConfig` is how one runner serves it (dtype, paged
cache size, block size, page-back timeouts). Both are validated once, in
``__post_init__``, and passed down frozen. They are what the shared block layout reads
of a runner (:class:`engine_adapter.layout.KVShape` and
:class:`engine_adapter.layout.StoreSettings`).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        hidden_size: residual stream width.
        intermediate_size: SwiGLU inner width (gate and up projections).
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: KV heads (``num_heads`` must be a multiple: grouped-query attention).
        head_dim: per-head width.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (only the original, unscaled RoPE is supported).
        tie_word_embeddings: the LM head reuses the embedding matrix.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def fingerprint(self) -> str:
        """Short hex digest of every field: part of the model id of seeded weights."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless heads, KV heads and the MLP split evenly over ``tp_size`` ranks."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % tp_size:
                raise ValueError(f"{name}={getattr(self, name)} does not split over TP size {tp_size}")

    @classmethod
    def from_hf(cls, data: dict) -> "ModelConfig":
        """From a Hugging Face ``LlamaConfig`` dict (``config.json``).

        Raises ValueError for a rope scaling other than the default (e.g. ``llama3``),
        biases in attention/MLP, or an activation other than SiLU.
        """
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
        if data.get("attention_bias") or data.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported (only 'silu')")
        heads = data["num_attention_heads"]
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_layers=data["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_checkpoint(cls, path: str | pathlib.Path) -> "ModelConfig":
        """Read ``config.json`` of a Hugging Face checkpoint folder. Raises OSError, ValueError."""
        return cls.from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()))

    def to_hf(self) -> dict:
        """Keyword arguments for ``transformers.LlamaConfig`` describing the same model."""
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=False, mlp_bias=False,
            hidden_act="silu",
        )


@dataclass(frozen=True)
class EngineConfig:
    """How one runner serves a model.

    Attributes:
        model_id: names the model in the store namespace (two runners share blocks only
            when their ``model_id``, ``dtype``, layout, ``block_tokens``, weights (seed or
            checkpoint fingerprint) and model config match).
        dtype: weights, activations and KV dtype: ``"float32"`` or ``"bfloat16"``.
        block_tokens: tokens per paged-cache block and per store block.
        num_cache_blocks: blocks in each TP rank's paged KV cache.
        max_prefill_tokens: prefill is run in chunks of at most this many tokens
            (bounds the attention score memory of long prompts).
        tenant: tenant salt of the store namespace.
        load_timeout_s: a page back that has not delivered a layer this many seconds
            after it started gives up on it; the tokens are recomputed.
        store_timeout_s: deadline of each load and store call (get, put), seconds.
        lookup_timeout_s: deadline of the lookup before a prefill, seconds (the most a
            store that is slow or gone adds to the prefill, once per outage).
        store_backoff_s, store_max_backoff_s: after a store call failed, the store is not
            called (lookups miss, loads are recomputed, stores are dropped) until it answers
            a probe; probes wait ``store_backoff_s``, doubling up to ``store_max_backoff_s``
            seconds (:class:`engine_adapter.breaker.BreakerSettings`).
        max_pending_stores: background store jobs queued at most; at TP=1 a new job finding
            the queue full is dropped (counted), at TP>1 it waits (every rank's writer
            takes part in each job's head gather, so the ranks must agree on the jobs).
        device: torch device of weights and the paged cache (``"cpu"``, ``"cuda"``,
            ``"cuda:1"``). At TP>1 on GPUs each rank uses ``cuda:<rank>`` and NCCL.
    """

    model_id: str = "tiny-llama"
    dtype: str = "float32"
    block_tokens: int = 16
    num_cache_blocks: int = 256
    max_prefill_tokens: int = 2048
    tenant: str = ""
    load_timeout_s: float = 10.0
    store_timeout_s: float = 10.0
    lookup_timeout_s: float = 0.05
    store_backoff_s: float = 0.1
    store_max_backoff_s: float = 1.0
    max_pending_stores: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_tokens", "num_cache_blocks", "max_prefill_tokens", "max_pending_stores"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("load_timeout_s", "store_timeout_s", "lookup_timeout_s", "store_backoff_s",
                     "store_max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0 seconds")
        if self.store_max_backoff_s < self.store_backoff_s:
            raise ValueError("EngineConfig.store_max_backoff_s must be at least store_backoff_s")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
