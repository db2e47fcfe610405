"""Settings of the SGLang HiCache backend (its extra config) and its store namespace.

The namespace is read from what SGLang 0.5.23 gives a storage backend: the host pool
(``page_size``, ``layer_num``, ``head_num``, ``head_dim``, ``layout``, its flat page), the
``HiCacheStorageConfig`` (``model_name``, TP rank and size, ``is_mla_model``) and SGLang's
resolved model settings (``sglang.srt.runtime_context.get_model()``: ``model_path``,
``revision``, ``load_format``, ``json_model_override_args``, ``dtype``, ``quantization``,
``kv_cache_dtype``, ``quantization_param_path``). From them: the weights' identity and the
attention fields of the checkpoint's ``config.json`` with SGLang's overrides
(:mod:`engine_adapter.model_identity`), quantization, the KV dtype, the page size and the
host page format. Nothing here imports SGLang except :func:`sglang_model_args`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.common.keys import Namespace

from engine_adapter.engine_keys import engine_namespace
from engine_adapter.model_identity import (attention_config, canonical, describe, local_checkpoint, model_extra,
                                           weights_identity)

log = logging.getLogger("engine_adapter.sglang")

FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Extra config keys SGLang's ``dynamic`` factory reads itself."""


@dataclass(frozen=True)
class BackendSettings:
    """Our keys of ``--hicache-storage-backend-extra-config``.

    Attributes:
        target: the daemon's gRPC target, e.g. ``"unix:/run/kvstore/kvstore.sock"``.
        auth_token: bearer token when the daemon requires one.
        timeout_s: deadline of a get or set, seconds.
        lookup_timeout_s: deadline of an exists (a lookup), seconds.
        backoff_s, max_backoff_s: the circuit breaker's probe back-off, first and longest,
            seconds (:class:`engine_adapter.breaker.BreakerSettings`).
        model_id: model id in the namespace (default: SGLang's model name).
        weights_revision: names the weights (a commit hash, a checkpoint version) instead
            of the fingerprint of the checkpoint files, which are then not read.
        tenant: tenant salt of the namespace.
    """

    target: str
    auth_token: str = ""
    timeout_s: float = 10.0
    lookup_timeout_s: float = 0.05
    backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    model_id: str = ""
    weights_revision: str = ""
    tenant: str = ""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "BackendSettings":
        """Validate the extra config (the factory's keys are ignored).

        Raises ValueError naming a missing ``target``, an unknown key or a bad timeout.
        """
        ours = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - FACTORY_KEYS - ours)
        if unknown:
            raise ValueError(f"unknown hicache storage extra config keys {unknown}; known: {sorted(ours)}")
        if not extra.get("target"):
            raise ValueError("hicache storage extra config needs 'target', the kvstore daemon address")
        s = cls(**{k: v for k, v in extra.items() if k in ours})
        for name in ("timeout_s", "lookup_timeout_s", "backoff_s", "max_backoff_s"):
            value = getattr(s, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"hicache storage extra config {name!r} must be a positive number, got {value!r}")
        return s


def sglang_model_args():
    """SGLang's resolved model settings (``get_model()``), or None where they are not
    published (a backend built outside a server, e.g. by a test)."""
    try:
        from sglang.srt.runtime_context import get_model

        return get_model()
    except Exception:  # noqa: BLE001 - not published, or another SGLang release
        return None


def _arg(args: Any, name: str, default: Any = None) -> Any:
    try:
        value = getattr(args, name)
    except Exception:  # noqa: BLE001 - SGLang's config bag raises AttributeError or ValueError
        return default
    return default if value is None else value


def _file_digest(path: str) -> str:
    try:
        return "sha256:" + hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"path:{path}"


def _attention(model_path: str, revision: str | None, overrides: dict) -> str | None:
    folder = local_checkpoint(model_path, revision) if model_path else None
    try:
        config = json.loads((folder / "config.json").read_text()) if folder is not None else None
    except (OSError, ValueError):
        config = None
    if config is None:
        return None
    config.update(overrides)
    return attention_config(config)


def namespace_of(storage_config, mem_pool_host, settings: BackendSettings, model_args=None) -> Namespace:
    """The store namespace of an SGLang instance's host pages (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``.
        mem_pool_host: the host KV pool (its flat page fixes the payload's size and dtype).
        settings: the backend's settings.
        model_args: SGLang's model settings (:func:`sglang_model_args`); None: only what
            ``storage_config`` names (``model_name``) is known, and the log says so.
    Raises:
        ValueError: ``json_model_override_args`` is not a JSON object.

    MHA pages at TP > 1 hold one rank's heads, so the page format then names the rank.
    Logs at INFO what the namespace was built from.
    """
    cfg = storage_config
    page = mem_pool_host.get_dummy_flat_data_page()
    fmt = f"sglang/{getattr(mem_pool_host, 'layout', 'unknown')}/{'mla' if cfg.is_mla_model else 'mha'}"
    if not cfg.is_mla_model and cfg.tp_size > 1:
        fmt += f"/tp{cfg.tp_rank}of{cfg.tp_size}"
    model_path = str(_arg(model_args, "model_path", "") or cfg.model_name or "")
    revision = _arg(model_args, "revision")
    weights = weights_identity(model_path, revision=revision, explicit=settings.weights_revision,
                               load_format=str(_arg(model_args, "load_format", "auto")))
    overrides = json.loads(_arg(model_args, "json_model_override_args", "{}") or "{}")
    if not isinstance(overrides, dict):
        raise ValueError(f"json_model_override_args must be a JSON object, got {overrides!r}")
    kv_cache_dtype = str(_arg(model_args, "kv_cache_dtype", "auto"))
    scales = _arg(model_args, "quantization_param_path")
    fields = model_extra(
        weights, attention=_attention(model_path, revision, overrides),
        hf_overrides=canonical(overrides) if overrides else None,
        quantization=str(_arg(model_args, "quantization", "") or ""),
        kv_cache_dtype=kv_cache_dtype if kv_cache_dtype != "auto" else None,
        model_dtype=str(_arg(model_args, "dtype", "auto")) if kv_cache_dtype != "auto" else None,
        kv_scales=_file_digest(scales) if scales else None)
    ns = engine_namespace(
        model=settings.model_id or cfg.model_name or "unknown-model", dtype=str(page.dtype).removeprefix("torch."),
        block_tokens=mem_pool_host.page_size, num_layers=int(getattr(mem_pool_host, "layer_num", 0)),
        num_kv_heads=int(getattr(mem_pool_host, "head_num", 0)), head_dim=int(getattr(mem_pool_host, "head_dim", 0)),
        scheme="block_hash", tenant=settings.tenant, engine="sglang",
        kv_format=f"{fmt}/{page.numel() * page.element_size()}B", model_fields=fields)
    log.info("%s", describe(ns, weights, "SGLang instance"))
    return ns
