"""gRPC transport settings shared by the daemon and the client.

Every message stays below ``max_message_bytes`` (both sides set the same limit):

- data messages (Get replies, PutRaw frames) carry at most ``chunk_bytes`` of payload
  plus :data:`FRAMING_BYTES` of framing, counting the records of misses;
- requests that list keys (Get, Lookup, Delete, Lease, Reserve, Commit) are split by the
  client into requests of at most :func:`keys_per_request` keys.
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_CHUNK_BYTES = 1 << 20
"""Payload bytes per message (4 MiB messages measured ~3x slower on loopback)."""

DEFAULT_MESSAGE_BYTES = 64 << 20
"""gRPC message size limit of both sides (``[server] max_message_bytes``)."""

FRAMING_BYTES = 16 << 10
"""Room kept in every message for headers and per-block records."""

KEY_FIELD_BYTES = 34
"""Wire bytes of one 32-byte key in a ``repeated bytes`` field (tag, length, key)."""


def default_chunk_bytes(max_message_bytes: int) -> int:
    """The payload per message that fits a message limit: 1 MiB, or less for small limits."""
    return max(1, min(DEFAULT_CHUNK_BYTES, max_message_bytes - FRAMING_BYTES))


def keys_per_request(max_message_bytes: int, per_key: int = KEY_FIELD_BYTES, extra: int = 0) -> int:
    """Most keys one request may list so that it stays below ``max_message_bytes``:
    ``per_key`` wire bytes per key, ``extra`` bytes of other fields, and
    :data:`FRAMING_BYTES` of slack. At least 1."""
    return max(1, (max_message_bytes - FRAMING_BYTES - extra) // per_key)


def parts(items: Sequence, n: int) -> list[Sequence]:
    """``items`` in consecutive slices of at most ``n`` (none for an empty sequence)."""
    return [items[i:i + n] for i in range(0, len(items), n)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options for a message size limit in bytes."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
