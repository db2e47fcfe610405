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
block_tokens, a tenant salt and, in ``extra``, whatever else the caller knows changes them
(the engine plug-ins put the KV shape, a fingerprint of the weights, the attention config
fields and the quantization there: ``engine_adapter/model_identity.py``). The tensor-parallel size is deliberately *not* part
of it: the stored payload holds all KV heads, so a block written at TP=2 is read at
TP=1 (see docs/block_layout.md).

The store itself treats keys as opaque 32-byte ids (:data:`KEY_BYTES`).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NewType, Sequence

import numpy as np

BlockKey = NewType("BlockKey", bytes)
"""A 32-byte block id."""

KEY_BYTES = 32
_BLOCK_DOMAIN = b"kvstore.block.v1"
_NAMESPACE_DOMAIN = b"kvstore.namespace.v1"

ExtraValue = str | int | bytes
_LITTLE_ENDIAN = sys.byteorder == "little"
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)   # the C type of 4 bytes


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


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array (``<u4``), checked, copied only when needed.

    A list, tuple or range is converted in one C call (:class:`array.array`); a numpy
    array (or anything numpy can read, e.g. a CPU torch tensor) must hold integers.
    Raises ValueError for a token id outside ``[0, 2**32)``, a non-integer id, or an
    array that is not 1-D.
    """
    if isinstance(tokens, (list, tuple, range)):
        words = array.array(_U32)
        try:
            if isinstance(tokens, list):
                words.fromlist(tokens)          # preallocates: about 1.5x faster than array("I", list)
            else:
                words.extend(tokens)
            arr = np.frombuffer(words, dtype=np.uint32)
        except OverflowError:
            raise ValueError("token ids must be in [0, 2**32)") from None
        except TypeError as e:
            raise ValueError(f"token ids must be integers: {e}") from None
        return arr if _LITTLE_ENDIAN else arr.astype("<u4")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    kind = arr.dtype.kind
    if kind not in "iub":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if (kind == "i" and arr.min() < 0) or (arr.dtype.itemsize > 4 and arr.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr.astype("<u4", copy=False))


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Canonical bytes of token ids: little-endian uint32.

    Raises ValueError for a token id outside ``[0, 2**32)``.
    """
    return token_array(tokens).tobytes()


@dataclass(frozen=True)
class Namespace:
    """What makes two blocks' KV bytes comparable.

    Attributes:
        model: model id, e.g. ``"meta-llama/Llama-3.1-70B"``. Two checkpoints served under
            one id are told apart only by ``extra`` (e.g. ``{"weights": "sha256:..."}``).
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


def block_hash_state(parent: bytes):
    """The SHA-256 state of a block's key after ``domain | parent``: updated with the block's
    encoded tokens field (``len | tokens``) and extra keys (:func:`encode_extra`) it gives
    :func:`chain_key`'s digest. For callers that hash many blocks under one parent."""
    h = hashlib.sha256(_BLOCK_DOMAIN)
    h.update(parent)
    return h


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray,
              extra: Mapping[str, ExtraValue] | None = None) -> BlockKey:
    """One step of the chain: ``SHA-256(domain | parent | tokens | extra)`` (32 bytes)."""
    h = block_hash_state(parent)
    h.update(_field(encode_tokens(tokens)))
    h.update(encode_extra(extra))
    return BlockKey(h.digest())


ExtraArg = Mapping[str, ExtraValue] | Sequence[Mapping[str, ExtraValue] | None] | None
"""One mapping for every block, or one per block (``None`` entries allowed), or None."""

_NO_EXTRA = encode_extra(None)
_BLOCK_SEED = hashlib.sha256(_BLOCK_DOMAIN)


def block_extra_codes(extra: ExtraArg, num_blocks: int) -> bytes | list[bytes]:
    """Encoded extra keys (:func:`encode_extra`) of ``num_blocks`` blocks: one ``bytes``
    shared by every block, or a list of one per block.

    Raises ValueError for a per-block list shorter than ``num_blocks``, TypeError for a
    bad tag or value.
    """
    if extra is None:
        return _NO_EXTRA
    if isinstance(extra, Mapping):
        return encode_extra(extra)
    per_block = list(extra)[:num_blocks]
    if len(per_block) < num_blocks:
        raise ValueError(f"extra has {len(per_block)} entries for {num_blocks} full blocks")
    seen: dict[int, bytes] = {}          # blocks often share one mapping object: encode it once
    codes = []
    for e in per_block:
        code = seen.get(id(e))
        if code is None:
            code = seen[id(e)] = encode_extra(e)
        codes.append(code)
    return codes


def _hash_rows(parent: bytes, rows: Iterable[bytes | memoryview]) -> list[BlockKey]:
    """The chain over pre-encoded rows ``len(tokens) | tokens | extra``: one hashlib call
    per block, no per-token work."""
    fresh = _BLOCK_SEED.copy          # SHA-256 state after the domain tag
    out: list[BlockKey] = []
    append = out.append
    for row in rows:
        h = fresh()
        h.update(parent)
        h.update(row)
        parent = h.digest()
        append(parent)
    return out


