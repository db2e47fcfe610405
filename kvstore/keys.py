"""Content-addressed block keys: chained prefix hashes rooted at a namespace.

A prompt of tokens ``t`` is cut into full blocks of ``block_tokens`` tokens. The key
of block ``i`` is::

    h_0 = SHA-256(encode(namespace))                      (the namespace fingerprint)
    h_i = SHA-256(b"kvstore.block.v1" | h_{i-1} | encode(tokens_i) | encode(extra_i))

so a key names the whole prefix up to and including block ``i`` (the chaining of
vLLM's prefix caching and nano-vllm's block manager), never just the block's own
tokens. Keys are 32 raw bytes.

The encoding is canonical and stable across processes and machines: tokens are
little-endian uint32, strings are UTF-8, every field is length-prefixed, and extra
keys are tagged ``(name, value)`` pairs sorted by name, so ``{"lora": "x"}`` and
``{"salt": "x"}`` never collide. Python's ``hash()`` is never used.

The namespace holds what makes KV bytes incompatible: model id, dtype, KV layout,
block_tokens and a tenant salt. The tensor-parallel size is deliberately *not* part
of it: the stored payload holds all KV heads, so a block written at TP=2 is read at
TP=1 (see docs/block_layout.md).

The store itself treats keys as opaque 32-byte ids (:data:`KEY_BYTES`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NewType, Sequence

import numpy as np

BlockKey = NewType("BlockKey", bytes)
"""A 32-byte block id."""

KEY_BYTES = 32
_BLOCK_DOMAIN = b"kvstore.block.v1"
_NAMESPACE_DOMAIN = b"kvstore.namespace.v1"

ExtraValue = str | int | bytes


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _encode_value(value: ExtraValue) -> bytes:
    if isinstance(value, bool):  # bool is an int subclass: keep it distinct
        return b"o" + _field(b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"i" + _field(str(value).encode())
    if isinstance(value, str):
        return b"s" + _field(value.encode("utf-8"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + _field(bytes(value))
    raise TypeError(f"extra key values must be str, int, bool or bytes, got {type(value).__name__}")


def encode_extra(extra: Mapping[str, ExtraValue] | None) -> bytes:
    """Canonical bytes of tagged extra keys (LoRA id, multimodal hash, salt, ...).

    Sorted by tag; each entry is ``len(tag) tag type len(value) value``.
    Raises TypeError for a non-string tag or an unsupported value type.
    """
    if not extra:
        return struct.pack("<Q", 0)
    parts = [struct.pack("<Q", len(extra))]
    for tag in sorted(extra):
        if not isinstance(tag, str):
            raise TypeError(f"extra key tags must be str, got {tag!r}")
        parts.append(_field(tag.encode("utf-8")))
        parts.append(_encode_value(extra[tag]))
    return b"".join(parts)


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Canonical bytes of token ids: little-endian uint32.

    Raises ValueError for a token id outside ``[0, 2**32)``.
    """
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


@dataclass(frozen=True)
class Namespace:
    """What makes two blocks' KV bytes comparable.

    Attributes:
        model: model id, e.g. ``"meta-llama/Llama-3.1-70B"`` (plus a weights revision
            if the caller wants one).
        dtype: KV dtype name, e.g. ``"bfloat16"``.
        layout: payload layout id, e.g. ``"layer.kv.head.token.dim/v1"``.
        block_tokens: tokens per block (> 0).
        tenant: tenant salt; blocks of different tenants never share keys.
        extra: further tagged fields (e.g. ``{"kv_heads": 8, "head_dim": 128}``).
    """

    model: str
    dtype: str
    layout: str
    block_tokens: int
    tenant: str = ""
    extra: Mapping[str, ExtraValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive int, got {self.block_tokens!r}")

    def fingerprint(self) -> bytes:
        """SHA-256 of the canonical encoding: the root ``h_0`` of every chain (32 bytes)."""
        h = hashlib.sha256(_NAMESPACE_DOMAIN)
        for value in (self.model, self.dtype, self.layout):
            h.update(_field(value.encode("utf-8")))
        h.update(struct.pack("<Q", self.block_tokens))
        h.update(_field(self.tenant.encode("utf-8")))
        h.update(encode_extra(self.extra))
        return h.digest()


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray,
              extra: Mapping[str, ExtraValue] | None = None) -> BlockKey:
    """One step of the chain: ``SHA-256(domain | parent | tokens | extra)`` (32 bytes)."""
    h = hashlib.sha256(_BLOCK_DOMAIN)
    h.update(parent)
    h.update(_field(encode_tokens(tokens)))
    h.update(encode_extra(extra))
    return BlockKey(h.digest())


