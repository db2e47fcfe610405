"""Store errors <-> gRPC status codes, one table for the server and the client.

The server ends a failed call with the code of its exception (:func:`code_for`); the
client raises the matching :mod:`kvstore.common.errors` exception (:func:`error_for`), so a
caller sees the same error type in-process and over the wire. The table is in
:mod:`kvstore.common.errors`' docstring too.
"""

from __future__ import annotations

import grpc

from kvstore.common import errors

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.SizeConflict, grpc.StatusCode.ALREADY_EXISTS),
    (errors.TierFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.WriteConflict, grpc.StatusCode.ABORTED),
    (errors.MessageTooLarge, grpc.StatusCode.OUT_OF_RANGE),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (errors.NotServing, grpc.StatusCode.UNAVAILABLE),
    (errors.TierIOError, grpc.StatusCode.UNAVAILABLE),
    (errors.BlockNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FeatureDisabled, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StreamTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
)

_ERRORS: dict[grpc.StatusCode, type[errors.KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.ALREADY_EXISTS: errors.SizeConflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.TierFull,
    grpc.StatusCode.ABORTED: errors.WriteConflict,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.Unauthenticated,
    grpc.StatusCode.NOT_FOUND: errors.BlockNotFound,
    grpc.StatusCode.UNAVAILABLE: errors.StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.StoreUnavailable,
    grpc.StatusCode.DATA_LOSS: errors.CorruptBlock,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FeatureDisabled,
}


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an exception raised while serving a call (INTERNAL for
    anything that is not a store error: a bug, logged with its traceback)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _message_limit(detail: str) -> bool:
    return "larger than max" in detail or "message larger" in detail.lower()


def error_for(err: grpc.RpcError) -> errors.KVStoreError:
    """The :mod:`kvstore.common.errors` exception for a failed call.

    A call refused by gRPC itself for a message over the size limit (RESOURCE_EXHAUSTED
    "Sent/Received message larger than max") is a :class:`~kvstore.common.errors.MessageTooLarge`,
    never a full store. UNAVAILABLE from the daemon (a medium failed, not serving) and
    from the transport (daemon down) are both :class:`~kvstore.common.errors.StoreUnavailable`.
    """
    code = err.code() if isinstance(err, grpc.Call) else None
    detail = (err.details() if isinstance(err, grpc.Call) else str(err)) or ""
    name = code.name if code is not None else "UNKNOWN"
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE) and (
            code is grpc.StatusCode.OUT_OF_RANGE or _message_limit(detail)):
        hint = (" (the client's max_message_bytes must not exceed the daemon's [server] max_message_bytes)"
                if _message_limit(detail) else "")
        return errors.MessageTooLarge(f"{name}: {detail}{hint}")
    cls = _ERRORS.get(code, errors.KVStoreError)
    return cls(f"{name}: {detail}")
