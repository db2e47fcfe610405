"""What the client checks before it sends a request: the keys it lists, and that ``put``'s
blocks are ``(key, payload)`` pairs of buffers.

A block key is exactly :data:`~kvstore.common.types.KEY_BYTES` (32) bytes. The raw
frames of ``PutRaw`` have a fixed 32-byte key field (:mod:`kvstore.common.wire`), so a
shorter key would be padded with NULs and a longer one cut: stored under another key,
and two long keys sharing their first 32 bytes would collide. The client therefore
refuses such a key before anything is sent, on every call that carries keys; the daemon
refuses them too (``kvstore.service.validate``), for clients that do not check.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.common.errors import InvalidRequest
from kvstore.common.types import KEY_BYTES


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
    """``blocks`` if every item is a ``(key, payload)`` pair whose payload is a buffer (bytes,
    bytearray, memoryview, numpy array, ...); else InvalidRequest naming the first item that is not."""
    for i, item in enumerate(blocks):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequest(f"put takes (key, payload) pairs; item {i} is a {type(item).__name__} "
                                 f"(for keys and buffers side by side use put_from(keys, buffers))")
        try:
            memoryview(item[1])
        except TypeError:
            raise InvalidRequest(f"the payload of item {i} is a {type(item[1]).__name__}, not bytes or "
                                 f"another buffer") from None
    return blocks
