"""Checks of every number and key a client sends, before anything changes.

Each function returns the value in the form the store uses or raises
:class:`kvstore.common.errors.InvalidRequest` naming the field; no state changes before they
pass. Client-supplied unix times are converted once, here, to the daemon's monotonic
clock (:func:`to_monotonic`), so stepping the wall clock never moves a deadline.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from kvstore._proto import kvstore_pb2 as pb
from kvstore.common.byte_ranges import MAX_BLOCK_BYTES, MAX_RANGES  # noqa: F401 - where they were
from kvstore.common.errors import InvalidRequest
from kvstore.common.transport import MAX_KEYS_PER_REQUEST
from kvstore.common.types import KEY_BYTES, BlockMeta

MAX_KEYS = MAX_KEYS_PER_REQUEST
"""Most keys one request may carry (the client splits longer lists: :mod:`kvstore.common.transport`)."""

MAX_CLOCK_SKEW_S = 24 * 3600.0
"""A client time further than this from the daemon's now is refused (seconds)."""


def check_keys(keys: Sequence[bytes], field: str = "keys", limit: int | None = None) -> list[bytes]:
    """Every key 32 bytes, at most ``limit`` of them (None: :data:`MAX_KEYS`)."""
    limit = MAX_KEYS if limit is None else limit
    if len(keys) > limit:
        raise InvalidRequest(f"{field}: {len(keys)} keys; at most {limit} per request")
    out = list(keys)
    if out and set(map(len, out)) != {KEY_BYTES}:      # one C-level pass; the loop only names the culprit
        for i, k in enumerate(out):
            if len(k) != KEY_BYTES:
                raise InvalidRequest(f"{field}[{i}] has {len(k)} bytes; block keys are {KEY_BYTES} bytes")
    return out


def check_chunk_keys(chunks: Sequence[pb.PutChunk]) -> Sequence[pb.PutChunk]:
    """Every chunk of one Put message names a 32-byte key, checked before any chunk of the
    message is stored (a block complete in an earlier message of the stream is stored)."""
    if chunks and set(len(c.key) for c in chunks) != {KEY_BYTES}:
        for i, c in enumerate(chunks):
            if len(c.key) != KEY_BYTES:
                raise InvalidRequest(f"chunks[{i}].key has {len(c.key)} bytes; block keys are {KEY_BYTES} bytes")
    return chunks


def check_number(value: float, field: str, *, low: float = 0.0, high: float = math.inf,
                 low_inclusive: bool = True) -> float:
    """A finite number in ``[low, high]`` (``(low, high]`` unless ``low_inclusive``)."""
    if not math.isfinite(value):
        raise InvalidRequest(f"{field}: {value!r} is not a finite number")
    if value < low or (not low_inclusive and value == low) or value > high:
        bound = "[" if low_inclusive else "("
        raise InvalidRequest(f"{field}: {value!r} is outside {bound}{low}, {high}]")
    return float(value)


MIN_TTL_S = 1.0
"""Shortest lease or reservation a client may ask for (seconds): a client copies blocks
while its lease lives, and one that expired mid-copy could let the space be reused."""


def check_ttl(value: float, field: str, default: float, maximum: float) -> float:
    """A TTL in seconds: 0 means ``default``; otherwise in ``[MIN_TTL_S, maximum]``."""
    if value == 0:
        return default
    return check_number(value, field, low=MIN_TTL_S, high=maximum)


def check_size(value: int, field: str, maximum: int = MAX_BLOCK_BYTES) -> int:
    """A block size in bytes, in ``(0, maximum]``."""
    if not 0 < value <= maximum:
        raise InvalidRequest(f"{field}: {value} bytes is outside (0, {maximum}]")
    return int(value)


def check_meta(m: pb.BlockMeta) -> BlockMeta | None:
    """A ``BlockMeta`` message as :class:`kvstore.common.types.BlockMeta` (None when empty).
    Raises InvalidRequest for oversized fields."""
    if not (m.engine_hash or m.token_ids or m.parent_engine_hash):
        return None
    if len(m.engine_hash) > 64 or len(m.parent_engine_hash) > 64 or len(m.token_ids) > 1 << 16 \
            or len(m.lora_name) > 256:
        raise InvalidRequest("BlockMeta: hashes are limited to 64 bytes, token_ids to 65536, "
                             "lora_name to 256 characters")
    return BlockMeta(bytes(m.engine_hash), bytes(m.parent_engine_hash), tuple(m.token_ids), m.block_tokens,
                     m.lora_name)


def decode_meta(data) -> pb.BlockMeta:
    """A PutRaw META record's bytes as a ``BlockMeta`` message. Raises InvalidRequest when
    they do not decode."""
    try:
        return pb.BlockMeta.FromString(bytes(data))
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise InvalidRequest(f"a BlockMeta record does not decode: {e}") from None


def to_monotonic(unix_s: float, field: str, now_unix: float | None = None,
                 now_mono: float | None = None) -> float:
    """A client's unix time (seconds; 0: now) as a time on the daemon's monotonic clock.

    Raises InvalidRequest for a time that is not finite, negative, or further than
    :data:`MAX_CLOCK_SKEW_S` from now.
    """
    now_u = time.time() if now_unix is None else now_unix
    now_m = time.monotonic() if now_mono is None else now_mono
    if unix_s == 0:
        return now_m
    check_number(unix_s, field, low=0.0)
    if abs(unix_s - now_u) > MAX_CLOCK_SKEW_S:
        raise InvalidRequest(f"{field}: {unix_s!r} is more than {MAX_CLOCK_SKEW_S:.0f} s from the daemon's "
                             f"clock ({now_u:.0f})")
    return now_m + (unix_s - now_u)


def to_unix(mono_s: float) -> float:
    """A monotonic time of the daemon as unix time (for replies)."""
    return time.time() + (mono_s - time.monotonic())