class BlockKeyer:
    """Computes the chained keys of a prompt's full blocks in one namespace.

    >>> ns = Namespace("tiny", "float32", "layer.kv.head.token.dim/v1", block_tokens=4)
    >>> keys = BlockKeyer(ns).keys(list(range(10)))   # 2 full blocks; 2 tokens left over
    >>> len(keys), len(keys[0])
    (2, 32)
    """

    def __init__(self, namespace: Namespace):
        self.namespace = namespace
        self.block_tokens = namespace.block_tokens
        self.root = namespace.fingerprint()

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_tokens

    def keys(self, tokens: Sequence[int] | np.ndarray,
             extra: Mapping[str, ExtraValue] | Sequence[Mapping[str, ExtraValue] | None] | None = None,
             ) -> list[BlockKey]:
        """Keys of every *full* block of ``tokens`` (a trailing partial block has none).

        Args:
            tokens: token ids, shape ``(num_tokens,)``, ints in ``[0, 2**32)``.
            extra: one mapping applied to every block, or one per block (``None`` entries
                allowed), e.g. a LoRA id or the hash of an image inside that block.
        Returns:
            ``num_tokens // block_tokens`` keys of 32 bytes each; key ``i`` names the
            prefix ``tokens[: (i + 1) * block_tokens]``.
        Raises:
            ValueError: a per-block ``extra`` list of the wrong length, or bad token ids.
        """
        arr = np.asarray(tokens)
        n = self.num_full_blocks(len(arr))
        if extra is None or isinstance(extra, Mapping):
            per_block: Sequence[Mapping[str, ExtraValue] | None] = [extra] * n
        else:
            per_block = list(extra)[:n]
            if len(per_block) < n:
                raise ValueError(f"extra has {len(per_block)} entries for {n} full blocks")
        out: list[BlockKey] = []
        parent = self.root
        bt = self.block_tokens
        for i in range(n):
            parent = chain_key(parent, arr[i * bt:(i + 1) * bt], per_block[i])
            out.append(parent)
        return out


def first_divergence(a: Sequence[int], b: Sequence[int], block_tokens: int) -> tuple[int, int] | None:
    """Where two token sequences first differ, for miss diagnostics.

    Returns ``(block_index, token_index)`` of the first differing token, or ``None``
    when one is a prefix of the other.
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i // block_tokens, i
    return None


def explain_miss(keyer_a: BlockKeyer, tokens_a: Sequence[int], keyer_b: BlockKeyer,
                 tokens_b: Sequence[int]) -> str:
    """Say in words why two prompts' block keys differ (namespace field or token position)."""
    na, nb = keyer_a.namespace, keyer_b.namespace
    for name in ("model", "dtype", "layout", "block_tokens", "tenant"):
        if getattr(na, name) != getattr(nb, name):
            return f"namespace field {name!r} differs: {getattr(na, name)!r} vs {getattr(nb, name)!r}"
    if dict(na.extra) != dict(nb.extra):
        changed = sorted(set(na.extra) ^ set(nb.extra) | {k for k in na.extra if k in nb.extra and na.extra[k] != nb.extra[k]})
        return f"namespace extra keys differ: {changed}"
    div = first_divergence(tokens_a, tokens_b, na.block_tokens)
    if div is not None:
        return f"tokens differ first at token {div[1]} (block {div[0]})"
    return "same namespace and one prompt is a prefix of the other: keys agree on the shared full blocks"


def hex_key(key: bytes) -> str:
    """Lower-case hex of a key (64 characters), for logs and file names."""
    return key.hex()


def validate_key(key: bytes) -> bytes:
    """Return ``key`` if it is exactly :data:`KEY_BYTES` bytes; raise ValueError otherwise."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        length = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"block keys are {KEY_BYTES} bytes, got {length}")
    return bytes(key)


def validate_keys(keys: Iterable[bytes]) -> list[bytes]:
    return [validate_key(k) for k in keys]
