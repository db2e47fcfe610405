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

import struct
from typing import Mapping, Sequence

from kvstore.common.keys import (BlockKeyer, ExtraValue, Namespace, block_hash_state, chain_key, encode_extra,
                                 token_array)

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


HASH_TAG = "engine.block_hash"
"""The extra key that carries an engine's block hash in the ``block_hash`` scheme."""


def key_from_engine_hash(root: bytes, block_hash: bytes) -> bytes:
    """Our 32-byte key of a block named by the engine's prefix hash ``block_hash``:
    ``chain_key(root, [], {"engine.block_hash": block_hash})``. Raises TypeError for a hash
    that is not bytes."""
    if not isinstance(block_hash, (bytes, bytearray)):
        raise TypeError(f"engine block hashes must be bytes, got {type(block_hash).__name__}")
    return chain_key(root, (), {HASH_TAG: bytes(block_hash)})


class EngineHashKeys:
    """:func:`key_from_engine_hash` under one ``root``, one SHA-256 update per block: the
    message up to the hash's length field (domain, root, no tokens, one extra key named
    :data:`HASH_TAG`, type ``bytes``) is the same for every block, so its hash state is
    computed once and copied. The keys are those of :func:`key_from_engine_hash`."""

    def __init__(self, root: bytes):
        tagged = encode_extra({HASH_TAG: b""})       # ... b"b" + 8-byte length + the hash
        self._head = block_hash_state(bytes(root))
        self._head.update(struct.pack("<Q", 0) + tagged[:-8])     # no tokens; the tag, up to the hash

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The keys of ``block_hashes``, in order. Raises TypeError for a hash that is not bytes."""
        fresh, pack, out = self._head.copy, struct.Struct("<Q").pack, []
        for h in block_hashes:
            if not isinstance(h, (bytes, bytearray)):
                raise TypeError(f"engine block hashes must be bytes, got {type(h).__name__}")
            state = fresh()
            state.update(pack(len(h)))
            state.update(h)
            out.append(state.digest())
        return out


class IncrementalKeys:
    """Keys of one request's full blocks, extended as the request grows.

    Args:
        namespace: the store namespace (its ``extra["keys"]`` picks the scheme).
        extra: per-request extra keys of the ``tokens`` scheme (LoRA name, cache salt).
        keyer, hash_keys: the namespace's :class:`BlockKeyer` and :class:`EngineHashKeys`,
            shared by a caller that keys many requests of one namespace (made here when None).

    The keys are :func:`kvstore.common.keys.chain_key`'s (``tokens``) or
    :func:`key_from_engine_hash`'s (``block_hash``), computed in bulk: the new blocks' tokens
    encoded at once and hashed one SHA-256 per block (:meth:`BlockKeyer.chain`), or one
    update per engine hash (:class:`EngineHashKeys`); about 1 us per block instead of 4-5.
    """

    def __init__(self, namespace: Namespace, extra: Mapping[str, ExtraValue] | None = None, *,
                 keyer: BlockKeyer | None = None, hash_keys: EngineHashKeys | None = None):
        self.scheme = namespace.extra["keys"]
        self.block_tokens = namespace.block_tokens
        self._keyer = keyer if keyer is not None else BlockKeyer(namespace)   # the root: one SHA-256
        self.root = self._keyer.root
        self.extra = dict(extra or {})
        self._codes = encode_extra(self.extra or None)
        self._hashes = None
        if self.scheme == "block_hash":
            self._hashes = hash_keys if hash_keys is not None else EngineHashKeys(self.root)
        self.keys: list[bytes] = []

    def extend(self, *, tokens: Sequence[int] = (), block_hashes: Sequence[bytes] = ()) -> list[bytes]:
        """Keys of every full block known so far (``tokens`` or ``block_hashes`` by scheme).

        Returns the cached list, extended; keys already computed are not recomputed.
        Raises TypeError (a block hash that is not bytes), ValueError (a token id outside
        ``[0, 2**32)``).
        """
        done = len(self.keys)
        if self._hashes is not None:
            if len(block_hashes) > done:
                self.keys.extend(self._hashes.keys(block_hashes[done:]))
            return self.keys
        bt = self.block_tokens
        full = len(tokens) // bt
        if full > done:
            parent = self.keys[-1] if self.keys else self.root
            self.keys.extend(self._keyer.chain(parent, token_array(tokens[done * bt:full * bt]), self._codes))
        return self.keys
