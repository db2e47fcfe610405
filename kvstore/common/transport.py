"""gRPC transport settings shared by the daemon and the client.

Every message stays below ``max_message_bytes`` (both sides set the same limit):

- data messages (Get replies, PutRaw frames) carry at most ``chunk_bytes`` of payload
  plus :data:`FRAMING_BYTES` of framing, counting the records of misses;
- requests that list keys (Get, Lookup, Delete, Lease, Reserve, Commit) are split by the
  client into requests of at most :func:`keys_per_request` keys: what fits the message
  limit, and never more than :data:`MAX_KEYS_PER_REQUEST` (the daemon refuses more).

A client's channel reconnects quickly after an outage (:func:`client_channel_options`):
gRPC's default reconnect back-off grows to 120 s, so a client that saw a 15 s outage
could wait another 10 s or more before its channel tried again.
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

MAX_KEYS_PER_REQUEST = 1 << 20
"""Most keys one request may list (1,048,576): the daemon refuses more with
INVALID_ARGUMENT (``kvstore.service.validate``); the client splits longer lists."""

RECONNECT_BACKOFF_MS = (100, 1000)
"""First and longest wait between a client channel's reconnect attempts (milliseconds):
a channel whose daemon came back connects again within about a second (gRPC adds up to
20 % jitter). ``grpc.min_reconnect_backoff_ms`` is left alone: gRPC core also takes it
as the timeout of one connection attempt (default 20 s), and 100 ms would fail the
handshake of a daemon on a loaded machine."""

KEEPALIVE_MS = (30_000, 10_000)
"""A client pings a connection that carries calls but no data after the first value
(ms), and drops it when the ping is not answered within the second (a peer that is gone
without closing the connection, e.g. a crashed host): the calls then fail at once instead
of at their deadline, and the channel reconnects."""


def default_chunk_bytes(max_message_bytes: int) -> int:
    """The payload per message that fits a message limit: 1 MiB, or less for small limits."""
    return max(1, min(DEFAULT_CHUNK_BYTES, max_message_bytes - FRAMING_BYTES))


def keys_per_request(max_message_bytes: int, per_key: int = KEY_FIELD_BYTES, extra: int = 0,
                     max_keys: int = MAX_KEYS_PER_REQUEST) -> int:
    """Most keys one request may list so that it stays below ``max_message_bytes``
    (``per_key`` wire bytes per key, ``extra`` bytes of other fields, and
    :data:`FRAMING_BYTES` of slack) and lists at most ``max_keys`` keys. At least 1."""
    return max(1, min(max_keys, (max_message_bytes - FRAMING_BYTES - extra) // per_key))


def parts(items: Sequence, n: int) -> list[Sequence]:
    """``items`` in consecutive slices of at most ``n`` (none for an empty sequence)."""
    return [items[i:i + n] for i in range(0, len(items), n)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options for a message size limit in bytes. A server built with
    them accepts the keepalive pings of :func:`client_channel_options` (by default gRPC
    servers close connections that ping more often than every 5 minutes)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS[0] // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def client_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The options of a client's channel: :func:`channel_options`, the reconnect back-off
    of :data:`RECONNECT_BACKOFF_MS` and the keepalive of :data:`KEEPALIVE_MS`."""
    first, longest = RECONNECT_BACKOFF_MS
    return channel_options(max_message_bytes) + [
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS[0]),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS[1]),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]
