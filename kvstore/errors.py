"""Exception types of the store.

A miss is a normal result (a ``found=False`` value or a shorter prefix), never an
exception. Everything here is a failure with a message that says what went wrong.
Each maps to one gRPC status code in :mod:`kvstore.server`.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of all store errors."""


class ConfigError(KVStoreError, ValueError):
    """The TOML config is invalid; the message names the offending key."""


class InvalidRequest(KVStoreError, ValueError):
    """A request is malformed: bad key length, payload/size mismatch, bad range."""


class TierFull(KVStoreError):
    """A block cannot be placed: no tier has (or can make) room for it."""


class BlockNotFound(KVStoreError, KeyError):
    """An operation that needs a stored block (not a lookup) found none."""


class CorruptBlock(KVStoreError):
    """Stored bytes failed their checksum or were truncated; they are never served."""


class TierIOError(KVStoreError, OSError):
    """A medium failed to read or write (disk full, I/O error, timeout)."""


class Unauthenticated(KVStoreError):
    """A call carried no bearer token or a wrong one."""


class StoreUnavailable(KVStoreError, ConnectionError):
    """The daemon could not be reached or did not answer in time (client side)."""
