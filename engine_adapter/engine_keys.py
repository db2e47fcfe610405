"""Store keys for engine plugins: our chained keys from an engine's own block hashes or tokens.

Two schemes, both rooted at the namespace fingerprint (:mod:`kvstore.common.keys`), so blocks
of another model, weights, attention config, quantization, dtype, layout, block size or
tenant never match:

``block_hash``
    ``key_i = chain_key(root, [], {"engine.block_hash": h_i})`` where ``h_i`` is the
    engine's own hash of block ``i`` (vLLM's ``request.block_hashes``, SGLang's page
    hash). Those hashes already chain over the whole prefix and carry the engine's extra
    keys (multimodal inputs, LoRA, cache salt), so one derivation step per block is
    enough. Only reproducible hashes may be used (vLLM's ``sha256`` / ``sha256_cbor``:
    their seed is fixed unless ``PYTHONHASHSEED`` overrides it on every process alike).
``tokens``
    ``kvstore.common.keys.BlockKeyer`` over the token ids, with LoRA name and cache salt as
    extra keys; used when the engine hash is not reproducible across processes.

The namespace's ``extra`` names the scheme, so the two schemes never share a key.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kvstore.common.keys import BlockKeyer, ExtraValue, Namespace, chain_key

from engine_adapter.layout import LAYOUT_ID

SCHEMES = ("block_hash", "tokens")


def engine_namespace(*, model: str, dtype: str, block_tokens: int, num_layers: int, num_kv_heads: int,
                     head_dim: int, scheme: str, tenant: str = "", engine: str = "",
                     kv_format: str = "", model_fields: Mapping[str, ExtraValue] | None = None) -> Namespace:
    """The namespace of an engine's stored blocks (layout ``layer.kv.head.token.dim/v1``).

    Args:
        model: model id or checkpoint path (plus revision when the caller has one).
        dtype: KV dtype name, e.g. ``"bfloat16"`` (torch names without ``torch.``).
        block_tokens: tokens per block (the engine's block / page size).
        num_layers, num_kv_heads (all of them, not a TP rank's), head_dim: KV shape.
        scheme: ``"block_hash"`` or ``"tokens"``.
        tenant: tenant salt.
        engine: hash family for ``block_hash`` (``"vllm"``, ``"sglang"``); hashes of
            different engines are different functions of the tokens.
        kv_format: set when the payload's (token, dim) interior is an engine kernel's
            private order (vLLM's CPU backend), so only that kernel reads it back.
        model_fields: what else changes the KV bytes of this model
            (:func:`engine_adapter.model_identity.model_extra`: the weights' fingerprint,
            the attention config fields, quantization, ...).
    Raises:
        ValueError: unknown scheme, or a ``model_fields`` name that is a shape or scheme field.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"key scheme must be one of {SCHEMES}, got {scheme!r}")
    extra: dict[str, ExtraValue] = {"num_layers": num_layers, "num_kv_heads": num_kv_heads,
                                    "head_dim": head_dim, "keys": scheme}
    if scheme == "block_hash":
        extra["engine"] = engine
    if kv_format:
        extra["kv_format"] = kv_format
    clash = sorted(set(model_fields or {}) & set(extra))
    if clash:
        raise ValueError(f"model fields {clash} would replace the namespace's own fields")
    extra.update(model_fields or {})
    return Namespace(model=model, dtype=dtype, layout=LAYOUT_ID, block_tokens=block_tokens,
                     tenant=tenant, extra=extra)


def key_from_engine_hash(root: bytes, block_hash: bytes) -> bytes:
    """Our 32-byte key of a block named by the engine's prefix hash ``block_hash``."""
    if not isinstance(block_hash, (bytes, bytearray)):
        raise TypeError(f"engine block hashes must be bytes, got {type(block_hash).__name__}")
    return chain_key(root, (), {"engine.block_hash": bytes(block_hash)})


class IncrementalKeys:
    """Keys of one request's full blocks, extended as the request grows.

    Args:
        namespace: the store namespace (its ``extra["keys"]`` picks the scheme).
        extra: per-request extra keys of the ``tokens`` scheme (LoRA name, cache salt).
    """

    def __init__(self, namespace: Namespace, extra: Mapping[str, ExtraValue] | None = None):
        self.scheme = namespace.extra["keys"]
        self.block_tokens = namespace.block_tokens
        self.root = BlockKeyer(namespace).root
        self.extra = dict(extra or {})
        self.keys: list[bytes] = []

    def extend(self, *, tokens: Sequence[int] = (), block_hashes: Sequence[bytes] = ()) -> list[bytes]:
        """Keys of every full block known so far (``tokens`` or ``block_hashes`` by scheme).

        Returns the cached list, extended; keys already computed are not recomputed.
        """
        if self.scheme == "block_hash":
            for h in block_hashes[len(self.keys):]:
                self.keys.append(key_from_engine_hash(self.root, h))
            return self.keys
        bt = self.block_tokens
        parent = self.keys[-1] if self.keys else self.root
        for i in range(len(self.keys), len(tokens) // bt):
            parent = chain_key(parent, tokens[i * bt:(i + 1) * bt], self.extra or None)
            self.keys.append(parent)
        return self.keys
