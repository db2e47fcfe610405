"""The client's same-node data path: blocks copied through the daemon's shared host arena.

:class:`ArenaPath`, a part of :class:`kvstore.client.KVStoreClient` (on its ``Connection`` and
``RawPath``), owns the arena's mapping (``ArenaMapping``: made on the first get, put or lookup,
dropped when the daemon restarts), ``put_from`` through it (Reserve, one copy in, Commit),
``get_into``'s copies out of it and the background release of leases (``LeaseReleaser``); what it
cannot move goes by the raw path. Blocks in the daemon's block table are read and looked up with
no round trip (:mod:`kvstore.client.table_read`), the others leased; leases, releases and lookups
go as control frames on the mapping's session (:mod:`kvstore.client.arena_control`) where the
daemon serves them, else (and for reservations, HBM leases, a busy channel) by gRPC.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import grpc

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.arena_control import ControlLost
from kvstore.client.arena_put import SAFE_FRACTION, ArenaPut
from kvstore.client.connection import Connection
from kvstore.client.lease_releaser import LeaseReleaser
from kvstore.client.raw import RawPath
from kvstore.client.table_read import table_copy, table_lookup
from kvstore.common.arena import ARENA_CHANGED
from kvstore.common.arena_wire import MAX_FRAME_BYTES, MAX_FRAME_KEYS, reserve_frame_length
from kvstore.common.host_copy import copy, copy_slots
from kvstore.common.transport import parts
from kvstore.common.types import LookupResult, PutResult

log = logging.getLogger("kvstore.client")

RECHECK_S = 30.0
"""A client without a mapping asks the daemon's offer again after this long (seconds)."""

RECHECK_AFTER_FAILURE_S = 1.0
"""... or this long after a call found the daemon unavailable (restarting, not started; s)."""

MAP_RETRY_S = 5.0
"""A failed mapping (no answer in time, refused) is tried again after this long (s)."""

_clock = time.monotonic


class ArenaChanged(errors.FeatureDisabled):
    """The daemon serves another shared arena than the one this client mapped (it
    restarted): the mapping was dropped; the next call maps the new arena."""


