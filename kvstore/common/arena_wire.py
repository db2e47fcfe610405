"""The same-node control frames: Lookup, Lease, Release, Reserve and Commit without gRPC, on the arena session.

A client that says hello version 3 (:data:`kvstore.common.arena.HELLO_CONTROL`) keeps its
arena hand-out connection as its session (as version 2 does) and, when the daemon answers
``control`` 1, also sends control frames on it: a daemon thread of that session reads each
frame, calls the store and answers on the same connection. This replaces the two gRPC round
trips of a same-node read (Lookup, then Lease: about 1 ms each in transport and thread
wake-ups) with one unix-socket round trip each; a Release is sent without waiting for its
answer (:data:`NO_REPLY`) or rides on the next Lease. A zero-copy put's Reserve and Commit
go the same way when the daemon says it serves them (the hello's last field,
:mod:`kvstore.common.arena`): with the daemon busy writing blocks to NVMe a gRPC Commit
took 1.9 ms.

Every frame, both ways, is little-endian::

    u32 length      bytes that follow (the rest of the header and the payload)
    u8  op          LOOKUP 1, LEASE 2, RELEASE 3, TOUCH 4, RESERVE 5, COMMIT 6; an answer is
                    op | REPLY (0x80); ERROR 0xFF
    u8  flags       PREFIX (1): a lease stops at the first miss; NO_REPLY (2): no answer;
                    META (4): a RESERVE carries block metadata; ABORT (4): a COMMIT aborts
    u8  key_bytes   length of each key in the payload (32; anything else is refused)
    u8  reserved    0
    u32 seq         chosen by the client, echoed by the answer
    u32 count       keys (LOOKUP, LEASE, RESERVE, COMMIT), lease ids (RELEASE); in an answer:
                    blocks answered

Payloads (``count`` = n):

==============  ==============================================================================
LOOKUP          n keys
  answer        n = hit blocks; n tier codes (u8)
LEASE           f64 TTL s, u64 max bytes (0: a quarter of the arena), u32 r, 4 bytes 0,
                r lease ids to release first (16 bytes each), n keys
  answer        16-byte lease id (zeros: none), f64 TTL s, u32 resume_at, u8 complete,
                3 bytes 0, n offsets (u64), n sizes (u64), n tier codes (u8; 0: a miss)
RELEASE         n lease ids (16 bytes each)
  answer        n = leases that were live
TOUCH           n keys the client read from the shared block table (:mod:`tiers.block_table`):
                the eviction policies see the hits; always sent NO_REPLY
RESERVE         f64 TTL s (0: the daemon's), n sizes (u64, bytes), n keys; with META, then
                per key a u32 length and that many bytes of a serialized ``BlockMeta``
                (``proto/kvstore.proto``; length 0: none)
  answer        n offsets (u64, bytes in the arena), n statuses (u8, ``ReserveStatus``), the
                first refusal's detail (UTF-8, the rest of the frame)
COMMIT          n keys whose reservations to commit (ABORT: to drop)
  answer        n = blocks committed; u64 bytes committed
ERROR           u8 length, the name of a :mod:`kvstore.common.errors` class, the message (UTF-8)
==============  ==============================================================================

A frame over :data:`MAX_FRAME_BYTES`, or shorter than its header, cannot be resynchronised:
the daemon answers ERROR and closes the connection (which ends the session). A LOOKUP sent
NO_REPLY is one the client answered itself from the block table: the daemon only records
it (the reuse statistics the agent machinery learns from, the lookup counts). A frame that
parses but says something wrong (unknown op, key length not 32, a count that does not match
the payload) is answered ERROR (InvalidRequest) and the connection goes on.
"""

from __future__ import annotations

import struct

from kvstore.common import errors
from kvstore.common.types import KEY_BYTES

HEADER = struct.Struct("<IBBBBII")
"""length, op, flags, key_bytes, reserved, seq, count."""
HEADER_BYTES = HEADER.size
LENGTH = struct.Struct("<I")
LEASE_ARGS = struct.Struct("<dQI4x")
"""A LEASE request's fixed part: TTL (s), max bytes, lease ids to release first."""
LEASE_ANSWER = struct.Struct("<16sdIB3x")
"""A LEASE answer's fixed part: lease id, TTL (s), resume_at, complete."""
LEASE_ID_BYTES = 16

