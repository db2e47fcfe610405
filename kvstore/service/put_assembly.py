"""Put assembly: a stream of chunks (from protobuf batches or raw frames) into blocks.

A client sends blocks in order, each as one or more chunks at increasing offsets (a
small block is one chunk). :class:`PutAssembler` turns them into the manager's
two-phase put: ``begin_put`` at a block's first chunk, ``write_chunk`` per chunk,
``commit_put`` after its last byte; a stream that ends, breaks or fails mid-block
aborts that block (it never becomes visible). Blocks already stored with the same size
are skipped (``already_present``); blocks stored with another size are refused and
counted (``size_conflicts``, first writer wins); blocks no tier admits are counted in
``not_admitted``. Error messages name blocks by the client's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kvstore._proto import kvstore_pb2 as pb
from kvstore.common.errors import InvalidRequest, SizeConflict
from kvstore.store.manager import TierManager
from kvstore.common.types import KEY_BYTES, PutResult
from kvstore.service.validate import MAX_BLOCK_BYTES


@dataclass
class _Open:
    pending: Any
    name: str
    size: int


class PutAssembler:
    """Feeds chunks to ``manager``; use as a context manager so an open block is aborted.

    Args:
        manager: the store.
        internal: maps a client key to the store's key (the caller's tenant key space).
        wait_s: returns how long a block may wait for another writer of its key now
            (seconds, None: the store's ``writer_wait_s``): what the call's deadline leaves.
    """

    def __init__(self, manager: TierManager, internal: Callable[[bytes], bytes],
                 wait_s: Callable[[], float | None] = lambda: None):
        self.m = manager
        self.internal = internal
        self.wait_s = wait_s
        self.stored = self.present = self.refused = self.conflicts = self.nbytes = 0
        self.detail = ""
        self._batch = manager.put_batch()      # one put call: the cluster's write-through at its end
        self.committed = self._batch.keys      # store keys committed by this stream
        self._open: _Open | None = None
        self._skip_key: bytes | None = None
        self._skip_left = 0
        self._meta: tuple[bytes, object] | None = None   # (client key, BlockMeta) for the next block
        self._laid: tuple[bytes, int, int] | None = None  # (client key, end, total): the block
        # the messages checked so far (:meth:`check_message`) leave unfinished

    def __enter__(self) -> "PutAssembler":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._open is not None:
            self.m.abort_put(self._open.pending)
            self._open = None

    def check_message(self, pieces: Iterable[tuple[bytes, int, int, int]], *, whole: bool = False) -> None:
        """Check one message's layout before any of its chunks reserves room:
        ``pieces`` are its chunks' ``(client key, total_size, offset, length)`` in order.
        Each block's chunks must follow one another from offset 0 up to its total size, and
        only the last block of a message may go on in the next one (``whole``: none may,
        the message is the whole put). A block the message cannot finish would otherwise
        reserve room, evicting other blocks, for bytes that never come.

        Raises InvalidRequest naming the first block out of place; nothing of the message
        is stored then. What is left unfinished is remembered for the next message."""
        laid = self._laid
        for key, total, offset, n in pieces:
            if laid is not None and key == laid[0] and offset == laid[1] and total == laid[2]:
                end = offset + n                       # the block goes on
            else:
                if laid is not None:
                    raise InvalidRequest(f"block {laid[0].hex()[:16]} ends after {laid[1]} of its "
                                         f"{laid[2]} bytes")
                if offset != 0:
                    raise InvalidRequest(f"first chunk of block {key.hex()[:16]} starts at offset "
                                         f"{offset}, not 0")
                end = n
            if end > total:
                raise InvalidRequest(f"block {key.hex()[:16]}: {end} bytes of data for total_size {total}")
            laid = (key, end, total) if end < total else None
        if whole and laid is not None:
            raise InvalidRequest(f"the put ends inside block {laid[0].hex()[:16]} ({laid[1]} of {laid[2]} bytes)")
        self._laid = laid

    def meta(self, client_key: bytes, meta) -> None:
        """The next block's :class:`kvstore.common.types.BlockMeta` (for its KV events)."""
        self._meta = (client_key, meta)

    def chunk(self, client_key: bytes, total: int, offset: int, data: Any) -> None:
        """One chunk of the stream (``data`` any buffer). Raises InvalidRequest for a
        malformed stream, and what the manager raises (TierFull, TierIOError, ...)."""
        if len(client_key) != KEY_BYTES:
            raise InvalidRequest(f"key has {len(client_key)} bytes; block keys are {KEY_BYTES} bytes")
        n = memoryview(data).nbytes
        key = self.internal(client_key)
        if self._skip_key is not None and key == self._skip_key and offset > 0:
            self._skip_left -= n            # further chunks of a block that needs no write
            if self._skip_left <= 0:
                self._skip_key = None
            return
        self._skip_key = None
        op = self._open
        if op is not None and key != op.pending.key:
            raise InvalidRequest(f"block {op.name} ended after {op.pending.written} of {op.size} bytes")
        if op is None:
            name = client_key.hex()[:16]
            if offset != 0:
                raise InvalidRequest(f"first chunk of block {name} starts at offset {offset}, not 0")
            if not 0 < total <= MAX_BLOCK_BYTES:
                raise InvalidRequest(f"block {name} has total_size {total} (must be in (0, {MAX_BLOCK_BYTES}])")
            if n > total:
                raise InvalidRequest(f"block {name}: {n} bytes of data for total_size {total}")
            meta = self._meta[1] if self._meta is not None and self._meta[0] == client_key else None
            self._meta = None
            try:
                outcome = self.m.begin_put(key, total, meta=meta, wait_s=self.wait_s())
            except SizeConflict as e:
                self.conflicts += 1
                self.detail = self.detail or f"block {name}: {e}"
                self._skip(key, total - n)
                return
            if outcome.already_present or outcome.not_admitted:
                self.present += outcome.already_present
                self.refused += outcome.not_admitted
                self._skip(key, total - n)
                return
            op = self._open = _Open(outcome.pending, name, total)
        elif total != op.size:
            raise InvalidRequest(f"block {op.name}: total_size changed from {op.size} to {total} mid-block")
        if offset != op.pending.written:
            raise InvalidRequest(f"block {op.name}: chunk at offset {offset} but {op.pending.written} "
                                 "bytes written so far")
        self.m.write_chunk(op.pending, offset, data)
        if op.pending.written == op.size:
            self._open = None
            self._batch.commit(op.pending)
            self.stored += 1
            self.nbytes += op.size

    def _skip(self, key: bytes, left: int) -> None:
        self._skip_key = key if left > 0 else None
        self._skip_left = left

    def finish(self) -> PutResult:
        """End of stream: the counts. Raises InvalidRequest when a block is unfinished
        (it is aborted)."""
        op = self._open
        if op is not None:
            self.m.abort_put(op.pending)
            self._open = None
            raise InvalidRequest(f"stream ended inside block {op.name} ({op.pending.written} of {op.size} bytes)")
        self._batch.end()
        return PutResult(self.stored, self.present, self.nbytes, self.refused, self.conflicts)


def put_reply(r: PutResult, detail: str = "") -> pb.PutReply:
    """A put's outcome as its gRPC reply."""
    return pb.PutReply(stored=r.stored, already_present=r.already_present, bytes_stored=r.bytes_stored,
                       not_admitted=r.not_admitted, size_conflicts=r.size_conflicts, detail=detail)


def writer_wait_left(context) -> float | None:
    """How long a put of this call may still wait for another writer of a block (seconds;
    None: the call has no deadline): until shortly before the call's deadline, so that it
    ends with WriteConflict, not DEADLINE_EXCEEDED (a quarter of what is left, at least
    1 s, is kept for the answer to travel, also on a loaded machine)."""
    left = context.time_remaining()
    return None if left is None else max(0.0, left - max(1.0, 0.25 * left))


PUT_REPLY_TRAILER = "kvstore-put-reply-bin"
"""Trailing metadata of a Put refused for a size conflict: the serialized PutReply (what
the other blocks of the call did), so a client can tell which blocks were stored."""


def finish_put(asm: PutAssembler, context) -> pb.PutReply:
    """The reply of a finished put stream. A block refused for a size conflict fails the
    call with ALREADY_EXISTS (:class:`~kvstore.common.SizeConflict`, first writer wins);
    the other blocks of the call are stored and the reply travels in the trailer."""
    reply = put_reply(asm.finish(), asm.detail)
    if reply.size_conflicts:
        context.set_trailing_metadata(((PUT_REPLY_TRAILER, reply.SerializeToString()),))
        raise SizeConflict(f"{reply.detail} ({reply.size_conflicts} blocks refused; {reply.stored} "
                                  f"stored, {reply.already_present} already present)")
    return reply
