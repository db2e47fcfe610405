"""Settings of the vLLM connector (``kv_connector_extra_config``) and its store namespace.

The namespace is read from vLLM's ``VllmConfig`` (vLLM 0.32 field names): the weights'
identity (``model_config.model``, ``.revision``, ``load_config.load_format`` /
``.download_dir``; :mod:`engine_adapter.model_identity`), the attention fields of
``model_config.hf_text_config`` (RoPE parameters, sliding window, KV shape ...) and
``model_config.hf_overrides``, ``model_config.quantization``, the KV dtype
(``cache_config.cache_dtype``, with the model dtype when they differ, and
``cache_config.kv_cache_dtype_skip_layers``), ``cache_config.block_size``, the key scheme
and the payload layout. Nothing here imports vLLM except :func:`cpu_kv_format`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.common.keys import Namespace

from engine_adapter.breaker import BreakerSettings
from engine_adapter.engine_keys import engine_namespace
from engine_adapter.model_identity import attention_config, canonical, describe, model_extra, weights_identity
from engine_adapter.vllm.kv_views import KV_LAYOUTS

log = logging.getLogger("engine_adapter.vllm")

REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of the connector.

    Attributes:
        target: the daemon's gRPC target, e.g. ``"unix:/run/kvstore/kvstore.sock"``.
        auth_token: bearer token when the daemon requires one.
        timeout_s: deadline of each load and save call (Get, Put), seconds.
        lookup_timeout_s: deadline of the scheduler's Lookup, seconds (the most a store
            that is slow or gone adds to a request's TTFT, once per outage).
        load_timeout_s: longest wait for one layer's blocks before recomputing them.
        backoff_s, max_backoff_s: after a store call failed, the store is not called
            (lookups miss, loads are recomputed, saves are dropped) until it answers a
            probe; probes wait ``backoff_s``, doubling up to ``max_backoff_s`` seconds
            (:class:`engine_adapter.breaker.BreakerSettings`).
        model_id: model id in the namespace (default: vLLM's model name or path).
        weights_revision: names the weights in the namespace (a commit hash, a checkpoint
            version) instead of the fingerprint of the checkpoint files, which are then not
            read (:mod:`engine_adapter.model_identity`).
        tenant: tenant salt of the namespace.
        key_scheme: ``auto`` (vLLM's block hashes when they are reproducible
            across processes, i.e. ``sha256`` / ``sha256_cbor``; else tokens),
            ``block_hash`` or ``tokens``.
        kv_layout: ``auto`` or one of ``engine_adapter.vllm.kv_views.KV_LAYOUTS``.
        agent_hints: send the daemon each request's agent hint (``kv_transfer_params``
            ``"kvstore"`` entry, ``kv_hints`` envelope; docs/agent_hints.md).
        trajectories: a request without a hint starts an anonymous trajectory's wait when it
            finishes, and a later request extending its blocks is its resume
            (:mod:`engine_adapter.trajectories`).
        max_trajectories: waiting trajectories and sessions the scheduler remembers (LRU;
            about 200 bytes each).
        trajectory_ttl_s: a waiting trajectory is forgotten after this many seconds.
        trajectory_class_blocks: leading blocks that name an anonymous trajectory's class,
            whose gaps the daemon learns together (0: one class for all).
        hint_queue: hint calls queued at most (more are dropped and counted).
        hint_timeout_s: deadline of one hint call, seconds (made off the scheduler thread).
    """

    target: str
    auth_token: str = ""
    timeout_s: float = 10.0
    lookup_timeout_s: float = 0.05
    load_timeout_s: float = 30.0
    backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    model_id: str = ""
    weights_revision: str = ""
    tenant: str = ""
    key_scheme: str = "auto"
    kv_layout: str = "auto"
    agent_hints: bool = True
    trajectories: bool = True
    max_trajectories: int = 4096
    trajectory_ttl_s: float = 3600.0
    trajectory_class_blocks: int = 1
    hint_queue: int = 1024
    hint_timeout_s: float = 1.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ConnectorSettings":
        """Validate the extra config. Raises ValueError naming a bad or unknown key."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(names)}")
        if not isinstance(extra.get("target"), str) or not extra["target"]:
            raise ValueError("kv_connector_extra_config needs 'target', the kvstore daemon address "
                             "(e.g. 'unix:/run/kvstore/kvstore.sock')")
        s = cls(**dict(extra))
        for name in ("agent_hints", "trajectories"):
            if not isinstance(getattr(s, name), bool):
                raise ValueError(f"kv_connector_extra_config {name!r} must be true or false, got {getattr(s, name)!r}")
        for name, low in (("max_trajectories", 1), ("hint_queue", 1), ("trajectory_class_blocks", 0)):
            value = getattr(s, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"kv_connector_extra_config {name!r} must be an integer >= {low}, got {value!r}")
        for name in ("timeout_s", "lookup_timeout_s", "load_timeout_s", "backoff_s", "max_backoff_s",
                     "trajectory_ttl_s", "hint_timeout_s"):
            value = getattr(s, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_connector_extra_config {name!r} must be a positive number, got {value!r}")
        if s.max_backoff_s < s.backoff_s:
            raise ValueError(f"kv_connector_extra_config 'max_backoff_s' ({s.max_backoff_s}) is below "
                             f"'backoff_s' ({s.backoff_s})")
        if s.key_scheme not in ("auto", "block_hash", "tokens"):
            raise ValueError(f"kv_connector_extra_config 'key_scheme' must be auto, block_hash or tokens, "
                             f"got {s.key_scheme!r}")
        if s.kv_layout != "auto" and s.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_connector_extra_config 'kv_layout' must be auto or one of {KV_LAYOUTS}, "
                             f"got {s.kv_layout!r}")
        return s

    def breaker(self) -> BreakerSettings:
        """The circuit breaker's settings."""
        return BreakerSettings(backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s)


