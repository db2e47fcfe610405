"""Exception types of the store, as clients and operators see them.

A miss is a normal result (a ``found=False`` value or a shorter prefix), never an
exception. Everything here is a failure with a message that says what went wrong.
Each maps to one gRPC status code (:mod:`kvstore.common.status`), and back in the client.
Media raise their own errors (:mod:`tiers.errors`); the store core translates them.

=====================  ===================  =============================================
error                  gRPC status          meaning
=====================  ===================  =============================================
InvalidRequest         INVALID_ARGUMENT     malformed request: key length, size, range,
                                            a number that is not finite or out of range
SizeConflict           ALREADY_EXISTS       a put of a stored key with a different size
TierFull               RESOURCE_EXHAUSTED   no tier has (or can make) room for a block
WriteConflict          ABORTED              another client is still writing the same key
MessageTooLarge        OUT_OF_RANGE         a message would exceed the transport's limit
BlockNotFound          NOT_FOUND            an operation that needs a stored block, lease
                                            or reservation found none
CorruptBlock           DATA_LOSS            stored bytes failed their checksum
TierIOError            UNAVAILABLE          a medium failed; a retry may succeed
NotServing             UNAVAILABLE          the daemon cannot store or serve right now
Unauthenticated        UNAUTHENTICATED      missing or wrong bearer token
FeatureDisabled        FAILED_PRECONDITION  the call needs a component that is off
StreamTimeout          DEADLINE_EXCEEDED    the daemon ended a streaming call that ran
                                            longer than ``[server] stream_timeout_s``
StoreUnavailable       (client side)        the daemon could not be reached in time
=====================  ===================  =============================================
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of all store errors."""


class ConfigError(KVStoreError, ValueError):
    """The TOML config is invalid; the message names the offending key."""


class InvalidRequest(KVStoreError, ValueError):
    """A request is malformed: bad key length, payload/size mismatch, bad range, a number
    that is not finite, negative or absurdly far from now."""


class SizeConflict(KVStoreError):
    """A put of a key that is stored with a different size. The first writer wins: the
    stored block is kept and the put is refused (counted in ``puts_size_conflict``)."""


class TierFull(KVStoreError):
    """A block cannot be placed: no tier has (or can make) room for it."""


class WriteConflict(KVStoreError):
    """Another client is still writing the same key and did not finish in time."""


class MessageTooLarge(KVStoreError):
    """A message would exceed the gRPC message size limit; the batching is at fault, not
    the store (which is not full)."""


class BlockNotFound(KVStoreError, KeyError):
    """An operation that needs a stored block, a lease or a reservation found none."""

    def __str__(self) -> str:          # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class CorruptBlock(KVStoreError):
    """Stored bytes failed their checksum or were truncated; they are never served."""


class CopyMissing(CorruptBlock):
    """A stored copy's bytes are gone from its tier (a block file deleted): dropped like a
    corrupt copy, counted in ``copies_missing``."""


class TierIOError(KVStoreError, OSError):
    """A medium failed to read or write (I/O error, timeout, remote peer down)."""


class NotServing(KVStoreError):
    """The daemon cannot store or serve right now (health NOT_SERVING; Stats says why)."""


class Unauthenticated(KVStoreError):
    """A call carried no bearer token or a wrong one."""


class FeatureDisabled(KVStoreError):
    """The call needs a component that is not configured (hints without prefetch, the
    shared-memory path in a multi-tenant config, leases without a shared arena)."""


class StreamTimeout(KVStoreError):
    """The daemon ended a streaming call (Get, GetRaw, Put, PutRaw) that ran longer than
    ``[server] stream_timeout_s``; the client sees DEADLINE_EXCEEDED (StoreUnavailable).
    Blocks of the call already stored stay stored; a block in progress is aborted."""


class StoreUnavailable(KVStoreError, ConnectionError):
    """The daemon could not be reached or did not answer in time (client side)."""
