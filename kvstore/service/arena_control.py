"""The daemon's side of the same-node control frames: Lookup, Lease, Release, Reserve and Commit on the session.

A client that said hello version 3 (:mod:`kvstore.common.arena`) and was granted a served
session sends control frames (:mod:`kvstore.common.arena_wire`) on its arena connection.
:meth:`ArenaControl.serve` runs on that session's own thread
(:meth:`kvstore.service.liveness.ClientSessions.open_served`): it reads a frame, calls the
store directly (the same manager calls, checks and limits as the gRPC ``Lookup``, ``Lease``,
``Release``, ``Reserve`` and ``Commit`` handlers of :mod:`kvstore.service.server`; the last
two share :mod:`kvstore.service.arena_puts`), answers, and only then does the
bookkeeping that the answer does not need, when no frame waits: the policies' touches of the
leased blocks (they are pinned already), the reuse statistics of a lookup, the metrics. One thread per session
blocked in ``recv``: an answer costs one wake-up, and a slow call (a lease that pages blocks
back from NVMe) delays only its own client.

Guarantees kept: the session is authenticated at hello (the bearer token) and every key is
mapped to the session's key space (:class:`kvstore.service.auth.KeySpace`), so leases belong
to its tenant; leases name the session, so the liveness watcher's reclaim and the store's
refusal of a closed session apply as on gRPC; the arena is the one this connection handed
out (a restarted daemon is another process, and the client sees this connection end). Bad
input: a frame that parses but is wrong is answered ERROR and the session goes on; one that
cannot be framed (shorter than a header, longer than
:data:`~kvstore.common.arena_wire.MAX_FRAME_BYTES`) is answered ERROR and the connection
closed. Nothing a client sends ends the thread with an exception.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Callable

from kvstore.common import arena_wire as w
from kvstore.common.errors import KVStoreError
from kvstore.service.arena_puts import commit_blocks, reserve_blocks
from kvstore.service.auth import SHARED, KeySpace
from kvstore.service.validate import check_meta, check_ttl, decode_meta
from kvstore.store.manager import MAX_LEASE_TTL_S, TierManager

log = logging.getLogger("kvstore.service.arena_control")

_BODY = struct.Struct("<BBBBII")        # the header after its length field
_FIRST_BUFFER = 64 << 10

MAX_DEFERRED = 64
"""Bookkeeping callables (a few per frame) a session lets wait while frames keep coming."""


def _run(later: list) -> None:
    """Run (and forget) the bookkeeping of answered frames; a failure is logged, never raised."""
    for fn in later:
        try:
            fn()
        except Exception:  # noqa: BLE001 - bookkeeping never ends a session
            log.exception("arena control: bookkeeping after a frame failed")
    later.clear()


class ArenaControl:
    """Answers control frames with the store's calls.

    Args:
        manager: the block store.
        lease_ttl_s: the longest lease granted (``[server] lease_ttl_s``); a TTL of 0 asks for it.
        hints: the prefetch scheduler (its ``observe_request`` sees every lookup), or None.
        tally: per-tenant lookup counts (metrics), or None.
        observe: called with (method, seconds, tenant) per frame (metrics), or None.
    """

    def __init__(self, manager: TierManager, *, lease_ttl_s: float, hints=None, tally=None,
                 observe: Callable[[str, float, str], None] | None = None):
        self.manager = manager
        self.lease_ttl_s = lease_ttl_s
        self.hints = hints
        self.tally = tally
        self.observe = observe
        self.frames = 0
        """Frames answered so far (errors included)."""
        self.refused = 0
        """Frames answered ERROR so far."""

    def serve(self, conn: socket.socket, session: str, space: KeySpace = SHARED) -> bool:
        """Serve the frames of ``conn`` (a blocking socket) for ``session`` until the client
        closes it, it fails, or a frame cannot be framed. Never raises for what a client sends.
        Returns False when the daemon ended the session (a frame it cannot frame: the client
        may still be running), True when the client closed it or the connection failed.
        Answers come first: the bookkeeping of answered frames runs when no frame waits (or
        once :data:`MAX_DEFERRED` frames' worth is pending), and before the session ends."""
        buf = bytearray(_FIRST_BUFFER)
        view = memoryview(buf)
        have = 0
        later: list[Callable[[], None]] = []
        try:
            while True:
                if have >= w.LENGTH.size:
                    length = w.LENGTH.unpack_from(buf)[0]
                    if not w.HEADER_BYTES - w.LENGTH.size <= length <= w.MAX_FRAME_BYTES:
                        self._refuse_framing(conn, length)
                        return False
                    total = w.LENGTH.size + length
                    if have >= total:
                        reply = self.answer(bytes(view[w.LENGTH.size:total]), session, space, later)
                        if reply:
                            conn.sendall(reply)
                        rest = have - total
                        if rest:
                            buf[:rest] = buf[total:have]
                        have = rest
                        if len(later) >= MAX_DEFERRED:
                            _run(later)
                        continue
                    if total > len(buf):            # a frame larger than any so far
                        view.release()
                        buf.extend(bytes(total - len(buf)))
                        view = memoryview(buf)
                flags = 0
                if later:                           # a frame waiting is answered first
                    flags = socket.MSG_DONTWAIT
                try:
                    n = conn.recv_into(view[have:], 0, flags)
                except BlockingIOError:
                    _run(later)                     # nothing waits: now the bookkeeping
                    continue
                if n == 0:
                    return True                     # the client closed its session
                have += n
        except OSError as e:                        # reset, or shut down by the daemon's stop
            log.debug("arena control session %s ended: %s", session[:8], e)
            return True
        finally:
            view.release()
            _run(later)

    def _refuse_framing(self, conn: socket.socket, length: int) -> None:
        self.frames += 1
        self.refused += 1
        log.info("arena control: a frame of %d bytes cannot be framed; closing the session", length)
        error = w.FrameError(f"a control frame of {length} bytes: frames have "
                             f"{w.HEADER_BYTES - w.LENGTH.size} to {w.MAX_FRAME_BYTES} bytes after their length")
        try:
            conn.sendall(w.error_frame(0, error))
        except OSError:
            pass

    def answer(self, frame: bytes, session: str, space: KeySpace, after: list) -> bytes | None:
        """The answer to one frame (its bytes after the length field), or None (NO_REPLY).
        Work the answer does not need is appended to ``after``, to run once it is sent."""
        self.frames += 1
        op, flags, key_bytes, _, seq, count = _BODY.unpack_from(frame)
        payload = memoryview(frame)[_BODY.size:]
        t0 = time.perf_counter()
        name = {w.LOOKUP: "Lookup", w.LEASE: "Lease", w.RELEASE: "Release", w.TOUCH: "Touch",
                w.RESERVE: "Reserve", w.COMMIT: "Commit"}.get(op, "")
        try:
            if op == w.LOOKUP:
                reply = self._lookup(seq, payload, count, key_bytes, space, after)
                if flags & w.NO_REPLY:          # answered from the block table: recorded only
                    reply = None
            elif op == w.TOUCH:
                keys = space.internal_many(w.split_keys(payload, count, key_bytes))
                after.append(lambda: self.manager.leases.note_table_reads(keys))
                reply = None
            elif op == w.LEASE:
                reply = self._lease(seq, flags, payload, count, key_bytes, session, space, after)
            elif op == w.RELEASE:
                reply = self._release(seq, flags, payload, count, space)
            elif op == w.RESERVE:
                reply = self._reserve(seq, flags, payload, count, key_bytes, session, space)
            elif op == w.COMMIT:
                committed, nbytes = commit_blocks(self.manager, space, w.split_keys(payload, count, key_bytes),
                                                  session, bool(flags & w.ABORT))
                reply = w.header(w.COMMIT | w.REPLY, 0, seq, committed, w.COMMIT_ANSWER.size) + \
                    w.COMMIT_ANSWER.pack(nbytes)
            else:
                raise w.FrameError(f"unknown control op {op}")
        except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a crash
            self.refused += 1
            if isinstance(exc, KVStoreError):
                log.info("arena control %s -> %s: %s", name or op, type(exc).__name__, exc)
            else:
                log.exception("arena control %s failed", name or op)
            reply = None if flags & w.NO_REPLY else w.error_frame(seq, exc)
        if name and self.observe is not None:
            seconds = time.perf_counter() - t0
            after.append(lambda: self.observe(name, seconds, space.tenant))
        return reply

    def _lookup(self, seq, payload, count, key_bytes, space: KeySpace, after: list) -> bytes:
        keys = space.internal_many(w.split_keys(payload, count, key_bytes))
        res = self.manager.lookup(keys)
        if self.hints is not None:
            after.append(lambda: self.hints.observe_request(keys))   # reuse statistics
        if self.tally is not None:
            after.append(lambda: self.tally.lookup(space.tenant, len(keys), res.hit_blocks))
        codes = res.tier_codes
        return w.header(w.LOOKUP | w.REPLY, 0, seq, len(codes), len(codes)) + codes

    def _lease(self, seq, flags, payload, count, key_bytes, session: str, space: KeySpace, after: list) -> bytes:
        if len(payload) < w.LEASE_ARGS.size:
            raise w.FrameError(f"a LEASE frame of {len(payload)} payload bytes; at least {w.LEASE_ARGS.size}")
        ttl, max_bytes, n_release = w.LEASE_ARGS.unpack_from(payload)
        release = w.split_ids(payload, n_release, w.LEASE_ARGS.size)
        keys = w.split_keys(payload, count, key_bytes, w.LEASE_ARGS.size + n_release * w.LEASE_ID_BYTES)
        ttl = min(check_ttl(ttl, "ttl_seconds", self.lease_ttl_s, MAX_LEASE_TTL_S), self.lease_ttl_s)
        internal = space.internal_many(keys)
        m = self.manager
        for lease_id in release:            # after the checks: a refused frame changes nothing
            m.release(lease_id, space.tenant)
        grant = m.lease(internal, ttl, space.tenant, prefix=bool(flags & w.PREFIX), max_bytes=max_bytes or None,
                        session=session, defer=after)
        n = len(grant.rows)
        lease_id = bytes.fromhex(grant.lease_id) if grant.lease_id else bytes(w.LEASE_ID_BYTES)
        fixed = w.LEASE_ANSWER.pack(lease_id, grant.ttl_s, grant.resume_at or 0, grant.resume_at is None)
        _, _, tiers, offsets, sizes, _ = zip(*grant.rows) if n else ((),) * 6    # LeasedBlock fields
        arrays = struct.pack(f"<{2 * n}Q", *offsets, *sizes)
        codes = bytes([t or 0 for t in tiers])      # a miss has no tier
        return w.header(w.LEASE | w.REPLY, 0, seq, n, len(fixed) + len(arrays) + n) + fixed + arrays + codes

    def _reserve(self, seq, flags, payload, count, key_bytes, session: str, space: KeySpace) -> bytes:
        ttl, sizes, keys, raw_metas = w.split_reserve(payload, count, key_bytes, flags)
        metas = [check_meta(decode_meta(m)) for m in raw_metas] if raw_metas is not None else None
        ttl = min(check_ttl(ttl, "ttl_seconds", self.lease_ttl_s, MAX_LEASE_TTL_S), self.lease_ttl_s)
        offsets, statuses, detail = reserve_blocks(self.manager, space, keys, sizes, metas, ttl, session)
        n = len(offsets)
        body = struct.pack(f"<{n}Q", *offsets) + bytes(statuses) + detail.encode("utf-8", "replace")[:4096]
        return w.header(w.RESERVE | w.REPLY, 0, seq, n, len(body)) + body

    def _release(self, seq, flags, payload, count, space: KeySpace) -> bytes | None:
        if len(payload) != count * w.LEASE_ID_BYTES:
            raise w.FrameError(f"a RELEASE frame says {count} lease ids but carries {len(payload)} bytes")
        released = sum(self.manager.release(i, space.tenant) for i in w.split_ids(payload, count))
        if flags & w.NO_REPLY:
            return None
        return w.header(w.RELEASE | w.REPLY, 0, seq, released, 0)
