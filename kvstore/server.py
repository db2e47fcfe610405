"""The gRPC service: block Put/Get/Lookup/Delete/Stats, tool-call hints, HBM leases.

Runs on a thread pool (``[server] workers``): handlers copy payloads with the GIL
released inside numpy/file I/O, and the manager's lock is held only for catalogue
changes. Every failure maps to one status code with a message that says what was
wrong (:func:`status_for`); the daemon keeps serving after any bad request.

=====================  ======================================================
exception              gRPC status
=====================  ======================================================
InvalidRequest         INVALID_ARGUMENT (bad key length, size mismatch, range)
TierFull               RESOURCE_EXHAUSTED (no tier can hold the block)
TimeoutError           ABORTED (another client is still writing the same key)
CorruptBlock           DATA_LOSS
TierIOError            UNAVAILABLE (the medium failed; retry may succeed)
Unauthenticated        UNAUTHENTICATED (missing or wrong bearer token)
anything else          INTERNAL (logged with a traceback)
=====================  ======================================================

A request whose bytes do not decode as its protobuf message also gets
INVALID_ARGUMENT (:class:`RequestDecodeInterceptor`), not grpc's INTERNAL.

**Tenants** (:mod:`kvstore.auth`): with ``[server.tenants]`` every client key is mapped
to the caller's tenant key space before the manager sees it, and keys in replies are the
client's own; a tenant can neither read, look up nor delete another tenant's blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Iterable, Iterator

import grpc

from tiers.base import TierKind

from . import errors
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pb_grpc
from .auth import SHARED, Authenticator, KeySpace
from .keys import KEY_BYTES
from .manager import TierManager

log = logging.getLogger("kvstore.server")

SERVICE_PREFIX = "/kvstore.v1.KVStore/"
MAX_RANGES = 4096
"""Most byte ranges one Get may ask for (a TP rank asks for 2 per layer)."""

_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.TierFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (errors.TierIOError, grpc.StatusCode.UNAVAILABLE),
    (errors.BlockNotFound, grpc.StatusCode.NOT_FOUND),
    (TimeoutError, grpc.StatusCode.ABORTED),
)


class _StatusError(Exception):
    """Ends a call with a status code that no store error stands for (the call needs a
    component that is not configured). Handlers raise it instead of calling
    ``context.abort``, whose bare exception the handler wrappers would turn into INTERNAL."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an exception raised while serving a call."""
    if isinstance(exc, _StatusError):
        return exc.code
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
        context.abort(code, f"{method}: internal error: {type(exc).__name__}: {exc}")
    log.info("%s -> %s: %s", method, code.name, exc)
    context.abort(code, f"{method}: {exc}")


def _unary(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, _well_formed(request), context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
            _abort(context, exc, method.__name__)
    return wrapper


def _streaming(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, _well_formed(request), context)
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, method.__name__)
    return wrapper


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    for i, k in enumerate(out):
        if len(k) != KEY_BYTES:
            raise errors.InvalidRequest(f"keys[{i}] has {len(k)} bytes; block keys are {KEY_BYTES} bytes")
    return out


def _check_ranges(ranges) -> list[tuple[int, int]] | None:
    """Byte ranges of a Get: at most MAX_RANGES, none overlapping another, so the bytes
    returned per block never exceed the block (bounds are checked against each block)."""
    out = [(r.offset, r.length) for r in ranges]
    if not out:
        return None
    if len(out) > MAX_RANGES:
        raise errors.InvalidRequest(f"{len(out)} byte ranges; at most {MAX_RANGES} per request")
    end = 0
    for off, length in sorted(out):
        if off < end:
            raise errors.InvalidRequest(f"byte range ({off}, {length}) overlaps another range")
        end = off + length
    return out


