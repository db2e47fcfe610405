"""Synchronous Python client of the kvstore daemon (used by engines, the CLI and tests).

>>> with KVStoreClient("unix:kvstore-data/kvstore.sock") as c:      # doctest: +SKIP
...     c.put_from(keys, payloads)                    # one buffer per block, or one buffer
...     hit = c.lookup(keys).hit_blocks
...     c.get_into(keys[:hit], out)                   # straight into numpy / torch memory

Data path: on the daemon's own unix socket the client maps the daemon's shared host arena once
(:mod:`kvstore.client.arena_mapping`) and copies blocks straight between it and the caller's buffers
(blocks in its block table with no round trip, others by Lease and Release control frames on the arena
session, :mod:`kvstore.client.arena_control`); gRPC carries Reserve/Commit. Elsewhere (TCP, a
multi-tenant daemon, ``shared_memory=False``) blocks travel as raw frames
(:mod:`kvstore.common.wire`) on gRPC. Both paths give the same results.

The client is composed of parts that own their state, each given what it shares through its constructor:
the :class:`~kvstore.client.connection.Connection` (channel, call, limits, the daemon's info), the
:class:`~kvstore.client.raw.RawPath` (raw frames), the :class:`~kvstore.client.arena.ArenaPath` (mapping,
reservations, leases, their release), the :class:`~kvstore.client.hints.HintCalls`; this class holds the verbs.

Errors: gRPC status codes become :mod:`kvstore.common.errors` exceptions (:mod:`kvstore.common.status`);
a message over the size limit is :class:`~kvstore.common.errors.MessageTooLarge`, never a full store.
Every call that carries keys refuses a key that is not 32 bytes with InvalidRequest before anything is
sent (:mod:`kvstore.client.checks`). The client imports only :mod:`kvstore.common` and the stubs.

A client dropped without :meth:`KVStoreClient.close` cleans up when it is collected (a finalizer
holding its parts, not the client): channel closed, lease-release thread stopped, arena unmapped.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.arena import ArenaChanged, ArenaPath
from kvstore.client.buffers import BlockBuffers, host_view
from kvstore.client.checks import check_keys, check_meta, check_pairs
from kvstore.common.byte_ranges import check_byte_ranges
from kvstore.client.connection import Connection, NodeInfo
from kvstore.client.hints import HintCalls
from kvstore.client.leased_read import LeasedRead, ReadStage
from kvstore.client.raw import RawPath
from kvstore.common.transport import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MESSAGE_BYTES,
    channel_options,
    default_chunk_bytes,
    parts,
)
from kvstore.common.types import BlockMeta, GetResult, LookupResult, PutResult, TierKind


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
            split (:func:`kvstore.common.transport.keys_per_request`); a message the daemon
            still refuses raises :class:`~kvstore.common.errors.MessageTooLarge`.
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
        self._connection = Connection(target, timeout=timeout, auth_token=auth_token, chunk_bytes=chunk_bytes,
                                      max_message_bytes=max_message_bytes, root_certificates=root_certificates)
        self._call = self._connection.call
        self._stub = self._connection.stub
        self._per_request = self._connection.per_request
        self._raw_path = RawPath(self._connection)
        self._arena_path = ArenaPath(self._connection, self._raw_path, shared_memory, lease_ttl_s)
        self._hints = HintCalls(self._connection)
        self._finalizer = weakref.finalize(self, _drop_parts, self._arena_path, self._connection)

    # -------------------------------------------------------------- settings (kept by the parts)

    @property
    def target(self) -> str:
        """The gRPC target this client talks to."""
        return self._connection.target

    @target.setter
    def target(self, value: str) -> None:
        self._connection.target = value

    @property
    def timeout(self) -> float:
        """Per-call deadline in seconds (when a call gives none)."""
        return self._connection.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._connection.timeout = value

    @property
    def chunk_bytes(self) -> int:
        """Largest payload piece per data message (bytes)."""
        return self._connection.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._connection.chunk_bytes = value

    @property
    def max_message_bytes(self) -> int:
        """The gRPC message size limit (bytes)."""
        return self._connection.max_message_bytes

    @max_message_bytes.setter
    def max_message_bytes(self, value: int) -> None:
        self._connection.max_message_bytes = value

    @property
    def lease_ttl_s(self) -> float:
        """TTL of the same-node path's leases and reservations (seconds)."""
        return self._arena_path.lease_ttl_s

    @lease_ttl_s.setter
    def lease_ttl_s(self, value: float) -> None:
        self._arena_path.lease_ttl_s = value

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Send the lease releases still waiting, unmap the shared arena, close the channel."""
        self._finalizer.detach()
        self._arena_path.close()
        self._connection.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the daemon answers. Raises StoreUnavailable after ``timeout`` s."""
        self._connection.wait_ready(timeout)

    # -------------------------------------------------------------- node

    def info(self, timeout: float | None = None) -> NodeInfo:
        """The node's block size, key hash and data-path offer (cached)."""
        return self._connection.info(timeout)

    def ping(self, timeout: float = 1.0) -> NodeInfo:
        """Ask the daemon's Info now (not the cached one), waiting up to ``timeout``
        seconds for the channel to connect: a health probe (e.g. of a circuit breaker)
        that succeeds as soon as a daemon that was gone answers again. Raises
        StoreUnavailable when it does not answer in time."""
        return self._connection.info(timeout, fresh=True, wait_for_ready=True)

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
        return self._arena_path.mapping() is not None

    # -------------------------------------------------------------- lookup, delete, stats

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        """Longest stored prefix of ``keys`` and the tier of each hit block (a control frame
        on the mapped arena's session when the daemon serves them, else a Lookup RPC)."""
        hit, codes = 0, b""
        for part in parts(check_keys(keys), self._per_request()) or [[]]:
            reply = (self._arena_path.lookup(part, timeout)
                     or self._call(self._stub.Lookup, pb.LookupRequest(keys=part), timeout))
            hit += reply.hit_blocks
            codes += reply.tier_codes
            if reply.hit_blocks < len(part):
                break
        return LookupResult(hit, codes)

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Delete blocks from every tier; returns how many were stored."""
        return sum(self._call(self._stub.Delete, pb.DeleteRequest(keys=part), timeout).deleted
                   for part in parts(check_keys(keys), self._per_request()))

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

    def put_from(self, keys: Sequence[bytes], src: Any, *, sizes: Sequence[int] | int | None = None,
                 offsets: Sequence[int] | None = None, meta: Sequence[BlockMeta | None] | None = None,
                 timeout: float | None = None) -> PutResult:
        """Store ``keys`` from ``src``: one C-contiguous buffer per key (numpy arrays, torch
        tensors on CPU or CUDA, any buffer), or one holding every block: in ``len(keys)``
        equal parts (e.g. shaped ``(len(keys), block_bytes)``), or ``sizes`` bytes each,
        back to back or at ``offsets`` (sources may overlap or repeat: only read).

        Same node: Reserve, one copy into the shared arena, Commit; blocks the arena
        cannot take now go by gRPC. ``meta`` as in :meth:`put`. Raises as :meth:`put`.
        """
        keys = check_keys(keys)
        meta = check_meta(meta, len(keys))
        if not keys:
            return PutResult(0, 0, 0)
        bufs = BlockBuffers(src, len(keys), writable=False, offsets=offsets, sizes=sizes)
        lengths = bufs.block_sizes()
        arena = self._arena_path.mapping(timeout)
        if arena is None:
            return self._raw_path.put([(k, bufs.slot(i, n)) for i, (k, n) in enumerate(zip(keys, lengths))],
                                      timeout, meta=meta)
        return self._arena_path.put_from(arena, keys, bufs, lengths, meta, timeout)

    def put(self, blocks: Iterable[tuple[bytes, Any]], timeout: float | None = None, *,
            meta: Sequence[BlockMeta | None] | None = None) -> PutResult:
        """Store blocks given as ``(key, payload)`` pairs (payload: any C-contiguous buffer;
        a non-contiguous view is refused, never copied).

        A block becomes visible only when all its bytes arrived. Re-putting a stored block
        is a no-op counted in ``already_present``. ``meta``: one per block (BlockMeta or
        None), what cache-aware routers index it by (published with its KV events), or None.
        Raises InvalidRequest (bad key/size/payload/meta count: before anything is sent),
        SizeConflict (a key stored with another size; the others are stored: ``.result``),
        TierFull, MessageTooLarge, StoreUnavailable.
        """
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        keys, meta = check_keys([k for k, _ in check_pairs(blocks)]), check_meta(meta, len(blocks))
        return self._raw_path.put(list(zip(keys, (d for _, d in blocks))), timeout, meta=meta)

    # -------------------------------------------------------------- get

    def get_into(self, keys: Sequence[bytes], out: Any, *, ranges: Sequence[tuple[int, int]] | None = None,
                 offsets: Sequence[int] | None = None, stop_at_miss: bool = True,
                 timeout: float | None = None) -> GetIntoResult:
        """Copy blocks (or ``ranges`` of each, concatenated) straight into ``out``: one
        buffer per key, or one buffer of ``len(keys)`` equal slots (e.g. shaped
        ``(len(keys), block_bytes)``), or one buffer with the blocks at ``offsets`` (a slot
        ends at the next larger offset). Buffers: numpy arrays, torch tensors (CPU, pinned or
        CUDA), any writable C-contiguous buffer; slots never overlap (:class:`BlockBuffers`).

        With ``stop_at_miss`` (the default: a prefix) copying stops at the first miss. A
        block too short for ``ranges`` (a range past its end) is a miss, not an error.
        Same node: blocks in the daemon's block table copied with no round trip, the rest
        under a lease; slots of blocks the result does not count hold unspecified bytes.
        Raises InvalidRequest before anything is read (bad ranges; a buffer non-contiguous,
        read-only or overlapping another; equal offsets; with ``ranges``, a slot too small),
        or when a block's size shows its slot too small; StoreUnavailable.
        """
        keys, ranges = check_keys(keys), check_byte_ranges(ranges)
        bufs = BlockBuffers(out, len(keys), writable=True, offsets=offsets)
        bufs.check_fit(sum(n for _, n in ranges or ()))    # with ranges, every block's size is known
        arena_path = self._arena_path
        arena = arena_path.mapping(timeout)
        sizes, codes, start = [0] * len(keys), bytearray(len(keys)), 0
        for _ in range(2):
            if arena is None:
                break
            try:
                start = arena_path.lease_copy(arena, keys, bufs, ranges, stop_at_miss, sizes, codes, timeout)
                break
            except ArenaChanged:                # the daemon restarted: its new arena, or gRPC
                sizes[:], codes[:], start = [0] * len(keys), bytes(len(keys)), 0
                arena = arena_path.mapping(timeout)
        if start < len(keys) and not (stop_at_miss and start and not codes[start - 1]):
            self._raw_path.copy_into(keys, bufs, ranges, stop_at_miss, sizes, codes, start, timeout)
        bufs.finish()
        found = codes.find(0) if stop_at_miss else len(codes) - codes.count(0)
        return GetIntoResult(len(codes) if found < 0 else found, sizes, bytes(codes))

    def get(self, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]] | None = None,
            stop_at_miss: bool = False, timeout: float | None = None) -> list[GetResult]:
        """Fetch blocks (or ``ranges`` of each, concatenated) as new bytes. One result per
        key, in order (with ``stop_at_miss`` the list ends at the first miss, included); a
        block too short for ``ranges`` (a range past its end) is a miss, not an error.

        Raises InvalidRequest (bad key length, bad ranges: ``check_byte_ranges``), StoreUnavailable.
        """
        return self._raw_path.get(check_keys(keys), check_byte_ranges(ranges), stop_at_miss, timeout)

    # -------------------------------------------------------------- leases (low level)

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, *, prefix: bool = True,
              device: bool = False, max_bytes: int = 0, timeout: float | None = None) -> pb.LeaseReply:
        """Pin blocks for reading in place (the shared arena, or HBM with ``device``).
        Returns the raw reply (offsets, sizes, tier codes, IPC blocks, ``resume_at``: the
        grant stopped early past ``max_bytes``, default a quarter of the arena); call
        :meth:`release` with its ``lease_id`` when done. Raises :class:`ArenaChanged` (a
        FeatureDisabled) when the daemon restarted since :meth:`arena` was mapped: take
        the new mapping from :meth:`arena` and lease again."""
        keys = check_keys(keys, limit=self._connection.max_keys_per_request)
        request = pb.LeaseRequest(keys=keys, ttl_seconds=ttl_s or self.lease_ttl_s, prefix=prefix,
                                  device=device, max_bytes=max_bytes)
        return self._arena_path.lease(request, timeout, self._call)

    def release(self, lease_ids: Sequence[str], timeout: float | None = None) -> int:
        """End leases; returns how many were live."""
        return self._arena_path.release(list(lease_ids), timeout, self._call)

    def arena(self):
        """The mapped shared arena (:class:`kvstore.client.arena_mapping.ArenaMapping`), or None."""
        return self._arena_path.mapping()

    def leased_read(self, keys: Sequence[bytes], stages: Sequence[ReadStage], timeout: float | None = None):
        """A read of ``stages`` of ``keys``, each block read or leased once (:class:`LeasedRead`: its ``run``)."""
        rel = self._arena_path.releaser         # blocks in the block table: no lease; notes sent by rel
        return LeasedRead(self, keys, stages, timeout=timeout, release_later=rel.add, notes_waiting=rel.notes_waiting)

    # -------------------------------------------------------------- agent hints

    def tool_call_start(self, trajectory_id: str, tool: str, keys: Sequence[bytes],
                        start_time: float | None = None, timeout: float | None = None) -> float:
        """Tell the daemon trajectory ``trajectory_id`` started tool ``tool``; its prefix is ``keys``.

        ``start_time`` is unix seconds (default: now). Returns the predicted resume time
        (unix seconds).
        """
        return self._hints.tool_call_start(trajectory_id, tool, keys, start_time, timeout)

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
        return self._hints.session_hint(session_id, state, keys, expected_back_s, ttl_s, at, kv_hints, timeout)

    def explain(self, keys: Sequence[bytes], timeout: float | None = None) -> pb.ExplainReply:
        """Why the prompt with these block keys misses: the first block not stored and
        what happened to it (``kind``, ``block``, ``text``; ``tier``/``policy``/``reason``/
        ``time`` for an eviction)."""
        return self._hints.explain(keys, timeout)

    def resume(self, trajectory_id: str, at: float | None = None,
               timeout: float | None = None) -> tuple[bool, float]:
        """Tell the daemon the trajectory resumed (``at``: unix seconds, default now).
        Returns ``(known, observed_seconds)``."""
        return self._hints.resume(trajectory_id, at, timeout)


def _drop_parts(arena_path: ArenaPath, connection: Connection) -> None:
    """The finalizer of a client dropped unclosed: stop its release thread (without
    waiting), unmap its arena, close its channel. Holds the parts, never the client."""
    arena_path.close(wait=False)
    connection.close()


__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_MESSAGE_BYTES", "GetIntoResult", "KVStoreClient", "NodeInfo",
           "channel_options", "host_view"]