def key_scheme(vllm_config, settings: ConnectorSettings) -> str:
    """The key scheme in force (``auto`` resolved from vLLM's prefix-caching hash)."""
    if settings.key_scheme != "auto":
        return settings.key_scheme
    cache = vllm_config.cache_config
    hash_block = getattr(cache, "hash_block_size", None)
    algo = getattr(cache, "prefix_caching_hash_algo", "")
    if algo in REPRODUCIBLE_HASHES and hash_block in (None, cache.block_size):
        return "block_hash"
    return "tokens"


def cpu_kv_format(dtype, block_size: int, head_size: int) -> str:
    """The CPU attention kernel that owns the cache's interior order (``""`` off CPU, and
    where vLLM is not importable: no vLLM engine runs there)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return ""

    if not current_platform.is_cpu():
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(dtype, block_size, head_size)
    except Exception:  # another vLLM release: still keep CPU blocks apart from GPU ones
        isa = "unknown"
    return f"vllm-cpu/{isa}"


def kv_dtype_name(vllm_config) -> str:
    """The KV cache dtype's name: the model dtype (``"bfloat16"``) when ``cache_dtype`` is
    ``auto``, else ``cache_dtype`` itself (``"fp8_e4m3"``)."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return str(cache_dtype)


def model_fields(vllm_config, settings: ConnectorSettings):
    """The weights' identity and the namespace fields of what else changes the KV bytes
    (see the module docstring). Reads the checkpoint's headers and samples once."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    weights = weights_identity(model.model, revision=getattr(model, "revision", None),
                               explicit=settings.weights_revision,
                               cache_dir=getattr(load, "download_dir", None),
                               load_format=str(getattr(load, "load_format", "auto")))
    overrides = getattr(model, "hf_overrides", None)
    if callable(overrides):
        overrides = getattr(overrides, "__qualname__", repr(overrides))
    kv_differs = cache.cache_dtype != "auto"
    return weights, model_extra(
        weights,
        attention=attention_config(model.hf_text_config),
        hf_overrides=canonical(overrides) if overrides else None,
        quantization=str(model.quantization) if getattr(model, "quantization", None) else None,
        model_dtype=str(model.dtype).removeprefix("torch.") if kv_differs else None,
        kv_skip_layers=canonical(list(getattr(cache, "kv_cache_dtype_skip_layers", None) or [])),
        disable_sliding_window=1 if getattr(model, "disable_sliding_window", False) else None,
    )


def namespace_of(vllm_config, settings: ConnectorSettings) -> Namespace:
    """The store namespace of a vLLM instance: model id, KV dtype, block size, KV shape, key
    scheme, CPU kernel format and :func:`model_fields` (weights, attention config,
    quantization). The TP size is not part of it. Logs at INFO what it was built from.

    Raises ValueError for pipeline parallelism (not supported).
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise ValueError("the kvstore connector does not support pipeline parallelism")
    model_id = settings.model_id or model.model
    revision = getattr(model, "revision", None)
    if revision and not settings.model_id:
        model_id = f"{model_id}@{revision}"
    head = model.get_head_size()
    weights, fields = model_fields(vllm_config, settings)
    ns = engine_namespace(
        model=model_id, dtype=kv_dtype_name(vllm_config), block_tokens=cache.block_size,
        num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=head, scheme=key_scheme(vllm_config, settings), tenant=settings.tenant, engine="vllm",
        kv_format=cpu_kv_format(model.dtype, cache.block_size, head), model_fields=fields)
    log.info("%s", describe(ns, weights, "vLLM instance"))
    return ns


def tp_heads(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``[h0, h1)`` of the model's KV heads that TP rank ``rank`` holds in vLLM: a
    contiguous split, or one replicated head when ``tp_size`` exceeds the KV heads."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} TP ranks")
        per = num_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} TP ranks do not replicate {num_kv_heads} KV heads evenly")
    head = rank // (tp_size // num_kv_heads)
    return head, head + 1
