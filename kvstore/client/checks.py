"""What the client checks before it sends a request: the keys it lists, that ``put``'s
blocks are ``(key, payload)`` pairs of C-contiguous buffers, and the block metas of a put
(one per block, each encodable).

A block key is exactly :data:`~kvstore.common.types.KEY_BYTES` (32) bytes. The raw
frames of ``PutRaw`` have a fixed 32-byte key field (:mod:`kvstore.common.wire`), so a
shorter key would be padded with NULs and a longer one cut: stored under another key,
and two long keys sharing their first 32 bytes would collide. The client therefore
refuses such a key before anything is sent, on every call that carries keys; the daemon
refuses them too (``kvstore.service.validate``), for clients that do not check.

Everything a put sends is checked (and its metas encoded) before the call starts: gRPC
builds a streaming call's messages on its own thread, and an exception raised there reaches
the caller only as ``UNKNOWN: Exception iterating requests!``, its cause lost.
"""

from __future__ import annotations

from typing import Sequence

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.buffers import payload_view
from kvstore.client.raw import block_meta_message
from kvstore.common.errors import InvalidRequest
from kvstore.common.types import KEY_BYTES, BlockMeta


def _key_bytes(k, field: str, i: int) -> bytes:
    """Key ``k`` as bytes (any bytes-like object: bytearray, memoryview, a numpy row).
    Raises InvalidRequest for a str or anything else that is not bytes-like."""
    if type(k) is bytes:
        return k
    if isinstance(k, str):
        raise InvalidRequest(f"{field}[{i}] is a str: block keys are 32 bytes (bytes)")
    try:
        return memoryview(k).tobytes()
    except TypeError:
        raise InvalidRequest(f"{field}[{i}] is a {type(k).__name__}: block keys are 32 bytes (bytes)") from None


def check_keys(keys: Sequence[bytes], field: str = "keys", limit: int | None = None) -> list[bytes]:
    """``keys`` as a list, each checked to be 32 bytes (one C-level pass over the lengths;
    the loop that names the culprit runs only when one is wrong).

    Args:
        keys: block keys (bytes-like).
        field: the argument's name in the error message.
        limit: most keys allowed (for calls that cannot be split), or None.
    Raises InvalidRequest naming the first key that is not 32 bytes, or the count over
    ``limit``.
    """
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidRequest(f"{field}: a list of keys is needed, got one {type(keys).__name__}")
    out = keys if type(keys) is list else list(keys)
    if limit is not None and len(out) > limit:
        raise InvalidRequest(f"{field}: {len(out)} keys; at most {limit} per request")
    if out and set(map(type, out)) != {bytes}:
        out = [_key_bytes(k, field, i) for i, k in enumerate(out)]
    if out and set(map(len, out)) != {KEY_BYTES}:
        for i, k in enumerate(out):
            if len(k) != KEY_BYTES:
                raise InvalidRequest(f"{field}[{i}] has {len(k)} bytes; block keys are {KEY_BYTES} bytes")
    return out


def check_pairs(blocks: Sequence) -> Sequence:
    """``blocks`` if every item is a ``(key, payload)`` pair whose payload is a C-contiguous
    buffer of one dimension or more (bytes, bytearray, memoryview, numpy array, ...); else
    InvalidRequest naming the first item that is not (:func:`kvstore.client.buffers.payload_view`:
    a non-contiguous payload is refused, never copied)."""
    for i, item in enumerate(blocks):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequest(f"put takes (key, payload) pairs; item {i} is a {type(item).__name__} "
                                 f"(for keys and buffers side by side use put_from(keys, buffers))")
        payload_view(item[1], f"the payload of item {i}")
    return blocks


def check_meta(meta: Sequence[BlockMeta | None] | None, n: int) -> list[pb.BlockMeta | None] | None:
    """``meta`` (one :class:`~kvstore.common.types.BlockMeta` or None per block of a put of
    ``n`` blocks; None: no metas) as encoded messages, None kept for a block without one.

    Raises InvalidRequest for a count other than ``n`` and for an item that does not encode
    (not a BlockMeta, or a field of the wrong type: the error is its ``__cause__``).
    """
    if meta is None:
        return None
    if isinstance(meta, (str, bytes, bytearray, memoryview, BlockMeta)):
        raise InvalidRequest(f"meta: a list of block metas (one per block) is needed, got one {type(meta).__name__}")
    meta = meta if isinstance(meta, (list, tuple)) else list(meta)
    if len(meta) != n:
        raise InvalidRequest(f"{len(meta)} block metas for {n} keys")
    out: list[pb.BlockMeta | None] = []
    for i, m in enumerate(meta):
        try:
            out.append(None if m is None else block_meta_message(m))
        except (AttributeError, TypeError, ValueError) as e:
            raise InvalidRequest(f"meta[{i}] is not a BlockMeta or None ({type(e).__name__}: {e})") from e
    return out
