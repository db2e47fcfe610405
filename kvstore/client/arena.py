"""The client's same-node data path: blocks copied through the daemon's shared host arena.

:class:`ArenaPathMixin` is mixed into :class:`kvstore.client.KVStoreClient`. It owns
mapping the arena (:class:`kvstore.client.arena_mapping.ArenaMapping`, on first use), ``put_from``
through it (Reserve, one copy into the arena, Commit), ``get_into``'s copies out of it
under a lease, and the background release of those leases (:class:`_Releaser`). It
uses the client's ``_call``, ``_stub``, ``_metadata``, ``_per_request``, ``info``,
``put``, ``target``, ``timeout``, ``lease_ttl_s`` and ``_token``; blocks it cannot move
(arena full or busy) go back to the client's gRPC path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import grpc

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.raw import _meta_message
from kvstore.common.status import error_for
from kvstore.common.types import PutResult, ReserveStatus

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.client.client import KVStoreClient

log = logging.getLogger("kvstore.client")

SAFE_FRACTION = 0.5
"""A lease or reservation is used only within this fraction of its TTL, counted from when
its request was sent (the daemon's TTL starts later): a copy out of a lease that finished
later is thrown away and the blocks go by gRPC; a block whose reservation is that old is
not written (aborted, then put by gRPC). Never reads or writes space that may be reused."""

_clock = time.monotonic


class ArenaChanged(errors.FeatureDisabled):
    """The daemon serves another shared arena than the one this client mapped (it
    restarted): the mapping was dropped; the next call maps the new arena."""


class ArenaPathMixin:
    """Blocks through the shared arena (unix-socket clients of a daemon that offers one)."""

    def _arena_call(self, method, request, timeout: float | None, arena):
        """A Lease, Reserve or Commit naming the arena ``arena`` the client maps. Raises
        :class:`ArenaChanged` (and forgets the mapping) when the daemon serves another
        arena: it restarted since, and the old mapping must not be read or written."""
        from kvstore.common.arena import ARENA_CHANGED, ARENA_HEADER
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



    def _open_arena_path(self, shared_memory: bool | None) -> None:
        self._want_shm = shared_memory
        self._arena = None
        self._arena_checked = False
        self._releaser = _Releaser(self)

    def _close_arena_path(self) -> None:
        self._releaser.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

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
        from kvstore.client.arena_mapping import ArenaMapping
        try:
            self._arena = ArenaMapping(info.shm_socket, self._token, timeout=self.timeout)
        except OSError as e:
            if self._want_shm:
                raise errors.FeatureDisabled(f"cannot map the shared arena: {e}") from None
            log.info("shared arena unavailable (%s); using gRPC for block data", e)
        return self._arena

    def _arena_put(self, arena, keys, bufs, lengths, meta, timeout) -> PutResult:
        """``put_from`` through the arena: Reserve in batches of at most a quarter of it,
        copy each reserved block in, Commit; blocks with no room now go by gRPC."""
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
            sent = _clock()
            try:
                reply = self._arena_call(self._stub.Reserve, pb.ReserveRequest(
                    keys=[keys[j] for j in batch], sizes=[lengths[j] for j in batch], ttl_seconds=self.lease_ttl_s,
                    meta=metas), timeout, arena)
                written, late = [], []
                for j, status, offset in zip(batch, reply.status, reply.offsets):
                    if status == ReserveStatus.RESERVED:
                        if _clock() - sent > self.lease_ttl_s * SAFE_FRACTION:
                            late.append(j)      # too close to its expiry: never write it
                            continue
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
                if late:
                    log.warning("%d reservations of the shared arena were too old to write (the client "
                                "stalled); putting those blocks by gRPC", len(late))
                    self._arena_call(self._stub.Commit, pb.CommitRequest(keys=[keys[j] for j in late], abort=True),
                                     timeout, arena)
                    rest.extend(late)
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
                sent = _clock()
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
                if _clock() - sent > self.lease_ttl_s * SAFE_FRACTION:
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
                self._release(lease_id)

    def _release(self, lease_id: str) -> None:
        """End a lease without waiting: it rides on the next Lease call, or a background
        thread sends it (its TTL ends it anyway)."""
        self._releaser.add(lease_id)


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
