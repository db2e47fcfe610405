"""The gRPC service: blocks (Put/Get/Lookup/Delete), leases and reservations for the
same-node path, Stats/Info, and the agent-hint RPCs, which it delegates to the
:class:`~kvstore.service.hints.HintHandlers` it holds.

Runs on a thread pool (``[server] workers``): handlers copy payloads with the GIL
released inside numpy/file I/O, and the catalogue lock is held only for catalogue
changes. Every failure maps to one status code with a message that says what was wrong
(:mod:`kvstore.common.status`, through the handler wrappers of :mod:`kvstore.service.interceptors`);
the daemon keeps serving after any bad request. Every number a client sends is checked
before anything changes (:mod:`kvstore.service.validate`).

**Tenants** (:mod:`kvstore.service.auth`): with ``[server.tenants]`` every client key is mapped
to the caller's tenant key space before the manager sees it, keys in replies are the
client's own, and leases and reservations belong to the tenant that made them; a tenant
can neither read, look up, delete, release nor commit another tenant's blocks.

Bulk data: ``Get``/``Put`` (protobuf) and ``GetRaw``/``PutRaw`` (raw frames,
:mod:`kvstore.common.wire`, registered by :func:`data_handler`) share :mod:`kvstore.service.get_stream`
and :mod:`kvstore.service.put_assembly`; both keep every message under the size limit, counting
framing and misses. Streaming calls run on threads of their own, are cancelled when they wait
on their client too long and ended when they run too long (:mod:`kvstore.service.streams`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import grpc

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.service.auth import SHARED, Authenticator, KeySpace
from kvstore.service.get_frames import raw_frames
from kvstore.service.get_stream import GetPlan, proto_batches
from kvstore.service.interceptors import well_formed
from kvstore.service.interceptors import abort_call as _abort
from kvstore.service.interceptors import streaming_handler as _streaming
from kvstore.service.interceptors import unary_handler as _unary
from kvstore.store.manager import MAX_LEASE_TTL_S, TierManager
from kvstore.service.put_assembly import PutAssembler, finish_put, writer_wait_left
from kvstore.service.streams import StreamGuard, on_pool
from kvstore.common.arena import ARENA_CHANGED, ARENA_HEADER, SESSION_HEADER
from kvstore.common.transport import FRAMING_BYTES
from kvstore.service.hints import HintHandlers
from kvstore.service.arena_puts import commit_blocks, reserve_blocks
from kvstore.common.byte_ranges import check_byte_ranges
from kvstore.service.validate import (check_chunk_keys, check_keys, check_meta, check_number,
                                      check_ttl, decode_meta)
from kvstore.common.wire import META, FrameError, decode

log = logging.getLogger("kvstore.service.server")

DATA_SERVICE = "kvstore.v1.KVStoreData"
DATA_METHODS = ("Get", "Put", "PutInline")
"""Methods of the KVStore service that carry block data: they run on the stream threads
(with ``GetRaw`` and ``PutRaw``), so the other threads stay free for control calls."""
HINT_METHODS = ("ToolCallStart", "Resume", "SessionHint", "Explain")
"""Advice (and a diagnosis): on threads of their own, so a flood never holds Lookup or Lease."""
MIN_CHUNK_BYTES = 4096
"""A Get's ``max_chunk_bytes`` below this is raised to it: each message costs the daemon tens
of microseconds whatever it holds, so 1-byte chunks made a block's get cost that per byte."""
DEFAULT_LEASE_TTL_S = 30.0
"""``[server] lease_ttl_s``'s default: the longest lease or reservation granted (seconds)."""


def _pieces(chunks) -> Iterator[tuple[bytes, int, int, int]]:
    """A Put message's chunks as (key, total_size, offset, length), for
    :meth:`~kvstore.service.put_assembly.PutAssembler.check_message`."""
    return ((c.key, c.total_size, c.offset, len(c.data)) for c in chunks)


