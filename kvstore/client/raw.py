"""The client's gRPC data path: blocks as raw frames on ``GetRaw`` / ``PutRaw``.

:class:`RawPath` is a part of :class:`kvstore.client.KVStoreClient`, built on its
:class:`~kvstore.client.connection.Connection`. It owns :meth:`RawPath.put` and
:meth:`RawPath.get` (the client's ``put`` / ``get``) and the gRPC half of ``get_into``
(:meth:`RawPath.copy_into`): blocks cut into :mod:`kvstore.common.wire` frames of about
``chunk_bytes``, requests split to the message limit, and a size conflict's ``PutReply``
read back from the status trailer. This is the path of TCP clients, multi-tenant daemons
and blocks the shared arena cannot take.

A put's records (payload views, encoded metas) are all built and checked before its call
starts; only the packing into frames runs on gRPC's thread, and an exception raised there
is kept and raised to the caller (:class:`_Requests`), never gRPC's bare
``UNKNOWN: Exception iterating requests!``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.buffers import payload_view
from kvstore.client.connection import Connection
from kvstore.client.streams import StreamEnded
from kvstore.common.transport import FRAMING_BYTES, parts
from kvstore.common.types import BlockMeta, GetResult, PutResult, TierKind
from kvstore.common.wire import FOUND, META, decode, frame_bytes, frames


DEADLINE_GRACE_S = 1.0
"""Seconds past a put's gRPC deadline that the client waits for gRPC to end it, before it
cancels the call itself."""


class RawPath:
    """Blocks in raw frames over gRPC (every target; the only path off the node).

    Args:
        connection: the daemon's connection (raw-frame callables, metadata, limits).
    """

    def __init__(self, connection: Connection):
        self.connection = connection

    def put(self, blocks: Iterable[tuple[bytes, Any]], timeout: float | None = None, *,
            meta: Sequence[BlockMeta | pb.BlockMeta | None] | None = None) -> PutResult:
        """:meth:`kvstore.client.KVStoreClient.put`: store ``(key, payload)`` pairs (keys
        checked; payloads C-contiguous buffers) by ``PutRaw``; ``meta``: one per block
        (counted by the caller, :func:`kvstore.client.checks.check_meta`), or None. Raises
        as that method; InvalidRequest for a non-contiguous payload or a meta too large for
        one message, before anything is sent."""
        c = self.connection
        limit = min(c.max_message_bytes, c.chunk_bytes + FRAMING_BYTES)   # ~1 MiB messages: faster than big ones
        items: list[tuple] = []
        metas = iter(meta) if meta is not None else None
        for i, (k, d) in enumerate(blocks):
            m = next(metas, None) if metas is not None else None
            if m is not None:
                encoded = block_meta_message(m).SerializeToString()
                if frame_bytes(1, len(encoded)) > limit:
                    raise errors.InvalidRequest(f"the meta of block {i} is {len(encoded)} bytes encoded: more than "
                                                f"one {limit}-byte message holds (fewer token ids, or a larger "
                                                f"max_message_bytes)")
                items.append((k, META, 0, len(encoded), encoded))
            data = payload_view(d, f"the payload of block {i}")
            items.append((k, FOUND, 0, len(data), data))
        requests = _Requests(frames(items, limit, c.chunk_bytes))
        deadline = timeout or c.timeout
        # A future, not the blocking call: grpcio's blocking stream-unary call overran its
        # deadline while a message waited on a daemon that stopped reading (SIGSTOP: a 1 MiB
        # put with a 2 s deadline returned when the daemon resumed, 12 s later).
        if c.closed:
            raise c.closed_error()
        call = c.put_raw.future(requests, timeout=deadline, metadata=c.metadata)
        try:
            try:
                reply = call.result(timeout=None if deadline is None else deadline + DEADLINE_GRACE_S)
            except grpc.FutureTimeoutError:
                call.cancel()
                c.unavailable += 1
                raise errors.StoreUnavailable(f"DEADLINE_EXCEEDED: the put did not finish in {deadline:g} s "
                                              f"(the daemon took none of it in time)") from None
        except grpc.RpcError as e:
            if requests.error is not None:      # gRPC ended the call for it: "Exception iterating requests!"
                raise requests.failure()
            error = c.error(e)
            refused = _refused_put_reply(e) if isinstance(error, errors.SizeConflict) else None
            if refused is None:
                raise error from None
            reply = refused
        return _put_result(reply)

    def get(self, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]] | None = None,
            stop_at_miss: bool = False, timeout: float | None = None) -> list[GetResult]:
        """:meth:`kvstore.client.KVStoreClient.get`: blocks as new bytes, by ``GetRaw``.
        Raises as that method."""
        results: list[GetResult] = []
        parts: list = []
        for rec in self.records(keys, ranges, stop_at_miss, timeout):
            if rec.failed or not rec.found:     # a miss, or a block that failed mid-way
                parts = []
                results.append(GetResult(rec.key, False))
                continue
            if rec.offset == 0 and len(rec.data) == rec.total:
                results.append(GetResult(rec.key, True, TierKind(rec.tier), bytes(rec.data)))
                continue
            parts.append(bytes(rec.data))
            if rec.offset + len(rec.data) >= rec.total:
                results.append(GetResult(rec.key, True, TierKind(rec.tier), b"".join(parts)))
                parts = []
        return results

    def records(self, keys, ranges, stop_at_miss, timeout):
        """The records of GetRaw calls for ``keys``, split into requests that fit the
        message limit (with ``stop_at_miss``, no request after one that hit a miss)."""
        byte_ranges = [pb.ByteRange(offset=o, length=n) for o, n in (ranges or ())]
        c = self.connection
        per = c.per_request(extra=sum(r.ByteSize() + 2 for r in byte_ranges) + 16)
        for part in parts(list(keys), per):
            req = pb.GetRequest(keys=part, stop_at_miss=stop_at_miss, max_chunk_bytes=c.chunk_bytes,
                                ranges=byte_ranges)
            missed = False
            deadline = timeout or c.timeout
            try:
                for frame in c.readers.read(c.get_raw(req, timeout=deadline, metadata=c.metadata), deadline):
                    for rec in decode(frame):
                        missed = missed or rec.failed or not rec.found
                        yield rec
            except grpc.RpcError as e:
                raise c.error(e) from None
            except StreamEnded as e:
                c.unavailable += 1
                raise errors.StoreUnavailable(f"DEADLINE_EXCEEDED: {e}") from None
            except ValueError:                  # grpc's "closed channel"
                if c.closed:
                    raise c.closed_error() from None
                raise
            if stop_at_miss and missed:
                return

    def copy_into(self, keys, bufs, ranges, stop_at_miss, sizes, codes, start, timeout) -> None:
        """``get_into``'s gRPC half: copy blocks ``keys[start:]`` (or ``ranges`` of each)
        from raw frames into ``bufs`` (:class:`~kvstore.client.buffers.BlockBuffers`),
        setting ``sizes[i]`` (bytes) and ``codes[i]`` (tier code, 0: not found) per key."""
        i, cur = start, None
        for rec in self.records(keys[start:], ranges, stop_at_miss, timeout):
            if rec.failed or not rec.found:     # a miss, or a block that failed mid-way
                sizes[i], codes[i], cur = 0, 0, None
                i += 1
                continue
            if rec.offset == 0:
                cur = bufs.slot(i, rec.total)
            cur[rec.offset:rec.offset + len(rec.data)] = np.frombuffer(rec.data, dtype=np.uint8)
            if rec.offset + len(rec.data) >= rec.total:
                sizes[i], codes[i], cur = rec.total, rec.tier, None
                i += 1


class _Requests:
    """The messages of a client-streaming call, taken from ``messages`` as gRPC asks for
    them (on its own thread). An exception raised while one is built is kept in
    :attr:`error` before it goes on to gRPC (which only logs it and ends the call with
    ``UNKNOWN: Exception iterating requests!``), for the caller to raise instead."""

    def __init__(self, messages: Iterable):
        self._messages = iter(messages)
        self.error: BaseException | None = None

    def __iter__(self) -> "_Requests":
        return self

    def __next__(self):
        try:
            return next(self._messages)
        except StopIteration:
            raise
        except BaseException as e:
            self.error = e
            raise

    def failure(self) -> errors.KVStoreError:
        """What the caller raises for :attr:`error`: the error itself when it is a store
        error, else an InvalidRequest naming it, with it as ``__cause__`` (a request that
        could not be built from the caller's input or settings)."""
        e = self.error
        if isinstance(e, errors.KVStoreError):
            return e
        err = errors.InvalidRequest(f"the put's request messages could not be built: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err


def block_meta_message(m: BlockMeta | pb.BlockMeta | None) -> pb.BlockMeta:
    """A block's router metadata as sent with PutRaw (a META record) and Reserve (an
    encoded message is returned as it is). Raises AttributeError, TypeError or ValueError
    for an ``m`` that is not a BlockMeta or has a field of the wrong type."""
    if m is None:
        return pb.BlockMeta()
    if isinstance(m, pb.BlockMeta):
        return m
    return pb.BlockMeta(engine_hash=m.engine_hash, parent_engine_hash=m.parent_engine_hash,
                        token_ids=list(m.token_ids), block_tokens=m.block_tokens, lora_name=m.lora_name)


def _refused_put_reply(err: grpc.RpcError) -> pb.PutReply | None:
    """The PutReply a put refused for a size conflict (a status that
    :func:`~kvstore.common.status.error_for` makes a SizeConflict) carries in its trailer
    (``kvstore.service.put_assembly.PUT_REPLY_TRAILER``), or None when it has none."""
    if not isinstance(err, grpc.Call):
        return None
    for name, value in err.trailing_metadata() or ():
        if name == "kvstore-put-reply-bin":
            try:
                return pb.PutReply.FromString(value)
            except Exception:  # noqa: BLE001 - a malformed trailer: report the status instead
                return None
    return None


def _put_result(reply: pb.PutReply) -> PutResult:
    result = PutResult(reply.stored, reply.already_present, reply.bytes_stored, reply.not_admitted,
                       reply.size_conflicts)
    if reply.size_conflicts:
        err = errors.SizeConflict(reply.detail or f"{reply.size_conflicts} blocks are stored with another size")
        err.result = result
        raise err
    return result
