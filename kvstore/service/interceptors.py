"""gRPC interceptors and stream guards of the daemon: bearer tokens, undecodable
requests, idle Put streams.

- :class:`BearerTokenInterceptor` refuses calls without a configured token before any
  handler runs (every method, streaming or not; the health service stays open).
- :class:`RequestDecodeInterceptor` hands a request whose bytes do not decode to the
  handler as a :class:`MalformedRequest`, answered INVALID_ARGUMENT with the decoder's
  message instead of grpc's bare INTERNAL.
- :class:`StreamWatchdog` cancels client streams that send nothing for too long.
- :func:`unary_handler` / :func:`streaming_handler` wrap each handler of the service:
  the request is checked (:func:`well_formed`), the call timed for the metrics, and
  every failure answered with one status code (:mod:`kvstore.common.status`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
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
    (:func:`kvstore.common.status.code_for`; INTERNAL failures are logged with their trace)."""
    if isinstance(exc, grpc.RpcError):
        # the call already failed in the transport (a client message over the size limit,
        # a cancelled stream): grpc has sent the status; nothing is wrong with the daemon
        log.info("%s: the call ended in the transport: %s", method, context.code() or "cancelled")
        return
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


class StreamWatchdog:
    """Cancels client streams that send nothing for ``idle_s`` seconds, or no first message
    within ``first_message_s`` seconds (default ``idle_s``).

    A Put stream holds one server thread while it waits for its client; a client that
    stops mid-stream (a paused worker) would otherwise hold that thread forever, and a
    few such clients would starve every other caller. A client sends its first message
    as soon as it opens a stream, so one that has sent nothing is given less time. Cancelling
    the call ends the handler's wait; the open block is aborted (never made visible).
    """

    def __init__(self, idle_s: float, first_message_s: float | None = None):
        self.idle_s = idle_s
        self.first_message_s = idle_s if first_message_s is None else min(first_message_s, idle_s)
        self._active: dict[int, list] = {}   # id -> [context, last activity (monotonic), messages seen]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cancelled = 0

    @contextlib.contextmanager
    def watch(self, context):
        rec = [context, time.monotonic(), False]
        with self._lock:
            self._active[id(rec)] = rec
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-stream-watchdog", daemon=True)
                self._thread.start()

        def touch(iterator):
            for item in iterator:
                rec[1], rec[2] = time.monotonic(), True
                yield item
        try:
            yield touch
        finally:
            with self._lock:
                self._active.pop(id(rec), None)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.first_message_s / 4))
            now = time.monotonic()
            with self._lock:
                stale = [r for r in self._active.values()
                         if now - r[1] > (self.idle_s if r[2] else self.first_message_s)]
            for context, _, started in stale:
                if started:
                    log.warning("cancelling a Put stream idle for more than %.0f s", self.idle_s)
                else:
                    log.warning("cancelling a Put stream that sent nothing in %.0f s", self.first_message_s)
                self.cancelled += 1
                context.cancel()


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