LOOKUP, LEASE, RELEASE, TOUCH, RESERVE, COMMIT = 1, 2, 3, 4, 5, 6
REPLY = 0x80
ERROR = 0xFF
PREFIX, NO_REPLY, META, ABORT = 1, 2, 4, 4
RESERVE_ARGS = struct.Struct("<d")
"""A RESERVE request's fixed part: TTL (s)."""
META_LENGTH = struct.Struct("<I")
COMMIT_ANSWER = struct.Struct("<Q")
"""A COMMIT answer's payload: bytes committed."""

MAX_FRAME_KEYS = 1 << 16
"""Most keys one LOOKUP or LEASE frame may carry (the client splits longer lists)."""
MAX_FRAME_RELEASES = 4096
"""Most lease ids one frame may carry."""
MAX_FRAME_BYTES = 4 << 20
"""Largest frame either side accepts (bytes after the length field)."""


class FrameError(errors.InvalidRequest):
    """A control frame that does not parse (or says something impossible)."""


def header(op: int, flags: int, seq: int, count: int, payload_bytes: int) -> bytes:
    """The 16-byte header of a frame whose payload has ``payload_bytes`` bytes."""
    return HEADER.pack(HEADER_BYTES - LENGTH.size + payload_bytes, op, flags, KEY_BYTES, 0, seq, count)


def lookup_frame(seq: int, keys: list[bytes], reply: bool = True) -> bytes:
    """A LOOKUP of ``keys`` (32 bytes each, checked by the caller); without ``reply`` the
    daemon only records it."""
    return header(LOOKUP, 0 if reply else NO_REPLY, seq, len(keys), len(keys) * KEY_BYTES) + b"".join(keys)


def touch_frame(seq: int, keys: list[bytes]) -> bytes:
    """A TOUCH of ``keys`` read from the block table (no answer)."""
    return header(TOUCH, NO_REPLY, seq, len(keys), len(keys) * KEY_BYTES) + b"".join(keys)


def lease_frame(seq: int, keys: list[bytes], ttl_s: float, max_bytes: int, prefix: bool,
                release: list[bytes]) -> bytes:
    """A LEASE of ``keys`` for ``ttl_s`` seconds that first releases ``release`` (16-byte ids)."""
    payload = LEASE_ARGS.size + len(release) * LEASE_ID_BYTES + len(keys) * KEY_BYTES
    return b"".join((header(LEASE, PREFIX if prefix else 0, seq, len(keys), payload),
                     LEASE_ARGS.pack(ttl_s, max_bytes, len(release)), *release, *keys))


def reserve_frame(seq: int, keys: list[bytes], sizes: list[int], ttl_s: float,
                  metas: list[bytes] | None = None) -> bytes:
    """A RESERVE of ``keys`` (32 bytes each, checked by the caller) of ``sizes`` bytes for
    ``ttl_s`` seconds; ``metas``: one serialized ``BlockMeta`` per key (b"": none), or None."""
    parts = [RESERVE_ARGS.pack(ttl_s), struct.pack(f"<{len(sizes)}Q", *sizes), *keys]
    if metas is not None:
        for m in metas:
            parts += (META_LENGTH.pack(len(m)), m)
    body = b"".join(parts)
    return header(RESERVE, META if metas is not None else 0, seq, len(keys), len(body)) + body


def reserve_frame_length(count: int, metas: list[bytes] | None) -> int:
    """The length field of :func:`reserve_frame` for ``count`` keys and ``metas``: what is
    held to :data:`MAX_FRAME_BYTES`."""
    return (HEADER_BYTES - LENGTH.size + RESERVE_ARGS.size + (8 + KEY_BYTES) * count
            + sum(META_LENGTH.size + len(m) for m in metas or ()))


def commit_frame(seq: int, keys: list[bytes], abort: bool) -> bytes:
    """A COMMIT (``abort``: an abort) of the reservations of ``keys``."""
    return header(COMMIT, ABORT if abort else 0, seq, len(keys), len(keys) * KEY_BYTES) + b"".join(keys)


