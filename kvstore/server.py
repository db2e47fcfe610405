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
"""

from __future__ import annotations

import functools
import hmac
import logging
from typing import Callable, Iterable, Iterator

import grpc

from tiers.base import TierKind

from . import errors
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pb_grpc
from .keys import KEY_BYTES
from .manager import TierManager

log = logging.getLogger("kvstore.server")

_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.TierFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (errors.TierIOError, grpc.StatusCode.UNAVAILABLE),
    (errors.BlockNotFound, grpc.StatusCode.NOT_FOUND),
    (TimeoutError, grpc.StatusCode.ABORTED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an exception raised while serving a call."""
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
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
            _abort(context, exc, method.__name__)
    return wrapper


def _streaming(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, method.__name__)
    return wrapper


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    for i, k in enumerate(out):
        if len(k) != KEY_BYTES:
            raise errors.InvalidRequest(f"keys[{i}] has {len(k)} bytes; block keys are {KEY_BYTES} bytes")
    return out


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
    """

    def __init__(self, manager: TierManager, *, max_chunk_bytes: int = 4 << 20, hints=None, leases=None):
        self.manager = manager
        self.max_chunk_bytes = max_chunk_bytes
        self.hints = hints
        self.leases = leases

    # ------------------------------------------------------------------ put

    @_unary
    def Put(self, request_iterator: Iterator[pb.PutBatch], context) -> pb.PutReply:
        return self._put(chunk for batch in request_iterator for chunk in batch.chunks)

    @_unary
    def PutInline(self, request: pb.PutBatch, context) -> pb.PutReply:
        return self._put(request.chunks)

    def _put(self, chunks: Iterable[pb.PutChunk]) -> pb.PutReply:
        """Store a sequence of chunks (blocks in order, each block's chunks in order)."""
        m = self.manager
        stored = present = nbytes = 0
        pending = None
        skip_key: bytes | None = None
        skip_left = 0
        try:
            for chunk in chunks:
                key = chunk.key
                if len(key) != KEY_BYTES:
                    raise errors.InvalidRequest(f"key has {len(key)} bytes; block keys are {KEY_BYTES} bytes")
                if skip_key is not None and key == skip_key and chunk.offset > 0:
                    # further chunks of a block that was already stored
                    skip_left -= len(chunk.data)
                    if skip_left <= 0:
                        skip_key = None
                    continue
                skip_key = None
                if pending is not None and key != pending.key:
                    raise errors.InvalidRequest(
                        f"block {pending.key.hex()[:16]} ended after {pending.written} of {pending.size} bytes")
                if pending is None:
                    if chunk.offset != 0:
                        raise errors.InvalidRequest(f"first chunk of block {key.hex()[:16]} starts at "
                                                    f"offset {chunk.offset}, not 0")
                    if chunk.total_size == 0:
                        raise errors.InvalidRequest(f"block {key.hex()[:16]} has total_size 0")
                    if len(chunk.data) > chunk.total_size:
                        raise errors.InvalidRequest(f"block {key.hex()[:16]}: {len(chunk.data)} bytes of data "
                                                    f"for total_size {chunk.total_size}")
                    outcome = m.begin_put(key, chunk.total_size)
                    if outcome.already_present:
                        present += 1
                        skip_left = chunk.total_size - len(chunk.data)
                        skip_key = key if skip_left > 0 else None
                        continue
                    pending = outcome.pending
                elif chunk.total_size != pending.size:
                    raise errors.InvalidRequest(f"block {key.hex()[:16]}: total_size changed from "
                                                f"{pending.size} to {chunk.total_size} mid-block")
                m.write_chunk(pending, chunk.offset, chunk.data)
                if pending.written == pending.size:
                    done, pending = pending, None
                    m.commit_put(done)
                    stored += 1
                    nbytes += done.size
            if pending is not None:
                raise errors.InvalidRequest(f"stream ended inside block {pending.key.hex()[:16]} "
                                            f"({pending.written} of {pending.size} bytes)")
        finally:
            if pending is not None:
                m.abort_put(pending)
        return pb.PutReply(stored=stored, already_present=present, bytes_stored=nbytes)

    # ------------------------------------------------------------------ get

    @_streaming
    def Get(self, request: pb.GetRequest, context) -> Iterator[pb.GetBatch]:
        keys = _check_keys(request.keys)
        ranges = [(r.offset, r.length) for r in request.ranges] or None
        step = self.max_chunk_bytes
        if request.max_chunk_bytes:
            step = min(step, request.max_chunk_bytes)
        batch: list[pb.GetChunk] = []
        batch_bytes = 0
        for key in keys:
            res = self.manager.get(key, ranges)
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
        res = self.manager.lookup(_check_keys(request.keys))
        return pb.LookupReply(hit_blocks=res.hit_blocks, tiers=[int(t) for t in res.tiers])

    @_unary
    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteReply:
        return pb.DeleteReply(deleted=self.manager.delete(_check_keys(request.keys)))

    @_unary
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        tiers = [pb.TierStats(tier=int(u.kind), name=u.name, capacity_bytes=u.capacity_bytes,
                              used_bytes=u.used_bytes, blocks=u.blocks, policy=u.policy)
                 for u in self.manager.usage()]
        counters = {k: int(v) for k, v in self.manager.counters.items() if v >= 0}
        return pb.StatsReply(tiers=tiers, counters=counters)

    @_unary
    def ToolCallStart(self, request: pb.ToolCallStartRequest, context) -> pb.ToolCallStartReply:
        if self.hints is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "prefetch is disabled ([prefetch] enabled = false)")
        if not request.trajectory_id:
            raise errors.InvalidRequest("trajectory_id must not be empty")
        keys = _check_keys(request.keys)
        predicted = self.hints.tool_call_start(request.trajectory_id, request.tool,
                                               request.start_time or None, keys)
        return pb.ToolCallStartReply(predicted_resume_time=predicted)

    @_unary
    def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        if self.hints is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "prefetch is disabled ([prefetch] enabled = false)")
        known, observed = self.hints.resume(request.trajectory_id, request.time or None)
        return pb.ResumeReply(known=known, observed_seconds=observed)

    @_unary
    def Lease(self, request: pb.LeaseRequest, context) -> pb.LeaseReply:
        if self.leases is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no HBM tier is configured ([tiers.hbm] enabled = false)")
        keys = _check_keys(request.keys)
        lease_id, handles, expires_at = self.leases.lease(keys, request.ttl_seconds or None)
        return pb.LeaseReply(lease_id=lease_id, expires_at=expires_at, blocks=[
            pb.BlockHandle(key=h.key, found=h.found, ipc_handle=h.ipc_handle, offset=h.offset,
                           size=h.size, device=h.device) for h in handles])

    @_unary
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        if self.leases is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no HBM tier is configured ([tiers.hbm] enabled = false)")
        return pb.ReleaseReply(released=self.leases.release(request.lease_id))


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``.

    The comparison is constant-time (:func:`hmac.compare_digest`). The standard
    health service stays open so that liveness probes need no secret.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream_in = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream_out = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        got = b""
        for k, v in handler_call_details.invocation_metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else v
        if hmac.compare_digest(got, self._expected):
            return continuation(handler_call_details)
        if method.endswith("/Put") and not method.endswith("/PutInline"):
            return self._deny_stream_in
        if method.endswith("/Get"):
            return self._deny_stream_out
        return self._deny_unary


__all__ = ["KVStoreService", "BearerTokenInterceptor", "status_for", "TierKind"]
