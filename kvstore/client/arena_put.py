"""``put_from`` through the shared host arena: Reserve, one copy in, Commit.

Blocks are reserved in batches of at most a quarter of the arena; the client copies each
reserved block into its room and commits the batch. What the arena cannot take now (no
room, a key another client is writing, a reservation too old to write, a batch whose
Commit was refused) goes by the raw gRPC path. A reservation belongs to the client's
session; a client whose mapping has no session (the daemon's sessions were full, an old
hello) puts by gRPC. A batch that fails between Reserve and Commit (an error, a timeout,
Ctrl-C) is aborted before the error goes on, so its room and keys are free at once
instead of when the daemon gives up on them.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.raw import block_meta_message
from kvstore.common.types import PutResult, ReserveStatus

log = logging.getLogger("kvstore.client")

ABORT_TIMEOUT_S = 2.0
"""Deadline of the best-effort abort of a batch whose put failed (seconds)."""

SAFE_FRACTION = 0.5
"""A lease or reservation is used only within this fraction of its TTL from when its request
was sent: a copy out of a lease that ended later is thrown away (the blocks go by gRPC), a
block whose reservation is that old is not written (aborted, put by gRPC)."""


class ArenaPut:
    """The zero-copy put of a client (see the module docstring).

    Args:
        call: ``call(method, request, timeout, arena)``, a gRPC call naming the mapping's
            arena and session (:meth:`kvstore.client.arena.ArenaPath.call`).
        reserve, commit: the stub's ``Reserve`` and ``Commit``.
        raw_put: the raw gRPC path's put (:meth:`kvstore.client.raw.RawPath.put`).
        per_request: most keys one request may list (:meth:`kvstore.client.connection.Connection.per_request`).
    """

    def __init__(self, call: Callable, reserve: Callable, commit: Callable, raw_put: Callable,
                 per_request: Callable[..., int]):
        self.call, self.reserve, self.commit = call, reserve, commit
        self.raw_put, self.per_request = raw_put, per_request

    def put_from(self, arena, keys, bufs, lengths, meta, timeout, *, ttl: float, clock: Callable[[], float],
                 copy: Callable, changed: type) -> PutResult:
        """Store ``keys`` through ``arena`` (an ``ArenaMapping``): block ``i`` is
        ``bufs.slot(i, lengths[i])``, ``meta[i]`` its router metadata (or ``meta`` None); ``ttl``
        the reservations' TTL asked (s), ``clock`` monotonic seconds, ``copy(dst, src)`` the
        copy into the arena, ``changed`` the error of a restarted daemon's arena. Raises
        SizeConflict (``.result``: what was stored), and what the raw path's put raises."""
        if not arena.session:                  # no session, no reservation: the daemon refuses one
            return self._raw_put(range(len(keys)), keys, bufs, lengths, meta, timeout, PutResult(0, 0, 0), "")
        budget = max(arena.size // 4, 1)
        reserved_total = stored = nbytes = present = refused = conflicts = 0
        rest, batch, detail = [], [], ""            # block indices: to put by gRPC, in this Reserve
        per = self.per_request(per_key=34 + 11)    # a key and its size
        for i in range(len(keys) + 1):
            if i < len(keys) and (not batch or reserved_total + lengths[i] <= budget and len(batch) < per):
                batch.append(i)
                reserved_total += lengths[i]
                continue
            metas = [block_meta_message(meta[j]) for j in batch] if meta is not None else []
            before = (present, refused, conflicts, len(rest))
            sent = clock()
            reserved: list[int] = []
            try:
                reply = self.call(self.reserve, pb.ReserveRequest(
                    keys=[keys[j] for j in batch], sizes=[lengths[j] for j in batch], ttl_seconds=ttl,
                    meta=metas), timeout, arena)
                reserved = [j for j, status in zip(batch, reply.status) if status == ReserveStatus.RESERVED]
                late, written = [], []
                for j, status, offset in zip(batch, reply.status, reply.offsets):
                    if status == ReserveStatus.RESERVED:
                        if clock() - sent > min(ttl, arena.max_ttl_s) * SAFE_FRACTION:
                            late.append(j)          # too close to its expiry: never write it
                            continue
                        copy(arena.array[offset:offset + lengths[j]], bufs.slot(j, lengths[j]))
                        written.append(j)
                    elif status == ReserveStatus.ALREADY_PRESENT:
                        present += 1
                    elif status == ReserveStatus.NOT_ADMITTED:
                        refused += 1
                    elif status == ReserveStatus.SIZE_CONFLICT:
                        conflicts += 1
                    else:                           # NO_ROOM, BUSY: the gRPC put decides (and waits)
                        rest.append(j)
                if written:
                    try:
                        done = self.call(self.commit, pb.CommitRequest(keys=[keys[j] for j in written]),
                                         timeout, arena)
                        stored, nbytes = stored + done.committed, nbytes + done.bytes_committed
                    except errors.BlockNotFound as e:   # a reservation ended: none stored, all by gRPC
                        log.warning("zero-copy commit refused (%s); putting %d blocks by gRPC", e, len(written))
                        rest.extend(written)
                if late:
                    log.warning("%d reservations of the shared arena were too old to write (the client "
                                "stalled); putting those blocks by gRPC", len(late))
                    self.call(self.commit, pb.CommitRequest(keys=[keys[j] for j in late], abort=True),
                              timeout, arena)
                    rest.extend(late)
            except changed:                     # the daemon restarted: this batch and the rest by gRPC
                present, refused, conflicts, n_rest = before
                del rest[n_rest:]
                rest.extend(range(batch[0], len(keys)))
                break
            except BaseException:
                self._abort(arena, [keys[j] for j in reserved])
                raise
            detail = detail or reply.detail
            if i == len(keys):
                break
            batch, reserved_total = [i], lengths[i]
        return self._raw_put(rest, keys, bufs, lengths, meta, timeout,
                             PutResult(stored, present, nbytes, refused, conflicts), detail)

    def _abort(self, arena, keys: list[bytes]) -> None:
        """Best effort: abort the reservations of ``keys`` (those committed or ended are
        skipped by the daemon). Never raises."""
        if not keys:
            return
        try:
            self.call(self.commit, pb.CommitRequest(keys=keys, abort=True), ABORT_TIMEOUT_S, arena)
        except Exception as e:  # noqa: BLE001 - the put's own error is the one raised
            log.info("could not abort %d reservations of a failed put (%s); the daemon reclaims them", len(keys), e)


    def _raw_put(self, rest, keys, bufs, lengths, meta, timeout, result: PutResult, detail: str) -> PutResult:
        """``result`` plus the blocks ``rest`` put by gRPC; raises SizeConflict when any
        block is stored with another size."""
        rest = list(rest)
        if rest:
            more = self.raw_put([(keys[i], bufs.slot(i, lengths[i])) for i in rest], timeout,
                              meta=[meta[i] for i in rest] if meta is not None else None)
            result = PutResult(result.stored + more.stored, result.already_present + more.already_present,
                               result.bytes_stored + more.bytes_stored, result.not_admitted + more.not_admitted,
                               result.size_conflicts + more.size_conflicts)
        if result.size_conflicts:
            err = errors.SizeConflict(detail or f"{result.size_conflicts} blocks are stored with another size")
            err.result = result
            raise err
        return result


__all__ = ["ABORT_TIMEOUT_S", "ArenaPut"]