def split_reserve(payload, count: int, key_bytes: int, flags: int) -> tuple[float, list[int], list[bytes], list[bytes] | None]:
    """A RESERVE payload as ``(TTL s, sizes, keys, serialized metas or None)``. Raises FrameError."""
    if key_bytes != KEY_BYTES:
        raise FrameError(f"the frame's keys have {key_bytes} bytes; block keys are {KEY_BYTES} bytes")
    if count > MAX_FRAME_KEYS:
        raise FrameError(f"{count} keys in one frame; at most {MAX_FRAME_KEYS}")
    keys_at = RESERVE_ARGS.size + 8 * count
    metas_at = keys_at + KEY_BYTES * count
    if len(payload) < metas_at or (not flags & META and len(payload) != metas_at):
        raise FrameError(f"a RESERVE frame of {len(payload)} payload bytes for {count} keys")
    (ttl,) = RESERVE_ARGS.unpack_from(payload)
    sizes = list(struct.unpack_from(f"<{count}Q", payload, RESERVE_ARGS.size))
    keys = split_keys(payload[:metas_at], count, key_bytes, keys_at)
    if not flags & META:
        return ttl, sizes, keys, None
    metas, at = [], metas_at
    for _ in range(count):
        if at + META_LENGTH.size > len(payload):
            raise FrameError("a RESERVE frame's block metadata ends early")
        (n,) = META_LENGTH.unpack_from(payload, at)
        at += META_LENGTH.size
        if at + n > len(payload):
            raise FrameError("a RESERVE frame's block metadata ends early")
        metas.append(bytes(payload[at:at + n]))
        at += n
    if at != len(payload):
        raise FrameError(f"a RESERVE frame carries {len(payload) - at} bytes after its block metadata")
    return ttl, sizes, keys, metas


def release_frame(seq: int, ids: list[bytes], reply: bool) -> bytes:
    """A RELEASE of ``ids`` (16 bytes each); without ``reply`` the daemon sends no answer."""
    return header(RELEASE, 0 if reply else NO_REPLY, seq, len(ids), len(ids) * LEASE_ID_BYTES) + b"".join(ids)


def error_frame(seq: int, exc: BaseException) -> bytes:
    """An ERROR answer naming ``exc``'s class in :mod:`kvstore.common.errors` (the nearest
    one it derives from; KVStoreError for anything that is not a store error)."""
    cls = next((k for k in type(exc).__mro__ if getattr(errors, k.__name__, None) is k), errors.KVStoreError)
    if not issubclass(cls, errors.KVStoreError):
        cls = errors.KVStoreError
    raw = cls.__name__.encode("ascii")[:255]
    message = f"{exc}" if isinstance(exc, errors.KVStoreError) else f"internal error: {type(exc).__name__}: {exc}"
    body = bytes((len(raw),)) + raw + message.encode("utf-8", "replace")[:4096]
    return header(ERROR, 0, seq, 0, len(body)) + body


def decode_error(payload: bytes | memoryview) -> errors.KVStoreError:
    """The store error an ERROR answer names (KVStoreError when the name is not one)."""
    payload = bytes(payload)
    n = payload[0] if payload else 0
    name = payload[1:1 + n].decode("ascii", "replace")
    message = payload[1 + n:].decode("utf-8", "replace")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.KVStoreError)):
        cls = errors.KVStoreError
    return cls(message)


def split_keys(payload, count: int, key_bytes: int, start: int = 0) -> list[bytes]:
    """``count`` keys of ``key_bytes`` bytes from ``payload[start:]``, which must hold exactly
    them. Raises FrameError naming what is wrong."""
    if key_bytes != KEY_BYTES:
        raise FrameError(f"the frame's keys have {key_bytes} bytes; block keys are {KEY_BYTES} bytes")
    if count > MAX_FRAME_KEYS:
        raise FrameError(f"{count} keys in one frame; at most {MAX_FRAME_KEYS}")
    if len(payload) - start != count * KEY_BYTES:
        raise FrameError(f"the frame says {count} keys but carries {len(payload) - start} bytes of keys")
    raw = bytes(payload[start:])
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def split_ids(payload, count: int, start: int = 0) -> list[str]:
    """``count`` 16-byte lease ids from ``payload[start:]`` as the store names them (hex)."""
    if count > MAX_FRAME_RELEASES:
        raise FrameError(f"{count} lease ids in one frame; at most {MAX_FRAME_RELEASES}")
    end = start + count * LEASE_ID_BYTES
    if len(payload) < end:
        raise FrameError(f"the frame says {count} lease ids but carries {max(len(payload) - start, 0)} bytes of them")
    raw = bytes(payload[start:end])
    return [raw[i:i + LEASE_ID_BYTES].hex() for i in range(0, len(raw), LEASE_ID_BYTES)]


def lease_id_bytes(lease_id: str) -> bytes | None:
    """The 16 bytes of a store lease id (32 hex digits); None when it is not one."""
    try:
        raw = bytes.fromhex(lease_id)
    except (ValueError, TypeError):
        return None
    return raw if len(raw) == LEASE_ID_BYTES else None
