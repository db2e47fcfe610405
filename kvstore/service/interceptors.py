"""gRPC interceptors and handler wrappers of the daemon: bearer tokens, undecodable
requests, one status code per failure (the bounds of streaming calls:
:mod:`kvstore.service.streams`).

- :class:`BearerTokenInterceptor` refuses calls without a configured token before any
  handler runs (every method, streaming or not; the health service stays open).
- :class:`RequestDecodeInterceptor` hands a request whose bytes do not decode to the
  handler as a :class:`MalformedRequest`, answered INVALID_ARGUMENT with the decoder's
  message instead of grpc's bare INTERNAL.
- :func:`unary_handler` / :func:`streaming_handler` wrap each handler of the service:
  the request is checked (:func:`well_formed`), the call timed for the metrics, and
  every failure answered with one status code (:mod:`kvstore.common.status`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import grpc

from kvstore.service.auth import Authenticator
from kvstore.common.errors import InvalidRequest, Unauthenticated
from kvstore.common.status import code_for

log = logging.getLogger("kvstore.service.server")

SERVICE_PREFIXES = ("/kvstore.v1.KVStore/", "/kvstore.v1.KVStoreData/")


class MalformedRequest:
    """Stands in for a request message whose bytes did not decode (see
    :class:`RequestDecodeInterceptor`); the handlers turn it into INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def well_formed(request):
    """``request`` itself; raises InvalidRequest for a :class:`MalformedRequest`."""
    if isinstance(request, MalformedRequest):
        raise InvalidRequest(f"request message does not decode: {request.error}")
    return request


def abort_call(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    """End the call of handler ``method`` with the status code of ``exc``
    (:func:`kvstore.common.status.code_for`; INTERNAL failures are logged with their trace).
    Always raises: ``context.abort``'s exception, or ``exc`` itself when it is grpc's own
    RpcError (the transport ended the call: grpc finishes it without logging a failure)."""
    if isinstance(exc, grpc.RpcError):
        # the call already failed in the transport (a client message over the size limit,
        # a cancelled stream): grpc has sent the status; nothing is wrong with the daemon
        log.info("%s: the call ended in the transport: %s", method, context.code() or "cancelled")
        raise exc    # grpc's own error: it ends the call quietly (a None reply it would log as a failure)
    code = code_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
        context.abort(code, f"{method}: internal error: {type(exc).__name__}: {exc}")
    log.info("%s -> %s: %s", method, code.name, exc)
    message = str(exc)       # the method's name is put in front here, once
    context.abort(code, message if message.startswith(f"{method}: ") else f"{method}: {message}")


def unary_handler(method: Callable) -> Callable:
    """Wrap a unary-response handler: checked request, timed call (``self.observe``),
    failures as status codes."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        t0 = time.perf_counter()
        try:
            return method(self, well_formed(request), context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
            abort_call(context, exc, method.__name__)
        finally:
            self.observe(method.__name__, time.perf_counter() - t0, context)
    return wrapper


def streaming_handler(method: Callable) -> Callable:
    """Wrap a streaming-response handler like :func:`unary_handler`."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        t0 = time.perf_counter()
        try:
            yield from method(self, well_formed(request), context)
        except Exception as exc:  # noqa: BLE001
            abort_call(context, exc, method.__name__)
        finally:
            self.observe(method.__name__, time.perf_counter() - t0, context)
    return wrapper


def _denial_handlers(code: grpc.StatusCode, message: str) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers that fail a call with ``code`` (from :func:`kvstore.common.status.code_for`),
    one per request/response streaming kind."""

    def deny(request, context):
        context.abort(code, message)

    return {
        "unary": grpc.unary_unary_rpc_method_handler(deny),
        "stream_in": grpc.stream_unary_rpc_method_handler(deny),
        "stream_out": grpc.unary_stream_rpc_method_handler(deny),
        "stream_both": grpc.stream_stream_rpc_method_handler(deny),
    }


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata carries no configured bearer token.

    Args:
        auth: an :class:`~kvstore.service.auth.Authenticator`, or a single token string (one
            shared key space).

    Every call is checked, streaming or not, known method or not; the comparison is
    constant-time (see :mod:`kvstore.service.auth`). The standard health service stays open so
    that liveness probes need no secret.
    """

    def __init__(self, auth: Authenticator | str):
        self.auth = Authenticator({auth: ""}) if isinstance(auth, str) else auth
        refusal = Unauthenticated("missing or wrong bearer token")
        self._deny = _denial_handlers(code_for(refusal), str(refusal))

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        if self.auth.tenant_for(handler_call_details.invocation_metadata) is not None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return self._deny["unary"]
        kind = {(False, False): "unary", (True, False): "stream_in", (False, True): "stream_out",
                (True, True): "stream_both"}[(handler.request_streaming, handler.response_streaming)]
        return self._deny[kind]


class RequestDecodeInterceptor(grpc.ServerInterceptor):
    """Makes a request that does not decode reach the service as a :class:`MalformedRequest`
    (answered INVALID_ARGUMENT with the decoder's message) instead of grpc's bare INTERNAL
    "Exception deserializing request!". Applies to the KVStore service only."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(SERVICE_PREFIXES) or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
                return MalformedRequest(f"{type(e).__name__}: {e}")

        return handler._replace(request_deserializer=lenient)