class KVStoreService(pb_grpc.KVStoreServicer):
    """Serves one :class:`~kvstore.store.manager.TierManager`.

    Args:
        manager: the block store.
        max_chunk_bytes: largest payload of one Get message (bytes).
        max_message_bytes: the gRPC message size limit (bytes); replies stay below it.
        hints: the prefetch scheduler (``tool_call_start``, ``resume``,
            ``observe_request``; monotonic seconds), or None: hint calls get
            FAILED_PRECONDITION. Lookups feed its reuse statistics; the hint RPCs go to
            :attr:`hint_handlers` (:class:`~kvstore.service.hints.HintHandlers`, built here
            from ``hints``, ``sessions`` and ``explain``).
        auth: maps each call's bearer token to its tenant; None: one shared key space.
        health: :class:`kvstore.service.health.HealthMonitor` (Stats reports it), or None.
        info: the :class:`~kvstore._proto.kvstore_pb2.InfoReply` to answer Info with.
        observe: called with (method name, seconds, tenant) after every call (metrics).
        tally: counts Lookups per tenant (metrics), or None.
        sessions: applies a :class:`~kvstore.agent.sessions.SessionHint` (monotonic seconds),
            returning the expected-back time; None: SessionHint gets FAILED_PRECONDITION.
        explain: maps a prompt's keys to an :class:`~kvstore.service.explain.Explanation`.
        stream_idle_timeout_s: a stream waiting on its client longer is cancelled (seconds).
        stream_first_message_s: a Put stream that sent no message yet is cancelled after
            this long (seconds; ``stream_idle_timeout_s`` when that is shorter).
        stream_timeout_s: a stream running longer is ended, DEADLINE_EXCEEDED (seconds).
        stream_pool: the threads streaming calls run on (:func:`~kvstore.service.streams.on_pool`),
            or None: the server's; hint_pool: the same for the agent-hint calls (HINT_METHODS).
        lease_ttl_s: the longest TTL a lease or reservation is granted (seconds): a longer
            one asked for is granted this long (the reply says so), and one asked as 0 too.
    """

    def __init__(self, manager: TierManager, *, max_chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 64 << 20, hints=None, auth: Authenticator | None = None,
                 stream_idle_timeout_s: float = 30.0, stream_first_message_s: float = 5.0, health=None, info: pb.InfoReply | None = None,
                 observe: Callable[[str, float, str], None] | None = None, tally=None, sessions=None,
                 explain=None, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 stream_timeout_s: float = float("inf"), stream_pool=None, hint_pool=None):
        self.manager = manager
        self.max_chunk_bytes = max_chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.hints = hints
        self.auth = auth
        self.health = health
        self.info = info or pb.InfoReply()
        self.streams = StreamGuard(stream_idle_timeout_s, stream_timeout_s, counters=manager.counters,
                                   first_message_s=stream_first_message_s)
        self.stream_pool = stream_pool
        for names, pool in ((DATA_METHODS, stream_pool), (HINT_METHODS, hint_pool)):
            for name in names if pool is not None else ():    # registered from these attributes
                setattr(self, name, on_pool(getattr(self, name), pool))     # (grpc's per-method pool)
        self.lease_ttl_s = lease_ttl_s
        self._observe = observe
        self.tally = tally
        self.hint_handlers = HintHandlers(hints, sessions, explain)
        self.arena_id = ""          # the shared arena handed out (kvstore.service.arena_server.arena_identity); "": none

    def observe(self, method: str, seconds: float, context=None) -> None:
        """Report one call's latency (seconds) to the metrics, with the caller's tenant."""
        if self._observe is not None:
            tenant = ""
            if self.auth is not None and context is not None:
                tenant = self.auth.tenant_for(context.invocation_metadata()) or ""
            self._observe(method, seconds, tenant)

    def _space(self, context) -> KeySpace:
        """The caller's key space. Raises Unauthenticated (defence in depth: the
        interceptor refuses such calls before they get here)."""
        if self.auth is None:
            return SHARED
        space = self.auth.key_space(context.invocation_metadata())
        if space is None:
            raise errors.Unauthenticated("missing or wrong bearer token")
        return space

    # ------------------------------------------------------------------ put

    @_unary
    def Put(self, request_iterator, context) -> pb.PutReply:
        space = self._space(context)
        with self.streams.watch(context, "Put") as watch, \
                PutAssembler(self.manager, space.internal, lambda: writer_wait_left(context)) as asm:
            for batch in watch.requests(request_iterator):
                asm.check_message(_pieces(check_chunk_keys(well_formed(batch).chunks)))
                for c in batch.chunks:
                    if c.HasField("meta"):
                        asm.meta(c.key, check_meta(c.meta))
                    asm.chunk(c.key, c.total_size, c.offset, c.data)
            return finish_put(asm, context)

    @_unary
    def PutInline(self, request: pb.PutBatch, context) -> pb.PutReply:
        space = self._space(context)
        with PutAssembler(self.manager, space.internal, lambda: writer_wait_left(context)) as asm:
            asm.check_message(_pieces(check_chunk_keys(request.chunks)), whole=True)
            for c in request.chunks:
                if c.HasField("meta"):
                    asm.meta(c.key, check_meta(c.meta))
                asm.chunk(c.key, c.total_size, c.offset, c.data)
            return finish_put(asm, context)

    def put_raw(self, frames: Iterator[bytes], context) -> bytes:
        """``PutRaw``: raw frames in, a serialized PutReply out."""
        t0 = time.perf_counter()
        try:
            space = self._space(context)
            with self.streams.watch(context, "PutRaw") as watch, \
                    PutAssembler(self.manager, space.internal, lambda: writer_wait_left(context)) as asm:
                for frame in watch.requests(frames):
                    try:
                        records = decode(frame)
                    except FrameError as e:
                        raise errors.InvalidRequest(str(e)) from None   # abort_call names the method
                    asm.check_message((r.key, r.total, r.offset, len(r.data)) for r in records
                                      if not r.flags & META)
                    for r in records:
                        if r.flags & META:
                            asm.meta(r.key, check_meta(decode_meta(r.data)))
                            continue
                        asm.chunk(r.key, r.total, r.offset, r.data)
                return finish_put(asm, context).SerializeToString()
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, "PutRaw")
        finally:
            self.observe("PutRaw", time.perf_counter() - t0, context)

    # ------------------------------------------------------------------ get

    def _plan(self, request: pb.GetRequest, context) -> GetPlan:
        space = self._space(context)
        keys = check_keys(request.keys)
        ranges = check_byte_ranges((r.offset, r.length) for r in request.ranges)
        step = asked = self.max_chunk_bytes
        if request.max_chunk_bytes:
            asked = min(step, int(check_number(request.max_chunk_bytes, "max_chunk_bytes", low=1)))
            step = max(asked, min(step, MIN_CHUNK_BYTES))
        # a message holds one piece and its framing: it fits the client's limit whenever
        # the client asks for pieces FRAMING_BYTES below it (kvstore.common.transport); a
        # piece raised to MIN_CHUNK_BYTES still fits (FRAMING_BYTES is larger)
        limit = min(self.max_message_bytes, asked + FRAMING_BYTES)
        return GetPlan(self.manager, keys, space.internal, ranges, request.stop_at_miss, step, limit)

    @_streaming
    def Get(self, request: pb.GetRequest, context) -> Iterator[pb.GetBatch]:
        plan = self._plan(request, context)
        with self.streams.watch(context, "Get") as watch:
            yield from watch.replies(proto_batches(plan))

    def get_raw(self, request_bytes: bytes, context) -> Iterator[bytes]:
        """``GetRaw``: a serialized GetRequest in, raw frames out."""
        t0 = time.perf_counter()
        try:
            try:
                request = pb.GetRequest.FromString(request_bytes)
            except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
                raise errors.InvalidRequest(f"request does not decode: {e}") from None
            plan = self._plan(request, context)
            with self.streams.watch(context, "GetRaw") as watch:
                yield from watch.replies(raw_frames(plan))
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, "GetRaw")
        finally:
            self.observe("GetRaw", time.perf_counter() - t0, context)

    # ------------------------------------------------------------------ lookup, delete, stats

    @_unary
    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupReply:
        space = self._space(context)
        keys = space.internal_many(check_keys(request.keys))
        if self.hints is not None:
            self.hints.observe_request(keys)   # reuse statistics for next_use and prefetch
        res = self.manager.lookup(keys)
        if self.tally is not None:
            self.tally.lookup(space.tenant, len(keys), res.hit_blocks)
        return pb.LookupReply(hit_blocks=res.hit_blocks, tier_codes=res.tier_codes)

    @_unary
    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteReply:
        space = self._space(context)
        return pb.DeleteReply(deleted=self.manager.delete(space.internal_many(check_keys(request.keys))))

    @_unary
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        self._space(context)
        m = self.manager
        tiers = [pb.TierStats(tier=int(u.kind), name=u.name, capacity_bytes=u.capacity_bytes,
                              used_bytes=u.used_bytes, blocks=u.blocks, policy=u.policy,
                              payload_bytes=m.payload_bytes(i))
                 for i, u in enumerate(m.usage())]
        counters = {k: int(v) for k, v in m.counters.items() if v >= 0}
        cat = m.catalogue
        counters["open_leases"] = cat.num_leases                   # gauges: what is held now
        counters["open_reservations"], counters["overdue_reservations"] = cat.reservations(cat.clock())
        if m.cluster is not None:
            counters.update(m.cluster.stats())     # the remote tier's call counters
        serving = self.health.serving if self.health is not None else True
        problems = list(self.health.problems) if self.health is not None else []
        return pb.StatsReply(tiers=tiers, counters=counters, serving=serving, problems=problems)

    @_unary
    def Info(self, request: pb.InfoRequest, context) -> pb.InfoReply:
        self._space(context)
        return self.info

    # ------------------------------------------------------------------ agent hints (kvstore.service.hints)

    @_unary
    def ToolCallStart(self, request: pb.ToolCallStartRequest, context) -> pb.ToolCallStartReply:
        return self.hint_handlers.tool_call_start(request, self._space(context))

    @_unary
    def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        return self.hint_handlers.resume(request, self._space(context))

    @_unary
    def SessionHint(self, request: pb.SessionHintRequest, context) -> pb.SessionHintReply:
        return self.hint_handlers.session_hint(request, self._space(context))

    @_unary
    def Explain(self, request: pb.ExplainRequest, context) -> pb.ExplainReply:
        return self.hint_handlers.explain(request, self._space(context))

    # ------------------------------------------------------------------ same-node data plane

    def _check_arena(self, context) -> None:
        """A mapped client names its arena (:data:`~kvstore.common.arena.ARENA_HEADER`); one mapped
        from another daemon (this one restarted since) would read and write the wrong
        memory: refused (FAILED_PRECONDITION), before anything changes."""
        for k, v in context.invocation_metadata():
            if k == ARENA_HEADER and v != self.arena_id:
                raise errors.FeatureDisabled(f"{ARENA_CHANGED}: the client maps arena {v}, the daemon serves "
                                             f"{self.arena_id or 'none'} (it restarted?); map it again")

    def _ttl(self, asked: float) -> float:
        """The TTL granted for ``asked`` seconds (0: not said): at most :attr:`lease_ttl_s`.
        Raises InvalidRequest outside ``[MIN_TTL_S, MAX_LEASE_TTL_S]``."""
        return min(check_ttl(asked, "ttl_seconds", self.lease_ttl_s, MAX_LEASE_TTL_S), self.lease_ttl_s)

    @staticmethod
    def _session(context) -> str:
        """The same-node client session a call names (:data:`SESSION_HEADER`; "": none)."""
        return next((v for k, v in context.invocation_metadata() if k == SESSION_HEADER), "")

    @_unary
    def Lease(self, request: pb.LeaseRequest, context) -> pb.LeaseReply:
        space = self._space(context)
        self._check_arena(context)
        ttl = self._ttl(request.ttl_seconds)
        keys = check_keys(request.keys)
        internal = space.internal_many(keys)
        for lease_id in request.release:    # after the checks: a refused call changes nothing
            self.manager.release(lease_id, space.tenant)
        grant = self.manager.lease(internal, ttl, space.tenant, prefix=request.prefix, device=request.device,
                                   max_bytes=request.max_bytes or None, session=self._session(context))
        reply = pb.LeaseReply(lease_id=grant.lease_id, ttl_seconds=grant.ttl_s,
                              resume_at=grant.resume_at or 0, complete=grant.resume_at is None)
        reply.offsets.extend(b.offset for b in grant.blocks)
        reply.sizes.extend(b.size for b in grant.blocks)
        reply.tier_codes = bytes(int(b.tier) if b.found else 0 for b in grant.blocks)
        for i, b in enumerate(grant.blocks):
            if b.ipc is not None:
                reply.ipc.append(pb.IpcBlock(index=i, ipc_handle=b.ipc.handle, offset=b.ipc.offset,
                                             size=b.ipc.size, device=b.ipc.device))
        return reply

    @_unary
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        space = self._space(context)
        return pb.ReleaseReply(released=sum(self.manager.release(i, space.tenant) for i in request.lease_ids))

    @_unary
    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveReply:
        space = self._space(context)
        self._check_arena(context)
        keys = check_keys(request.keys)
        if request.meta and len(request.meta) != len(keys):
            raise errors.InvalidRequest(f"{len(keys)} keys but {len(request.meta)} block metas")
        metas = [check_meta(m) for m in request.meta] if request.meta else None
        offsets, status, detail = reserve_blocks(self.manager, space, keys, request.sizes, metas,
                                                 self._ttl(request.ttl_seconds), self._session(context))
        return pb.ReserveReply(offsets=offsets, status=status, detail=detail)

    @_unary
    def Commit(self, request: pb.CommitRequest, context) -> pb.CommitReply:
        space = self._space(context)
        self._check_arena(context)
        committed, nbytes = commit_blocks(self.manager, space, check_keys(request.keys), self._session(context),
                                          request.abort)
        return pb.CommitReply(committed=committed, bytes_committed=nbytes)


def data_handler(service: KVStoreService) -> grpc.GenericRpcHandler:
    """The raw-frame methods ``GetRaw`` and ``PutRaw`` of :data:`DATA_SERVICE` (on the
    service's stream pool when it has one)."""
    get_raw, put_raw = service.get_raw, service.put_raw
    if service.stream_pool is not None:
        get_raw, put_raw = on_pool(get_raw, service.stream_pool), on_pool(put_raw, service.stream_pool)
    return grpc.method_handlers_generic_handler(DATA_SERVICE, {
        "GetRaw": grpc.unary_stream_rpc_method_handler(get_raw),
        "PutRaw": grpc.stream_unary_rpc_method_handler(put_raw),
    })
