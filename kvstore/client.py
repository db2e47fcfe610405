"""Synchronous Python client of the kvstore daemon (used by engines, the CLI and tests).

>>> with KVStoreClient("unix:kvstore-data/kvstore.sock") as c:      # doctest: +SKIP
...     c.put_from(keys, payloads)                    # one buffer per block, or one buffer
...     hit = c.lookup(keys).hit_blocks
...     c.get_into(keys[:hit], out)                   # straight into numpy / torch memory

Data path: on the daemon's own unix socket the client maps the daemon's shared host
arena once (:mod:`kvstore.shm`) and copies blocks straight between it and the caller's
buffers; gRPC carries only Lease/Release and Reserve/Commit. Elsewhere (TCP, a
multi-tenant daemon, ``shared_memory=False``) blocks travel as raw frames
(:mod:`kvstore.wire`) on gRPC. Both paths give the same results.

Errors: gRPC status codes become :mod:`kvstore.errors` exceptions (:mod:`kvstore.status`);
a message over the size limit is :class:`~kvstore.errors.MessageTooLarge`, never a full
store. This module imports only types, errors, the wire format and the generated stubs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from . import errors
from ._proto import kvstore_pb2 as pb
from ._proto import kvstore_pb2_grpc as pb_grpc
from .buffers import BlockBuffers, host_view
from .status import error_for
from .transport import (DEFAULT_CHUNK_BYTES, DEFAULT_MESSAGE_BYTES, FRAMING_BYTES, channel_options,
                        default_chunk_bytes, keys_per_request, parts)
from .types import BlockMeta, GetResult, LookupResult, PutResult, ReserveStatus, TierKind
from .wire import FOUND, META, decode, frames

log = logging.getLogger("kvstore.client")

_DATA = "/kvstore.v1.KVStoreData/"


@dataclass(frozen=True)
class NodeInfo:
    """What the daemon says about itself (``Info``)."""

    version: str
    block_tokens: int
    key_hash: str
    max_message_bytes: int
    shm_socket: str
    shm_arena_bytes: int
    shm_refused: str


@dataclass(frozen=True)
class GetIntoResult:
    """Outcome of :meth:`KVStoreClient.get_into`.

    Attributes:
        found: leading blocks copied (with ``stop_at_miss``, the hit prefix).
        sizes: bytes copied per key asked for (0: not found).
        tier_codes: tier each block was read from, one byte per key (0: not found).
    """

    found: int
    sizes: list[int]
    tier_codes: bytes


class KVStoreClient:
    """Blocking client of one daemon.

    Args:
        target: gRPC target, e.g. ``"unix:/run/kvstore.sock"`` or ``"127.0.0.1:50051"``.
        timeout: per-call deadline in seconds (loads never hang past it).
        auth_token: bearer token sent as ``authorization: Bearer <token>`` metadata.
        chunk_bytes: largest payload piece per message (blocks above it are chunked);
            default 1 MiB, or ``max_message_bytes`` less 16 KiB of framing when smaller.
        max_message_bytes: gRPC message size limit (bytes); must not exceed the daemon's
            ``[server] max_message_bytes``. Requests listing more keys than fit are
            split (:func:`kvstore.transport.keys_per_request`); a message the daemon
            still refuses raises :class:`~kvstore.errors.MessageTooLarge`.
        root_certificates: PEM bytes to connect with TLS (TCP targets only).
        shared_memory: use the daemon's shared arena when it offers one (None: yes when
            possible, False: never, True: fail if it cannot).
        lease_ttl_s: TTL of the leases and reservations of the shared-memory path.
    """

    def __init__(self, target: str, *, timeout: float = 30.0, auth_token: str = "",
                 chunk_bytes: int | None = None, max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
                 root_certificates: bytes | None = None, shared_memory: bool | None = None,
                 lease_ttl_s: float = 30.0):
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(max_message_bytes)
        if chunk_bytes <= 0 or chunk_bytes > max_message_bytes - FRAMING_BYTES:
            raise ValueError(f"chunk_bytes must be > 0 and at least {FRAMING_BYTES} bytes below max_message_bytes")
        self.target = target
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.lease_ttl_s = lease_ttl_s
        self._token = auth_token
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        opts = channel_options(max_message_bytes)
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._get_raw = self._channel.unary_stream(_DATA + "GetRaw", request_serializer=pb.GetRequest.SerializeToString)
        self._put_raw = self._channel.stream_unary(_DATA + "PutRaw", response_deserializer=pb.PutReply.FromString)
        self._want_shm = shared_memory
        self._arena = None
        self._arena_checked = False
        self._info: NodeInfo | None = None
        self._releaser = _Releaser(self)

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self._releaser.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
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
            raise error_for(e) from None

    def _arena_call(self, method, request, timeout: float | None, arena):
        """A Lease, Reserve or Commit naming the arena ``arena`` the client maps. Raises
        :class:`ArenaChanged` (and forgets the mapping) when the daemon serves another
        arena: it restarted since, and the old mapping must not be read or written."""
        from .shm import ARENA_CHANGED, ARENA_HEADER
        try:
            return method(request, timeout=timeout or self.timeout,
                          metadata=self._metadata + ((ARENA_HEADER, arena.identity),))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and ARENA_CHANGED in (e.details() or ""):
                if self._arena is arena:
                    self._arena, self._arena_checked, self._info = None, False, None
                log.info("the daemon at %s serves a new shared arena (it restarted); mapping it again", self.target)
                raise ArenaChanged(e.details()) from None
            raise error_for(e) from None

    # -------------------------------------------------------------- node

    def info(self, timeout: float | None = None) -> NodeInfo:
        """The node's block size, key hash and data-path offer (cached)."""
        if self._info is None:
            r = self._call(self._stub.Info, pb.InfoRequest(), timeout)
            self._info = NodeInfo(r.version, r.block_tokens, r.key_hash, r.max_message_bytes, r.shm_socket,
                                  r.shm_arena_bytes, r.shm_refused)
        return self._info

    def check_block_tokens(self, block_tokens: int) -> None:
        """Raise InvalidRequest when the node's ``[blocks] block_tokens`` is set and is not
        ``block_tokens`` (keys computed with another block size never hit the blocks of
        the node's other clients). Raises StoreUnavailable when the node does not answer."""
        node = self.info().block_tokens
        if node and node != block_tokens:
            raise errors.InvalidRequest(f"this client cuts prompts into {block_tokens}-token blocks but the node "
                                        f"at {self.target} is configured for {node} ([blocks] block_tokens)")

    @property
    def shared_memory(self) -> bool:
        """Whether blocks move through the daemon's shared arena (mapped on first use)."""
        return self._shm() is not None

    def _shm(self):
        if self._arena_checked:
            return self._arena
        self._arena_checked = True
        if self._want_shm is False or not self.target.startswith("unix:"):
            if self._want_shm:
                raise errors.FeatureDisabled("shared memory needs the daemon's unix socket")
            return None
        info = self.info()
        if not info.shm_socket:
            if self._want_shm:
                raise errors.FeatureDisabled(f"the daemon offers no shared arena: {info.shm_refused}")
            return None
        from .shm import ArenaMapping
        try:
            self._arena = ArenaMapping(info.shm_socket, self._token, timeout=self.timeout)
        except OSError as e:
            if self._want_shm:
                raise errors.FeatureDisabled(f"cannot map the shared arena: {e}") from None
            log.info("shared arena unavailable (%s); using gRPC for block data", e)
        return self._arena

    # -------------------------------------------------------------- lookup, delete, stats

    def _per_request(self, per_key: int = 34, extra: int = 0) -> int:
        return keys_per_request(self.max_message_bytes, per_key, extra)

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        """Longest stored prefix of ``keys`` and the tier of each hit block."""
        hit, codes = 0, b""
        for part in parts(list(keys), self._per_request()) or [[]]:
            reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=part), timeout)
            hit += reply.hit_blocks
            codes += reply.tier_codes
            if reply.hit_blocks < len(part):
                break
        return LookupResult(hit, codes)

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Delete blocks from every tier; returns how many were stored."""
        return sum(self._call(self._stub.Delete, pb.DeleteRequest(keys=part), timeout).deleted
                   for part in parts(list(keys), self._per_request()))

    def stats(self, timeout: float | None = None) -> dict:
        """Tier usage, counters and health: ``{"tiers", "counters", "serving", "problems"}``."""
        reply = self._call(self._stub.Stats, pb.StatsRequest(), timeout)
        return {
            "tiers": [
                {"tier": TierKind(t.tier).name.lower(), "name": t.name, "capacity_bytes": t.capacity_bytes,
                 "used_bytes": t.used_bytes, "payload_bytes": t.payload_bytes, "blocks": t.blocks,
                 "policy": t.policy}
                for t in reply.tiers
            ],
            "counters": dict(reply.counters),
            "serving": reply.serving,
            "problems": list(reply.problems),
        }

    # -------------------------------------------------------------- put

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

    def put_from(self, keys: Sequence[bytes], src: Any, *, sizes: Sequence[int] | int | None = None,
                 offsets: Sequence[int] | None = None, meta: Sequence[BlockMeta | None] | None = None,
                 timeout: float | None = None) -> PutResult:
        """Store ``keys`` from ``src``: one buffer per key (numpy arrays, torch tensors on
        CPU or CUDA, any buffer), or one buffer holding every block: in ``len(keys)``
        equal parts (e.g. shaped ``(len(keys), block_bytes)``), or ``sizes`` bytes each,
        back to back or at ``offsets``.

        Same node: Reserve, one copy into the shared arena, Commit; blocks the arena
        cannot take now go by gRPC. ``meta`` as in :meth:`put`. Raises as :meth:`put`.
        """
        keys = list(keys)
        if not keys:
            return PutResult(0, 0, 0)
        if meta is not None and len(meta) != len(keys):
            raise errors.InvalidRequest(f"{len(meta)} block metas for {len(keys)} keys")
        bufs = BlockBuffers(src, len(keys), writable=False, offsets=offsets, sizes=sizes)
        lengths = bufs.block_sizes()
        arena = self._shm()
        if arena is None:
            return self.put([(k, bufs.slot(i, n)) for i, (k, n) in enumerate(zip(keys, lengths))], timeout,
                            meta=meta)
        budget = max(arena.size // 4, 1)
        reserved_total = stored = nbytes = present = refused = conflicts = 0
        rest: list[int] = []
        detail = ""
        batch: list[int] = []
        per = self._per_request(per_key=34 + 11)            # a key and its size
        for i in range(len(keys) + 1):
            if i < len(keys) and (not batch or reserved_total + lengths[i] <= budget and len(batch) < per):
                batch.append(i)
                reserved_total += lengths[i]
                continue
            metas = [_meta_message(meta[j]) for j in batch] if meta is not None else []
            before = (present, refused, conflicts, len(rest))
            try:
                reply = self._arena_call(self._stub.Reserve, pb.ReserveRequest(
                    keys=[keys[j] for j in batch], sizes=[lengths[j] for j in batch], ttl_seconds=self.lease_ttl_s,
                    meta=metas), timeout, arena)
                written = []
                for j, status, offset in zip(batch, reply.status, reply.offsets):
                    if status == ReserveStatus.RESERVED:
                        arena.array[offset:offset + lengths[j]] = bufs.slot(j, lengths[j])
                        written.append(keys[j])
                    elif status == ReserveStatus.ALREADY_PRESENT:
                        present += 1
                    elif status == ReserveStatus.NOT_ADMITTED:
                        refused += 1
                    elif status == ReserveStatus.SIZE_CONFLICT:
                        conflicts += 1
                    else:                       # NO_ROOM, BUSY: the gRPC put decides (and waits)
                        rest.append(j)
                if written:
                    done = self._arena_call(self._stub.Commit, pb.CommitRequest(keys=written), timeout, arena)
                    stored += done.committed
                    nbytes += done.bytes_committed
            except ArenaChanged:                # the daemon restarted: this batch and the rest by gRPC
                present, refused, conflicts, n_rest = before
                del rest[n_rest:]
                rest.extend(range(batch[0], len(keys)))
                break
            detail = detail or reply.detail
            if i == len(keys):
                break
            batch, reserved_total = [i], lengths[i]
        result = PutResult(stored, present, nbytes, refused, conflicts)
        if rest:
            more = self.put([(keys[i], bufs.slot(i, lengths[i])) for i in rest], timeout,
                            meta=[meta[i] for i in rest] if meta is not None else None)
            result = PutResult(stored + more.stored, present + more.already_present, nbytes + more.bytes_stored,
                               refused + more.not_admitted, conflicts + more.size_conflicts)
        if result.size_conflicts:
            err = errors.SizeConflict(detail or f"{result.size_conflicts} blocks are stored with another size")
            err.result = result
            raise err
        return result

    # -------------------------------------------------------------- get

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

    def get_into(self, keys: Sequence[bytes], out: Any, *, ranges: Sequence[tuple[int, int]] | None = None,
                 offsets: Sequence[int] | None = None, stop_at_miss: bool = True,
                 timeout: float | None = None) -> GetIntoResult:
        """Copy blocks (or ``ranges`` of each, concatenated) straight into ``out``: one
        buffer per key, or one buffer of ``len(keys)`` equal slots (e.g. shaped
        ``(len(keys), block_bytes)``), or one buffer with the blocks at ``offsets``.
        Buffers: numpy arrays, torch tensors (CPU, pinned or CUDA), any writable buffer.

        With ``stop_at_miss`` (the default: a prefix) copying stops at the first miss. A
        block too short for ``ranges`` counts as a miss (its layout is not the caller's).
        Same node: one Lease, one copy per block from the shared arena, then the lease is
        released in the background. Raises InvalidRequest (a buffer too small, bad
        ranges), StoreUnavailable.
        """
        keys = list(keys)
        bufs = BlockBuffers(out, len(keys), writable=True, offsets=offsets)
        arena = self._shm()
        sizes = [0] * len(keys)
        codes = bytearray(len(keys))
        start = 0
        for _ in range(2):
            if arena is None:
                break
            try:
                start = self._lease_copy(arena, keys, bufs, ranges, stop_at_miss, sizes, codes, timeout)
                break
            except ArenaChanged:                # the daemon restarted: its new arena, or gRPC
                sizes[:] = [0] * len(keys)
                codes[:] = bytes(len(keys))
                start = 0
                arena = self._shm()
        if start < len(keys) and not (stop_at_miss and start and not codes[start - 1]):
            self._raw_copy(keys, bufs, ranges, stop_at_miss, sizes, codes, start, timeout)
        found = 0
        while found < len(keys) and codes[found]:
            found += 1
        bufs.finish()
        return GetIntoResult(found if stop_at_miss else sum(1 for c in codes if c), sizes, bytes(codes))

    def _lease_copy(self, arena, keys, bufs, ranges, stop_at_miss, sizes, codes, timeout) -> int:
        """Copy blocks out of the shared arena, one lease at a time (a lease stops early
        when the arena cannot hold more at once). Returns the index of the first key not
        looked at (``len(keys)`` when done; the rest then goes by gRPC)."""
        src = arena.array
        start, release = 0, []
        per = self._per_request(extra=128)
        try:
            while start < len(keys):
                part = keys[start:start + per]
                reply = self._arena_call(self._stub.Lease, pb.LeaseRequest(
                    keys=part, ttl_seconds=self.lease_ttl_s, prefix=stop_at_miss,
                    release=release + self._releaser.take()), timeout, arena)
                release = [reply.lease_id] if reply.lease_id else []
                for j, (off, size, code) in enumerate(zip(reply.offsets, reply.sizes, reply.tier_codes)):
                    if not code:
                        continue
                    i = start + j
                    if ranges:
                        if any(r_off + n > size for r_off, n in ranges):
                            continue                # a block too short for the ranges: a miss
                        total = sum(n for _, n in ranges)
                        dst = bufs.slot(i, total)
                        pos = 0
                        for r_off, n in ranges:
                            dst[pos:pos + n] = src[off + r_off:off + r_off + n]
                            pos += n
                        sizes[i] = total
                    else:
                        bufs.slot(i, size)[:] = src[off:off + size]
                        sizes[i] = size
                    codes[i] = code
                if reply.complete:
                    if start + len(part) >= len(keys) or stop_at_miss and 0 in reply.tier_codes:
                        return len(keys)
                    start += len(part)
                    continue
                if reply.resume_at == 0:
                    return start            # no progress: the arena is busy; use gRPC for the rest
                start += reply.resume_at
            return start
        finally:
            for lease_id in release:
                self._release(lease_id)

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

    def _release(self, lease_id: str) -> None:
        """End a lease without waiting: it rides on the next Lease call, or a background
        thread sends it (its TTL ends it anyway)."""
        self._releaser.add(lease_id)

    # -------------------------------------------------------------- leases (low level)

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, *, prefix: bool = True,
              device: bool = False, max_bytes: int = 0, timeout: float | None = None) -> pb.LeaseReply:
        """Pin blocks for reading in place (the shared arena, or HBM with ``device``).
        Returns the raw reply (offsets, sizes, tier codes, IPC blocks, ``resume_at``: the
        grant stopped early past ``max_bytes``, default a quarter of the arena); call
        :meth:`release` with its ``lease_id`` when done. Raises :class:`ArenaChanged` (a
        FeatureDisabled) when the daemon restarted since :meth:`arena` was mapped: take
        the new mapping from :meth:`arena` and lease again."""
        request = pb.LeaseRequest(keys=list(keys), ttl_seconds=ttl_s or self.lease_ttl_s, prefix=prefix,
                                  device=device, max_bytes=max_bytes)
        if self._arena is not None:
            return self._arena_call(self._stub.Lease, request, timeout, self._arena)
        return self._call(self._stub.Lease, request, timeout)

    def release(self, lease_ids: Sequence[str], timeout: float | None = None) -> int:
        """End leases; returns how many were live."""
        return self._call(self._stub.Release, pb.ReleaseRequest(lease_ids=list(lease_ids)), timeout).released

    def arena(self):
        """The mapped shared arena (:class:`kvstore.shm.ArenaMapping`), or None."""
        return self._shm()

    # -------------------------------------------------------------- agent hints

    def tool_call_start(self, trajectory_id: str, tool: str, keys: Sequence[bytes],
                        start_time: float | None = None, timeout: float | None = None) -> float:
        """Tell the daemon trajectory ``trajectory_id`` started tool ``tool``; its prefix is ``keys``.

        ``start_time`` is unix seconds (default: now). Returns the predicted resume time
        (unix seconds).
        """
        req = pb.ToolCallStartRequest(trajectory_id=trajectory_id, tool=tool, keys=list(keys),
                                      start_time=start_time if start_time is not None else time.time())
        return self._call(self._stub.ToolCallStart, req, timeout).predicted_resume_time

    def session_hint(self, session_id: str, state: str = "continues", keys: Sequence[bytes] = (), *,
                     expected_back_s: float | None = None, ttl_s: float | None = None, at: float | None = None,
                     kv_hints: dict | None = None, timeout: float | None = None) -> float:
        """Tell the daemon what the agent framework knows about a session (trajectory).

        Args:
            session_id: the session; state: ``"continues"``, ``"finished"`` or ``"abandoned"``.
            keys: its prefix blocks in order (empty: as last given).
            expected_back_s: seconds until it returns (continues; None: learned by the daemon).
            ttl_s: keep its blocks near at most this long (seconds; None: no limit).
            at: unix seconds the hint applies (default now).
            kv_hints: instead of the above, a vLLM ``kv_hints`` envelope (a JSON object).
        Returns the expected-back time (unix seconds; ``inf`` once finished or abandoned).
        Raises InvalidRequest, FeatureDisabled.
        """
        states = {"continues": pb.SessionHintRequest.CONTINUES, "finished": pb.SessionHintRequest.FINISHED,
                  "abandoned": pb.SessionHintRequest.ABANDONED}
        if state not in states:
            raise errors.InvalidRequest(f"state must be one of {sorted(states)}, got {state!r}")
        import json
        req = pb.SessionHintRequest(session_id=session_id, state=states[state], keys=list(keys),
                                    expected_back_s=expected_back_s or 0.0, ttl_s=ttl_s or 0.0,
                                    time=at if at is not None else time.time(),
                                    kv_hints_json=json.dumps(kv_hints) if kv_hints is not None else "")
        return self._call(self._stub.SessionHint, req, timeout).expected_back_time

    def explain(self, keys: Sequence[bytes], timeout: float | None = None) -> pb.ExplainReply:
        """Why the prompt with these block keys misses: the first block not stored and
        what happened to it (``kind``, ``block``, ``text``; ``tier``/``policy``/``reason``/
        ``time`` for an eviction)."""
        return self._call(self._stub.Explain, pb.ExplainRequest(keys=list(keys)), timeout)

    def resume(self, trajectory_id: str, at: float | None = None,
               timeout: float | None = None) -> tuple[bool, float]:
        """Tell the daemon the trajectory resumed (``at``: unix seconds, default now).
        Returns ``(known, observed_seconds)``."""
        req = pb.ResumeRequest(trajectory_id=trajectory_id, time=at if at is not None else time.time())
        reply = self._call(self._stub.Resume, req, timeout)
        return reply.known, reply.observed_seconds


class ArenaChanged(errors.FeatureDisabled):
    """The daemon serves another shared arena than the one this client mapped (it
    restarted): the mapping was dropped; the next call maps the new arena."""


class _Releaser:
    """Ends leases in the background: ids wait here until the next Lease call carries them
    (``LeaseRequest.release``) or, after ``delay_s`` without one, a thread sends them in
    one Release call. No gRPC future per lease, no wait on the data path."""

    def __init__(self, client: KVStoreClient, delay_s: float = 0.002):
        self.client = client
        self.delay_s = delay_s
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def add(self, lease_id: str) -> None:
        with self._lock:
            self._ids.append(lease_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-client-release", daemon=True)
                self._thread.start()
        self._wake.set()

    def take(self) -> list[str]:
        with self._lock:
            ids, self._ids = self._ids, []
            return ids

    def _send(self) -> None:
        ids = self.take()
        if not ids:
            return
        c = self.client
        try:
            c._stub.Release(pb.ReleaseRequest(lease_ids=ids), timeout=c.timeout, metadata=c._metadata)
        except grpc.RpcError as e:      # the leases end by their TTL
            log.debug("release of %d leases failed: %s", len(ids), e)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                break
            time.sleep(self.delay_s)        # a Lease call coming right after carries them
            self._send()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout)
        self._send()


def _meta_message(m: BlockMeta | None) -> pb.BlockMeta:
    if m is None:
        return pb.BlockMeta()
    return pb.BlockMeta(engine_hash=m.engine_hash, parent_engine_hash=m.parent_engine_hash,
                        token_ids=list(m.token_ids), block_tokens=m.block_tokens, lora_name=m.lora_name)
def _refused_put_reply(err: grpc.RpcError) -> pb.PutReply | None:
    """The PutReply a put refused for a size conflict carries in its trailer (ALREADY_EXISTS,
    see ``kvstore.server.PUT_REPLY_TRAILER``), or None for any other failure."""
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


__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_MESSAGE_BYTES", "GetIntoResult", "KVStoreClient", "NodeInfo",
           "channel_options", "host_view"]