class MalformedRequest:
    """Stands in for a request message whose bytes did not decode (see
    :class:`RequestDecodeInterceptor`); the handlers turn it into INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _well_formed(request):
    if isinstance(request, MalformedRequest):
        raise errors.InvalidRequest(f"request message does not decode: {request.error}")
    return request


class KVStoreService(pb_grpc.KVStoreServicer):
    """Serves one :class:`~kvstore.manager.TierManager`.

    Args:
        manager: the block store.
        max_chunk_bytes: largest data field of one Get message (bytes).
        hints: object with ``tool_call_start(trajectory_id, tool, start_time, keys) -> float``
            and ``resume(trajectory_id, time) -> (bool, float)`` (the prefetch scheduler);
            None: the calls return FAILED_PRECONDITION.
        leases: object with ``lease(keys, ttl) -> (lease_id, handles, expires_at)`` and
            ``release(lease_id) -> bool`` (the HBM tier); None: UNIMPLEMENTED.
        auth: maps each call's bearer token to its tenant (:mod:`kvstore.auth`); None: one
            shared key space and no token (the interceptor, when configured, checks it).
    """

    def __init__(self, manager: TierManager, *, max_chunk_bytes: int = 1 << 20, hints=None, leases=None,
                 auth: Authenticator | None = None, stream_idle_timeout_s: float = 30.0):
        self.manager = manager
        self.max_chunk_bytes = max_chunk_bytes
        self.hints = hints
        self.leases = leases
        self.auth = auth
        self.idle = StreamWatchdog(stream_idle_timeout_s)

    def _space(self, context) -> KeySpace:
        """The caller's key space. Raises Unauthenticated (defence in depth: the
        :class:`BearerTokenInterceptor` refuses such calls before they get here)."""
        if self.auth is None:
            return SHARED
        space = self.auth.key_space(context.invocation_metadata())
        if space is None:
            raise errors.Unauthenticated("missing or wrong bearer token")
        return space

    # ------------------------------------------------------------------ put

    @_unary
    def Put(self, request_iterator: Iterator[pb.PutBatch], context) -> pb.PutReply:
        space = self._space(context)
        with self.idle.watch(context) as touch:
            return self._put((chunk for batch in touch(request_iterator)
                              for chunk in _well_formed(batch).chunks), space)

    @_unary
    def PutInline(self, request: pb.PutBatch, context) -> pb.PutReply:
        return self._put(request.chunks, self._space(context))

    def _put(self, chunks: Iterable[pb.PutChunk], space: KeySpace = SHARED) -> pb.PutReply:
        """Store a sequence of chunks (blocks in order, each block's chunks in order).

        Error messages name blocks by the client's key; the manager sees ``space``'s keys.
        """
        m = self.manager
        stored = present = refused = nbytes = 0
        pending = None
        name = ""                      # the client key of ``pending`` (hex prefix), for messages
        skip_key: bytes | None = None
        skip_left = 0
        try:
            for chunk in chunks:
                client_key = chunk.key
                if len(client_key) != KEY_BYTES:
                    raise errors.InvalidRequest(f"key has {len(client_key)} bytes; block keys are {KEY_BYTES} bytes")
                key = space.internal(client_key)
                if skip_key is not None and key == skip_key and chunk.offset > 0:
                    # further chunks of a block that is already stored or was not admitted
                    skip_left -= len(chunk.data)
                    if skip_left <= 0:
                        skip_key = None
                    continue
                skip_key = None
                if pending is not None and key != pending.key:
                    raise errors.InvalidRequest(
                        f"block {name} ended after {pending.written} of {pending.size} bytes")
                if pending is None:
                    name = client_key.hex()[:16]
                    if chunk.offset != 0:
                        raise errors.InvalidRequest(f"first chunk of block {name} starts at "
                                                    f"offset {chunk.offset}, not 0")
                    if chunk.total_size == 0:
                        raise errors.InvalidRequest(f"block {name} has total_size 0")
                    if len(chunk.data) > chunk.total_size:
                        raise errors.InvalidRequest(f"block {name}: {len(chunk.data)} bytes of data "
                                                    f"for total_size {chunk.total_size}")
                    outcome = m.begin_put(key, chunk.total_size)
                    if outcome.already_present or outcome.not_admitted:
                        present += outcome.already_present
                        refused += outcome.not_admitted
                        skip_left = chunk.total_size - len(chunk.data)
                        skip_key = key if skip_left > 0 else None
                        continue
                    pending = outcome.pending
                elif chunk.total_size != pending.size:
                    raise errors.InvalidRequest(f"block {name}: total_size changed from "
                                                f"{pending.size} to {chunk.total_size} mid-block")
                m.write_chunk(pending, chunk.offset, chunk.data)
                if pending.written == pending.size:
                    done, pending = pending, None
                    m.commit_put(done)
                    stored += 1
                    nbytes += done.size
            if pending is not None:
                raise errors.InvalidRequest(f"stream ended inside block {name} "
                                            f"({pending.written} of {pending.size} bytes)")
        finally:
            if pending is not None:
                m.abort_put(pending)
        return pb.PutReply(stored=stored, already_present=present, bytes_stored=nbytes, not_admitted=refused)

    # ------------------------------------------------------------------ get

    @_streaming
    def Get(self, request: pb.GetRequest, context) -> Iterator[pb.GetBatch]:
        space = self._space(context)
        keys = _check_keys(request.keys)
        ranges = _check_ranges(request.ranges)
        step = self.max_chunk_bytes
        if request.max_chunk_bytes:
            step = min(step, request.max_chunk_bytes)
        batch: list[pb.GetChunk] = []
        batch_bytes = 0
        for key in keys:                       # replies carry the client's key
            res = self.manager.get(space.internal(key), ranges)
            if not res.found:
                batch.append(pb.GetChunk(key=key, found=False))
                if request.stop_at_miss:
                    break
                continue
            data, total, tier = res.data, len(res.data), int(res.tier)
            if total <= step:
                if batch_bytes + total > step and batch:
                    yield pb.GetBatch(chunks=batch)
                    batch, batch_bytes = [], 0
                batch.append(pb.GetChunk(key=key, found=True, tier=tier, total_size=total, offset=0, data=data))
                batch_bytes += total
                continue
            if batch:
                yield pb.GetBatch(chunks=batch)
                batch, batch_bytes = [], 0
            mv = memoryview(data)
            for off in range(0, total, step):
                yield pb.GetBatch(chunks=[pb.GetChunk(key=key, found=True, tier=tier, total_size=total,
                                                      offset=off, data=bytes(mv[off:off + step]))])
        if batch:
            yield pb.GetBatch(chunks=batch)

    # ------------------------------------------------------------------ others

    @_unary
    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupReply:
        space = self._space(context)
        keys = space.internal_many(_check_keys(request.keys))
        if self.hints is not None:
            self.hints.observe_request(keys)   # reuse statistics for next_use and prefetch
        res = self.manager.lookup(keys)
        return pb.LookupReply(hit_blocks=res.hit_blocks, tiers=[int(t) for t in res.tiers])

    @_unary
    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteReply:
        space = self._space(context)
        return pb.DeleteReply(deleted=self.manager.delete(space.internal_many(_check_keys(request.keys))))

    @_unary
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        self._space(context)
        tiers = [pb.TierStats(tier=int(u.kind), name=u.name, capacity_bytes=u.capacity_bytes,
                              used_bytes=u.used_bytes, blocks=u.blocks, policy=u.policy)
                 for u in self.manager.usage()]
        counters = {k: int(v) for k, v in self.manager.counters.items() if v >= 0}
        return pb.StatsReply(tiers=tiers, counters=counters)

    @_unary
    def ToolCallStart(self, request: pb.ToolCallStartRequest, context) -> pb.ToolCallStartReply:
        space = self._space(context)
        if self.hints is None:
            raise _StatusError(grpc.StatusCode.FAILED_PRECONDITION, "tool-call hints are off: set [prefetch] enabled = true "
                               "or use the next_use eviction policy")
        if not request.trajectory_id:
            raise errors.InvalidRequest("trajectory_id must not be empty")
        keys = space.internal_many(_check_keys(request.keys))
        predicted = self.hints.tool_call_start(space.scoped(request.trajectory_id), request.tool,
                                               request.start_time or None, keys)
        return pb.ToolCallStartReply(predicted_resume_time=predicted)

    @_unary
    def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        space = self._space(context)
        if self.hints is None:
            raise _StatusError(grpc.StatusCode.FAILED_PRECONDITION, "tool-call hints are off: set [prefetch] enabled = true "
                               "or use the next_use eviction policy")
        known, observed = self.hints.resume(space.scoped(request.trajectory_id), request.time or None)
        return pb.ResumeReply(known=known, observed_seconds=observed)

    @_unary
    def Lease(self, request: pb.LeaseRequest, context) -> pb.LeaseReply:
        space = self._space(context)
        if self.leases is None:
            raise _StatusError(grpc.StatusCode.UNIMPLEMENTED, "no HBM tier is configured ([tiers.hbm] enabled = false)")
        keys = _check_keys(request.keys)
        internal = space.internal_many(keys)
        client_of = dict(zip(internal, keys))
        lease_id, handles, expires_at = self.leases.lease(internal, request.ttl_seconds or None)
        return pb.LeaseReply(lease_id=lease_id, expires_at=expires_at, blocks=[
            pb.BlockHandle(key=client_of.get(h.key, h.key), found=h.found, ipc_handle=h.ipc_handle,
                           offset=h.offset, size=h.size, device=h.device) for h in handles])

    @_unary
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        self._space(context)
        if self.leases is None:
            raise _StatusError(grpc.StatusCode.UNIMPLEMENTED, "no HBM tier is configured ([tiers.hbm] enabled = false)")
        return pb.ReleaseReply(released=self.leases.release(request.lease_id))


def _denial_handlers(code: grpc.StatusCode, message: str) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers that fail a call with ``code``, one per request/response streaming kind."""

    def deny(request, context):
        context.abort(code, message)

    return {
        "unary": grpc.unary_unary_rpc_method_handler(deny),
        "stream_in": grpc.stream_unary_rpc_method_handler(deny),
        "stream_out": grpc.unary_stream_rpc_method_handler(deny),
        "stream_both": grpc.stream_stream_rpc_method_handler(deny),
    }


class StreamWatchdog:
    """Cancels client streams that send nothing for ``idle_s`` seconds.

    A Put stream holds one server thread while it waits for its client; a client that
    stops mid-stream (a paused worker) would otherwise hold that thread forever, and a
    few such clients would starve every other caller. Cancelling the call ends the
    handler's wait; the open block is aborted (never made visible).
    """

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._active: dict[int, list] = {}   # id -> [context, last activity (monotonic)]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cancelled = 0

    @contextlib.contextmanager
    def watch(self, context):
        rec = [context, time.monotonic()]
        with self._lock:
            self._active[id(rec)] = rec
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-stream-watchdog", daemon=True)
                self._thread.start()

        def touch(iterator):
            for item in iterator:
                rec[1] = time.monotonic()
                yield item
        try:
            yield touch
        finally:
            with self._lock:
                self._active.pop(id(rec), None)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                stale = [r for r in self._active.values() if now - r[1] > self.idle_s]
            for context, _ in stale:
                log.warning("cancelling a Put stream idle for more than %.0f s", self.idle_s)
                self.cancelled += 1
                context.cancel()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata carries no configured bearer token.

    Args:
        auth: an :class:`~kvstore.auth.Authenticator`, or a single token string (one
            shared key space).

    Every call is checked, streaming or not, known method or not; the comparison is
    constant-time (see :mod:`kvstore.auth`). The standard health service stays open so
    that liveness probes need no secret.
    """

    def __init__(self, auth: Authenticator | str):
        self.auth = Authenticator({auth: ""}) if isinstance(auth, str) else auth
        self._deny = _denial_handlers(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

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
        if handler is None or not method.startswith(SERVICE_PREFIX) or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
                return MalformedRequest(f"{type(e).__name__}: {e}")

        return handler._replace(request_deserializer=lenient)


__all__ = ["KVStoreService", "BearerTokenInterceptor", "RequestDecodeInterceptor", "MalformedRequest",
           "status_for", "TierKind"]