class BlockKeyer:
    """Computes the chained keys of a prompt's full blocks in one namespace.

    Bulk hashing: the token ids are encoded once (one numpy conversion), every block's
    message tail (``len(tokens) | tokens | extra``) is laid out in one buffer by numpy,
    and the chain hashes slices of it: one SHA-256 per block, no Python work per token.

    >>> ns = Namespace("tiny", "float32", "layer.kv.head.token.dim/v1", block_tokens=4)
    >>> keys = BlockKeyer(ns).keys(list(range(10)))   # 2 full blocks; 2 tokens left over
    >>> len(keys), len(keys[0])
    (2, 32)
    """

    def __init__(self, namespace: Namespace):
        self.namespace = namespace
        self.block_tokens = namespace.block_tokens
        self.root = namespace.fingerprint()
        self._length = struct.pack("<Q", 4 * self.block_tokens)   # the tokens field's length prefix

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_tokens

    def keys(self, tokens: Sequence[int] | np.ndarray, extra: ExtraArg = None) -> list[BlockKey]:
        """Keys of every *full* block of ``tokens`` (a trailing partial block has none).

        Args:
            tokens: token ids, shape ``(num_tokens,)``, ints in ``[0, 2**32)`` (a list,
                or a numpy integer array: the fastest).
            extra: one mapping applied to every block, or one per block (``None`` entries
                allowed), e.g. a LoRA id or the hash of an image inside that block.
        Returns:
            ``num_tokens // block_tokens`` keys of 32 bytes each; key ``i`` names the
            prefix ``tokens[: (i + 1) * block_tokens]``.
        Raises:
            ValueError: a per-block ``extra`` list of the wrong length, or bad token ids.
        """
        arr = token_array(tokens)
        n = self.num_full_blocks(len(arr))
        return self.chain(self.root, arr[:n * self.block_tokens], block_extra_codes(extra, n))

    def extend(self, parent: bytes | None, tokens: Sequence[int] | np.ndarray,
               extra: ExtraArg = None) -> list[BlockKey]:
        """Keys of the full blocks of ``tokens`` continuing a chain whose last key is
        ``parent`` (None: the namespace root), e.g. the blocks a decode step completed.

        ``tokens`` starts at a block boundary; a trailing partial block has no key.
        Raises ValueError as :meth:`keys`, or for a ``parent`` that is not 32 bytes.
        """
        if parent is not None:
            validate_key(parent)
        arr = token_array(tokens)
        n = self.num_full_blocks(len(arr))
        return self.chain(self.root if parent is None else parent, arr[:n * self.block_tokens],
                          block_extra_codes(extra, n))

    def chain(self, parent: bytes, arr: np.ndarray, codes: bytes | list[bytes]) -> list[BlockKey]:
        """The chain from ``parent`` (32 bytes) over the whole blocks of ``arr``.

        Args:
            parent: the key of the block before ``arr[0]``, or :attr:`root`.
            arr: token ids from :func:`token_array` (``<u4``, C-contiguous); a trailing
                partial block is ignored.
            codes: from :func:`block_extra_codes`: one for every block, or one per block.
        Returns:
            ``len(arr) // block_tokens`` keys.
        """
        bt = self.block_tokens
        n = len(arr) // bt
        if n == 0:
            return []
        words = arr[:n * bt].view(np.uint8).reshape(n, 4 * bt)
        if isinstance(codes, (bytes, bytearray)):
            width = 8 + 4 * bt + len(codes)
            rows = np.empty((n, width), dtype=np.uint8)
            rows[:, :8] = np.frombuffer(self._length, dtype=np.uint8)
            rows[:, 8:8 + 4 * bt] = words
            rows[:, 8 + 4 * bt:] = np.frombuffer(codes, dtype=np.uint8)
            buf = rows.tobytes()
            return _hash_rows(parent, [buf[s:s + width] for s in range(0, n * width, width)])
        length = self._length
        data = memoryview(words.reshape(-1))
        step = 4 * bt
        return _hash_rows(parent, [b"".join((length, data[i * step:(i + 1) * step], codes[i]))
                                   for i in range(n)])


def common_prefix_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays (tokens).

    One vectorised comparison: ``min(len(a), len(b))`` element compares, no Python loop.
    """
    m = min(len(a), len(b))
    if m == 0:
        return 0
    differs = a[:m] != b[:m]
    i = int(differs.argmax())           # the first True (argmax stops at it)
    return i if differs[i] else m


def first_divergence(a: Sequence[int], b: Sequence[int], block_tokens: int) -> tuple[int, int] | None:
    """Where two token sequences first differ, for miss diagnostics.

    Returns ``(block_index, token_index)`` of the first differing token, or ``None``
    when one is a prefix of the other.
    """
    x, y = np.asarray(a), np.asarray(b)
    i = common_prefix_tokens(x, y)
    if i == min(len(x), len(y)):
        return None
    return i // block_tokens, i


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
