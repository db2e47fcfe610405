"""Synchronous Python client of the kvstore daemon (used by the CLI, tests and adapter).

>>> with KVStoreClient("unix:kvstore-data/kvstore.sock") as c:      # doctest: +SKIP
...     c.put([(key, payload)])
...     c.lookup([key]).hit_blocks
...     c.get([key])[0].data == payload

gRPC status codes are turned into :mod:`kvstore.errors` exceptions:
INVALID_ARGUMENT -> InvalidRequest, RESOURCE_EXHAUSTED -> TierFull,
UNAUTHENTICATED -> Unauthenticated, NOT_FOUND -> BlockNotFound,
UNAVAILABLE / DEADLINE_EXCEEDED -> StoreUnavailable, DATA_LOSS -> CorruptBlock,
anything else -> KVStoreError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import grpc

from tiers.base import TierKind

from . import errors
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pb_grpc
from .manager import GetResult, LookupResult

DEFAULT_CHUNK_BYTES = 1 << 20   # bytes per Put message; 4 MiB messages measured ~3x slower on loopback
DEFAULT_MESSAGE_BYTES = 64 << 20

_CODE_TO_ERROR: dict[grpc.StatusCode, type[errors.KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.TierFull,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.Unauthenticated,
    grpc.StatusCode.NOT_FOUND: errors.BlockNotFound,
    grpc.StatusCode.UNAVAILABLE: errors.StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.StoreUnavailable,
    grpc.StatusCode.DATA_LOSS: errors.CorruptBlock,
}


def translate(err: grpc.RpcError) -> errors.KVStoreError:
    """The :mod:`kvstore.errors` exception for a failed call."""
    code = err.code() if hasattr(err, "code") else None
    cls = _CODE_TO_ERROR.get(code, errors.KVStoreError)
    detail = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    return cls(f"{name}: {detail}")


@dataclass(frozen=True)
class PutResult:
    stored: int
    already_present: int
    bytes_stored: int
    not_admitted: int = 0   # blocks no tier's admission policy wanted (not stored)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class KVStoreClient:
    """Blocking client of one daemon.

    Args:
        target: gRPC target, e.g. ``"unix:/run/kvstore.sock"`` or ``"127.0.0.1:50051"``.
        timeout: per-call deadline in seconds (loads never hang past it).
        auth_token: bearer token sent as ``authorization: Bearer <token>`` metadata.
        chunk_bytes: largest payload piece per Put message (blocks above it are chunked).
        max_message_bytes: gRPC message size limit; must match the daemon's.
        root_certificates: PEM bytes to connect with TLS (TCP targets only).
    """

    def __init__(self, target: str, *, timeout: float = 30.0, auth_token: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
                 root_certificates: bytes | None = None):
        if chunk_bytes <= 0 or chunk_bytes > max_message_bytes - (16 << 10):
            raise ValueError("chunk_bytes must be > 0 and at least 16KiB below max_message_bytes")
        self.target = target
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        opts = channel_options(max_message_bytes)
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the daemon answers. Raises StoreUnavailable after ``timeout`` s."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.StoreUnavailable(f"kvstore daemon at {self.target} not ready after {timeout}s") from None

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise translate(e) from None

    # -------------------------------------------------------------- blocks

    def _batches(self, blocks: Iterable[tuple[bytes, bytes | memoryview]]) -> Iterator[pb.PutBatch]:
        """Pack blocks into messages of at most ``chunk_bytes`` payload bytes.

        Small blocks share a message; a block larger than ``chunk_bytes`` is split
        into chunks at increasing offsets.
        """
        step = self.chunk_bytes
        batch: list[pb.PutChunk] = []
        size = 0
        for key, data in blocks:
            mv = memoryview(data).cast("B")
            total = len(mv)
            if total <= step:
                if size + total > step and batch:
                    yield pb.PutBatch(chunks=batch)
                    batch, size = [], 0
                whole = data if isinstance(data, bytes) else bytes(mv)   # no copy for bytes
                batch.append(pb.PutChunk(key=key, total_size=total, offset=0, data=whole))
                size += total
                continue
            if batch:
                yield pb.PutBatch(chunks=batch)
                batch, size = [], 0
            for off in range(0, total, step):
                yield pb.PutBatch(chunks=[pb.PutChunk(key=key, total_size=total, offset=off,
                                                      data=bytes(mv[off:off + step]))])
        if batch:
            yield pb.PutBatch(chunks=batch)

    def put(self, blocks: Iterable[tuple[bytes, bytes | memoryview]], timeout: float | None = None) -> PutResult:
        """Store blocks given as ``(key, payload)`` pairs.

        Payloads that fit in one message go in one unary call; larger ones are streamed
        in chunks. A block becomes visible only when all its bytes arrived. Re-putting a
        stored block is a no-op counted in ``already_present``.
        Raises InvalidRequest (bad key/size), TierFull, StoreUnavailable.
        """
        batches = self._batches(blocks)
        first = next(batches, None)
        if first is None:
            return PutResult(0, 0, 0)
        second = next(batches, None)
        try:
            if second is None:
                reply = self._stub.PutInline(first, timeout=timeout or self.timeout, metadata=self._metadata)
            else:
                def all_batches():
                    yield first
                    yield second
                    yield from batches
                reply = self._stub.Put(all_batches(), timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise translate(e) from None
        return PutResult(reply.stored, reply.already_present, reply.bytes_stored, reply.not_admitted)

    def get(self, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]] | None = None,
            stop_at_miss: bool = False, timeout: float | None = None) -> list[GetResult]:
        """Fetch blocks (or ``ranges`` of each, concatenated). One result per key, in order
        (fewer with ``stop_at_miss``: the list ends at the first miss, which is included).

        Raises InvalidRequest (bad key length, range outside a block), StoreUnavailable.
        """
        req = pb.GetRequest(keys=list(keys), stop_at_miss=stop_at_miss,
                            ranges=[pb.ByteRange(offset=o, length=n) for o, n in (ranges or ())])
        results: list[GetResult] = []
        parts: list[bytes] = []
        try:
            stream = self._stub.Get(req, timeout=timeout or self.timeout, metadata=self._metadata)
            for batch in stream:
                for chunk in batch.chunks:
                    if not chunk.found:
                        results.append(GetResult(chunk.key, False))
                        continue
                    if chunk.offset == 0 and len(chunk.data) == chunk.total_size:
                        results.append(GetResult(chunk.key, True, TierKind(chunk.tier), chunk.data))
                        continue
                    if chunk.offset == 0:
                        parts = []
                    parts.append(chunk.data)
                    if chunk.offset + len(chunk.data) >= chunk.total_size:
                        results.append(GetResult(chunk.key, True, TierKind(chunk.tier), b"".join(parts)))
                        parts = []
        except grpc.RpcError as e:
            raise translate(e) from None
        return results

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        """Longest stored prefix of ``keys`` and the tier of each hit block."""
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys)), timeout)
        return LookupResult(reply.hit_blocks, tuple(TierKind(t) for t in reply.tiers))

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Delete blocks from every tier; returns how many were stored."""
        return self._call(self._stub.Delete, pb.DeleteRequest(keys=list(keys)), timeout).deleted

    def stats(self, timeout: float | None = None) -> dict:
        """Tier usage and counters: ``{"tiers": [...], "counters": {...}}``."""
        reply = self._call(self._stub.Stats, pb.StatsRequest(), timeout)
        return {
            "tiers": [
                {"tier": TierKind(t.tier).name.lower(), "name": t.name, "capacity_bytes": t.capacity_bytes,
                 "used_bytes": t.used_bytes, "blocks": t.blocks, "policy": t.policy}
                for t in reply.tiers
            ],
            "counters": dict(reply.counters),
        }

    # -------------------------------------------------------------- agent hints

    def tool_call_start(self, trajectory_id: str, tool: str, keys: Sequence[bytes],
                        start_time: float | None = None, timeout: float | None = None) -> float:
        """Tell the daemon trajectory ``trajectory_id`` started tool ``tool``; its prefix is ``keys``.

        Returns the predicted resume time (seconds, unix time).
        """
        req = pb.ToolCallStartRequest(trajectory_id=trajectory_id, tool=tool, keys=list(keys),
                                      start_time=start_time if start_time is not None else time.time())
        return self._call(self._stub.ToolCallStart, req, timeout).predicted_resume_time

    def resume(self, trajectory_id: str, at: float | None = None,
               timeout: float | None = None) -> tuple[bool, float]:
        """Tell the daemon the trajectory resumed. Returns ``(known, observed_seconds)``."""
        req = pb.ResumeRequest(trajectory_id=trajectory_id, time=at if at is not None else time.time())
        reply = self._call(self._stub.Resume, req, timeout)
        return reply.known, reply.observed_seconds
