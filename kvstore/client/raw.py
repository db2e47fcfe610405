"""The client's gRPC data path: blocks as raw frames on ``GetRaw`` / ``PutRaw``.

:class:`RawPathMixin` is mixed into :class:`kvstore.client.KVStoreClient`. It owns
:meth:`put` and :meth:`get` (and the gRPC half of ``get_into``): blocks cut into
:mod:`kvstore.common.wire` frames of about ``chunk_bytes``, requests split to the message
limit, and a size conflict's ``PutReply`` read back from the status trailer. It uses
the client's ``_put_raw`` / ``_get_raw`` callables, ``_metadata``, ``_per_request``,
``chunk_bytes``, ``max_message_bytes`` and ``timeout``. This is the path of TCP
clients, multi-tenant daemons and blocks the shared arena cannot take.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.common.status import error_for
from kvstore.common.transport import FRAMING_BYTES, parts
from kvstore.common.types import BlockMeta, GetResult, PutResult, TierKind
from kvstore.common.wire import FOUND, META, decode, frames


class RawPathMixin:
    """Blocks in raw frames over gRPC (every target; the only path off the node)."""

    def put(self, blocks: Iterable[tuple[bytes, Any]], timeout: float | None = None, *,
            meta: Sequence[BlockMeta | None] | None = None) -> PutResult:
        """Store blocks given as ``(key, payload)`` pairs (payload: any buffer).

        A block becomes visible only when all its bytes arrived. Re-putting a stored block
        is a no-op counted in ``already_present``. ``meta``: per block, what cache-aware
        routers index it by (published with its KV events), or None.
        Raises InvalidRequest (bad key/size), SizeConflict (a key stored with another
        size; the others are stored: ``.result``), TierFull, MessageTooLarge,
        StoreUnavailable.
        """
        def items():
            metas = iter(meta) if meta is not None else None
            for k, d in blocks:
                m = next(metas, None) if metas is not None else None
                if m is not None:
                    encoded = _meta_message(m).SerializeToString()
                    yield k, META, 0, len(encoded), encoded
                yield k, FOUND, 0, len(memoryview(d).cast("B")), d
        items = items()
        limit = min(self.max_message_bytes, self.chunk_bytes + FRAMING_BYTES)   # ~1 MiB messages: faster than big ones
        try:
            reply = self._put_raw(frames(items, limit, self.chunk_bytes), timeout=timeout or self.timeout,
                                  metadata=self._metadata)
        except grpc.RpcError as e:
            refused = _refused_put_reply(e)
            if refused is None:
                raise error_for(e) from None
            reply = refused
        return _put_result(reply)

    def get(self, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]] | None = None,
            stop_at_miss: bool = False, timeout: float | None = None) -> list[GetResult]:
        """Fetch blocks (or ``ranges`` of each, concatenated) as new bytes. One result per
        key, in order (with ``stop_at_miss`` the list ends at the first miss, included).

        Raises InvalidRequest (bad key length, range outside a block), StoreUnavailable.
        """
        results: list[GetResult] = []
        parts: list = []
        for rec in self._raw_records(keys, ranges, stop_at_miss, timeout):
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

    def _raw_records(self, keys, ranges, stop_at_miss, timeout):
        """The records of GetRaw calls for ``keys``, split into requests that fit the
        message limit (with ``stop_at_miss``, no request after one that hit a miss)."""
        byte_ranges = [pb.ByteRange(offset=o, length=n) for o, n in (ranges or ())]
        per = self._per_request(extra=sum(r.ByteSize() + 2 for r in byte_ranges) + 16)
        for part in parts(list(keys), per):
            req = pb.GetRequest(keys=part, stop_at_miss=stop_at_miss, max_chunk_bytes=self.chunk_bytes,
                                ranges=byte_ranges)
            missed = False
            try:
                for frame in self._get_raw(req, timeout=timeout or self.timeout, metadata=self._metadata):
                    for rec in decode(frame):
                        missed = missed or rec.failed or not rec.found
                        yield rec
            except grpc.RpcError as e:
                raise error_for(e) from None
            if stop_at_miss and missed:
                return

    def _raw_copy(self, keys, bufs, ranges, stop_at_miss, sizes, codes, start, timeout) -> None:
        """Copy blocks ``keys[start:]`` from raw gRPC frames."""
        i, cur = start, None
        for rec in self._raw_records(keys[start:], ranges, stop_at_miss, timeout):
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


def _meta_message(m: BlockMeta | None) -> pb.BlockMeta:
    """A block's router metadata as sent with PutRaw (a META record) and Reserve."""
    if m is None:
        return pb.BlockMeta()
    return pb.BlockMeta(engine_hash=m.engine_hash, parent_engine_hash=m.parent_engine_hash,
                        token_ids=list(m.token_ids), block_tokens=m.block_tokens, lora_name=m.lora_name)


def _refused_put_reply(err: grpc.RpcError) -> pb.PutReply | None:
    """The PutReply a put refused for a size conflict carries in its trailer (ALREADY_EXISTS,
    see ``kvstore.service.server.PUT_REPLY_TRAILER``), or None for any other failure."""
    if not isinstance(err, grpc.Call) or err.code() is not grpc.StatusCode.ALREADY_EXISTS:
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