class ArenaPath:
    """Blocks through the shared arena (unix-socket clients of a daemon that offers one).

    Args:
        connection: the daemon's connection.
        raw: the gRPC path, for the blocks the arena cannot move.
        shared_memory: None: map the arena when the daemon offers one; False: never;
            True: raise FeatureDisabled (on first use) when it cannot be mapped.
        lease_ttl_s: TTL of the leases and reservations this path asks for (seconds).

    The daemon's offer is asked for on first use and asked again when there is no mapping
    and either a call found the daemon unavailable since (it may have restarted, or only
    now started: at most every :data:`RECHECK_AFTER_FAILURE_S`) or :data:`RECHECK_S`
    passed; a daemon that was not answering yet is asked again on the next call.
    """

    def __init__(self, connection: Connection, raw: RawPath, shared_memory: bool | None, lease_ttl_s: float):
        self.lease_ttl_s = lease_ttl_s
        self._conn = connection
        self._raw = raw
        self._stub = connection.stub
        self._per_request = connection.per_request
        self._want = shared_memory
        self._arena = None
        self._checked = False
        self._next_check = 0.0              # _clock() time to ask the offer again anyway
        self._next_after_failure = 0.0      # ... or after a call found the daemon unavailable
        self._unavailable_seen = 0
        self._map_lock = threading.Lock()
        self.releaser = LeaseReleaser(connection, channel=lambda: self.channel(self._arena))
        self._put = ArenaPut(self.put_call, connection.stub.Reserve, connection.stub.Commit, raw.put,
                             connection.per_request)

    @property
    def current(self):
        """The arena mapped now, or None (never maps it: see :meth:`mapping`)."""
        return self._arena

    def _due(self) -> bool:
        """Whether to ask the daemon's offer again (see the class docstring)."""
        if not self._checked:
            return True
        now = _clock()
        return now >= self._next_check or (self._conn.unavailable != self._unavailable_seen
                                           and now >= self._next_after_failure)

    def mapping(self, timeout: float | None = None):
        """The mapped arena (:class:`~kvstore.client.arena_mapping.ArenaMapping`), mapped on
        first use; None when there is none to map (TCP, none offered, cannot map). Raises
        FeatureDisabled when ``shared_memory=True`` and it cannot be mapped, and
        StoreUnavailable when the daemon does not answer its Info within ``timeout``
        seconds (the next call asks again)."""
        if self._arena is not None or not self._due():
            return self._arena
        with self._map_lock:                # one thread maps; the others then see its mapping
            if self._arena is not None or not self._due():
                return self._arena
            return self._check(timeout)

    def _check(self, timeout: float | None):
        c = self._conn
        if self._want is False or not c.target.startswith("unix:"):
            self._checked, self._next_check, self._next_after_failure = True, math.inf, math.inf
            if self._want:
                raise errors.FeatureDisabled("shared memory needs the daemon's unix socket")
            return None
        seen = c.unavailable
        info = c.info(timeout, fresh=self._checked)
        now = _clock()
        self._checked, self._unavailable_seen = True, seen
        self._next_check, self._next_after_failure = now + RECHECK_S, now + RECHECK_AFTER_FAILURE_S
        if not info.shm_socket:
            if self._want:
                raise errors.FeatureDisabled(f"the daemon offers no shared arena: {info.shm_refused}")
            return None
        from kvstore.client.arena_mapping import ArenaMapping
        try:
            self._arena = ArenaMapping(info.shm_socket, c.auth_token, timeout=timeout or c.timeout)
        except OSError as e:
            if self._want:
                raise errors.FeatureDisabled(f"cannot map the shared arena: {e}") from None
            log.info("shared arena unavailable (%s); using gRPC for block data, mapping it again in %.0f s",
                     e, MAP_RETRY_S)
            self._next_check = _clock() + MAP_RETRY_S
        return self._arena

    def _drop(self, arena, why: str) -> ArenaChanged:
        """Forget ``arena`` (and the daemon's info) when it is still the mapping: the daemon
        serves another arena, or the session it was handed out with ended."""
        if self._arena is arena:
            self._arena, self._checked = None, False
            self._conn.forget_info()
        log.info("the daemon at %s serves a new shared arena or ended the session (%s); mapping it again",
                 self._conn.target, why)
        return ArenaChanged(why)

    def call(self, method, request, timeout: float | None, arena):
        """A Lease, Reserve or Commit naming the arena ``arena`` the client maps. Raises
        :class:`ArenaChanged` (and forgets the mapping and the daemon's info) when the
        daemon serves another arena: it restarted since, and the old mapping must not be
        read or written. Other failures raise their store error."""
        c = self._conn
        try:
            return method(request, timeout=timeout or c.timeout,
                          metadata=c.metadata + arena.metadata)     # the arena and the session
        except grpc.RpcError as e:
            error = c.error(e)
            if isinstance(error, errors.FeatureDisabled) and ARENA_CHANGED in (e.details() or ""):
                raise self._drop(arena, e.details()) from None
            raise error from None

    def put_call(self, method, request, timeout: float | None, arena):
        """A zero-copy put's Reserve or Commit: a control frame on ``arena``'s session when the
        daemon takes them there (one unix-socket round trip; the channel busy or the frame
        too large: gRPC), else :meth:`call`. Answers have the reply messages' attribute
        names. Raises as :meth:`call`."""
        ch = self.channel(arena)
        if ch is not None and ch.puts and len(request.keys) <= MAX_FRAME_KEYS:
            t = timeout or self._conn.timeout
            if isinstance(request, pb.ReserveRequest):
                metas = [m.SerializeToString() for m in request.meta] if request.meta else None
                if reserve_frame_length(len(request.keys), metas) <= MAX_FRAME_BYTES:
                    got = self.control(arena, ch.reserve, list(request.keys), list(request.sizes),
                                       request.ttl_seconds, metas, t)
                    if got is not None:
                        return got
            else:
                got = self.control(arena, ch.commit, list(request.keys), request.abort, t)
                if got is not None:
                    return got
        return self.call(method, request, timeout, arena)

    @staticmethod
    def channel(arena):
        """The usable control channel of mapping ``arena`` (None: none, or not usable)."""
        ch = arena.control if arena is not None else None
        return ch if ch is not None and ch.usable() else None

    def control(self, arena, call, *args):
        """``call(*args)`` on ``arena``'s control channel: its answer (None: the channel was
        busy). Raises :class:`ArenaChanged` (the mapping forgotten) when the session ended,
        and the store error the daemon answered."""
        try:
            return call(*args)
        except ControlLost as e:
            raise self._drop(arena, str(e)) from None
        except errors.FeatureDisabled as e:
            if ARENA_CHANGED in str(e):
                raise self._drop(arena, str(e)) from None
            raise

    def lookup(self, keys: list[bytes], timeout: float | None) -> LookupResult | None:
        """``lookup`` from the daemon's block table, else on the arena's control channel (the
        arena mapped on first use: a scheduler that only looks up reads the table); None when
        there is none or it is busy (the caller asks by gRPC). Raises the store error answered."""
        try:
            arena = self._arena or self.mapping(timeout)
        except errors.FeatureDisabled:      # the Lookup RPC answers it; a get says why
            return None
        found = table_lookup(arena, self.releaser.notes_waiting, keys)
        if found is not None:
            return found
        ch = self.channel(arena)
        if ch is None:
            return None
        hit, codes = 0, b""
        try:
            for part in parts(keys, MAX_FRAME_KEYS) or [[]]:
                got = self.control(arena, ch.lookup, part, timeout or self._conn.timeout)
                if got is None:
                    return None
                hit, codes = hit + got[0], codes + got[1]
                if got[0] < len(part):
                    break
        except ArenaChanged:
            return None
        return LookupResult(hit, codes)

    def lease(self, request: pb.LeaseRequest, timeout: float | None, call) -> pb.LeaseReply:
        """The client's ``lease``: on the control channel of the arena mapped now when it
        can (not ``device``), else a gRPC Lease naming that arena, else ``call(Lease, ...)``.
        The arena is mapped first (a lease names the client's session: it ends with the
        client). Raises :class:`ArenaChanged`, the store error answered."""
        try:
            arena = self.mapping(timeout)
        except errors.FeatureDisabled:      # shared_memory=True but no arena here: a gRPC lease
            arena = None
        ch = self.channel(arena)
        if ch is not None and not request.device and len(request.keys) <= MAX_FRAME_KEYS:
            a = self.control(arena, ch.lease, list(request.keys), request.ttl_seconds, request.prefix,
                             request.max_bytes, [], timeout or self._conn.timeout)
            if a is not None:
                return pb.LeaseReply(lease_id=a.lease_id, offsets=a.offsets, sizes=a.sizes, tier_codes=a.tier_codes,
                                     ttl_seconds=a.ttl_seconds, resume_at=a.resume_at, complete=a.complete)
        if arena is not None:
            return self.call(self._stub.Lease, request, timeout, arena)
        return call(self._stub.Lease, request, timeout)

    def release(self, lease_ids: list[str], timeout: float | None, call) -> int:
        """The client's ``release``: on the control channel of the arena mapped now when it
        can, else ``call(Release, ...)``; returns how many leases were live."""
        arena = self._arena
        ch = self.channel(arena)
        if ch is not None:
            try:
                released = self.control(arena, ch.release, lease_ids, timeout or self._conn.timeout)
                if released is not None:
                    return released
            except ArenaChanged:
                pass
        return call(self._stub.Release, pb.ReleaseRequest(lease_ids=lease_ids), timeout).released

    def close(self, wait: bool = True) -> None:
        """Send the releases still waiting (without ``wait``: only stop the release
        thread, see :meth:`LeaseReleaser.close`) and unmap the arena."""
        self.releaser.close(wait)
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def put_from(self, arena, keys, bufs, lengths, meta, timeout) -> PutResult:
        """``put_from`` through ``arena`` (:meth:`kvstore.client.arena_put.ArenaPut.put_from`)."""
        return self._put.put_from(arena, keys, bufs, lengths, meta, timeout, ttl=self.lease_ttl_s,
                                  clock=_clock, copy=copy, changed=ArenaChanged)

    def lease_copy(self, arena, keys, bufs, ranges, stop_at_miss, sizes, codes, timeout) -> int:
        """``get_into``'s same-node half: copy blocks (or ``ranges`` of each) out of
        ``arena`` into ``bufs``, one lease at a time (a lease stops early when the arena
        cannot hold more at once), setting ``sizes[i]`` (bytes) and ``codes[i]`` (tier
        code, 0: not found). Each lease is released in the background (:attr:`releaser`).
        Blocks in the block table are copied first, with no lease. Returns the index of the
        first key not looked at (``len(keys)``: done; the rest goes by gRPC). Raises
        :class:`ArenaChanged`, StoreUnavailable."""
        src = arena.array
        start, release = table_copy(arena, self._copy_out, self.releaser.notes_waiting, keys, bufs, ranges,
                                    stop_at_miss, sizes, codes), []
        ch = self.channel(arena)
        per = min(self._per_request(extra=128), MAX_FRAME_KEYS)
        try:
            while start < len(keys):
                part = keys[start:start + per]
                sent = _clock()
                ids = release + self.releaser.take()
                reply = None
                if ch is not None:              # one round trip on the session, no gRPC call
                    reply = self.control(arena, ch.lease, part, self.lease_ttl_s, stop_at_miss, 0, ids,
                                         timeout or self._conn.timeout)
                if reply is None:
                    reply = self.call(self._stub.Lease, pb.LeaseRequest(
                        keys=part, ttl_seconds=self.lease_ttl_s, prefix=stop_at_miss, release=ids), timeout, arena)
                release = [reply.lease_id] if reply.lease_id else []
                self._copy_out(src, reply, start, bufs, ranges, sizes, codes)
                if _clock() - sent > min(self.lease_ttl_s, arena.max_ttl_s) * SAFE_FRACTION:
                    # the copies may have outlived the lease: the space may hold other blocks now
                    log.warning("a lease of the shared arena was too old when its copy finished (the client "
                                "stalled); reading those blocks again by gRPC")
                    for i in range(start, start + len(reply.tier_codes)):
                        sizes[i], codes[i] = 0, 0
                    return start
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
                self.releaser.add(lease_id)

    @staticmethod
    def _copy_out(src, reply, start, bufs, ranges, sizes, codes) -> None:
        """Copy the blocks of lease ``reply`` (its keys from ``start`` on) out of the arena
        ``src`` into ``bufs``, setting their ``sizes`` and ``codes``."""
        n = len(reply.tier_codes)
        run = None if ranges or not n or 0 in reply.tier_codes else bufs.run(start, reply.sizes)
        if run is not None:                     # whole blocks into back-to-back slots: one call a run
            copy_slots(run, src, reply.offsets, bufs.stride)
            sizes[start:start + n] = reply.sizes
            codes[start:start + n] = reply.tier_codes
            return
        for i, off, size, code in zip(range(start, start + n), reply.offsets, reply.sizes, reply.tier_codes):
            if not code:
                continue
            if ranges:
                if any(r_off + length > size for r_off, length in ranges):
                    continue                    # a block too short for the ranges: a miss
                total = sum(length for _, length in ranges)
                dst = bufs.slot(i, total)
                pos = 0
                for r_off, length in ranges:
                    dst[pos:pos + length] = src[off + r_off:off + r_off + length]
                    pos += length
                sizes[i] = total
            else:
                copy(bufs.slot(i, size), src[off:off + size])
                sizes[i] = size
            codes[i] = code
