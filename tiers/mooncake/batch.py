"""Batched calls of the Mooncake remote tier (:class:`tiers.mooncake.MooncakeTier`).

On a local miss the daemon asks the cluster for many blocks at once; each batch here
is as few library calls as the staging buffer allows (one ``batch_get_into`` or
``batch_put_from`` per staging-full of blocks), each bounded by the tier's deadline.
Existence is one ``batch_is_exist`` and block sizes one ``batch_get_replica_desc`` call.
(Removals run in the background, batched: :mod:`tiers.mooncake.remover`.)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from tiers.buffers import byte_view
from tiers.errors import BlockCorrupt, InvalidAccess, MediaIOError, NoRoom
from tiers.mooncake.client import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    all_master_down,
    any_error,
    code_name,
)
from tiers.mooncake.context import RemoteContext
from tiers.mooncake.guard import RemoteTimeout
from tiers.mooncake.object_format import HEADER_BYTES, check_key, encode_into, object_bytes, verify
from tiers.mooncake.staging import Lease, StagingArena, StagingBusy

log = logging.getLogger("kvstore.tiers.remote")


def _groups(staging: StagingArena, sizes: Sequence[int], wait_s: float) -> Iterator[list[tuple[int, Lease]]]:
    """Lease staging pieces for ``sizes`` in order, yielding ``(position, lease)`` groups
    that fit the buffer together. The caller releases a group before asking for the next.
    The first piece of a group waits up to ``wait_s`` for room (StagingBusy after)."""
    pos = 0
    while pos < len(sizes):
        group = [(pos, staging.lease(sizes[pos], wait_s=wait_s))]
        pos += 1
        while pos < len(sizes):
            try:
                group.append((pos, staging.lease(sizes[pos])))
            except StagingBusy:
                break
            pos += 1
        yield group


class BatchCalls:
    """The :class:`tiers.base.RemoteStore` batch calls, over the tier's :class:`RemoteContext`
    and ``max_block_bytes`` (the largest payload a put may carry, bytes)."""

    def __init__(self, ctx: RemoteContext, max_block_bytes: int):
        self._ctx = ctx
        self._max_block_bytes = max_block_bytes

    def exists_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        """For each key, whether the cluster holds its block now (one ``batch_is_exist``,
        waited on ``deadline_s`` seconds at most, default ``timeout_s``). Keys this node
        put and the cluster lost are forgotten. Raises MediaIOError, InvalidAccess."""
        ctx = self._ctx
        names = [ctx.object_name(k) for k in keys]
        if not names:
            return []
        rcs = ctx.guard.call(ctx.session().batch_is_exist, names, deadline_s=deadline_s, judge=any_error)
        found = [rc == 1 for rc in rcs]
        for key, hit in zip(keys, found):
            if not hit and ctx.ledger.size(key) is not None:
                ctx.ledger.forget(key)
        return found

    def sizes_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[int | None]:
        """Payload bytes of each block the cluster holds (None: absent, or an object too
        short to be a block), from one ``batch_get_replica_desc`` call. The library may
        answer from its metadata cache, so a size is a hint: the get that follows
        verifies. Raises MediaIOError (unreachable, deadline, breaker open), InvalidAccess."""
        ctx = self._ctx
        names = [ctx.object_name(k) for k in keys]
        if not names:
            return []
        descs = ctx.guard.call(ctx.session().batch_get_replica_desc, names, deadline_s=deadline_s)
        out: list[int | None] = []
        for name in names:
            size = None
            for replica in descs.get(name, ()):
                if replica.is_memory_replica() and replica.status.name == "COMPLETE":
                    size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            out.append(size - HEADER_BYTES if size is not None and size >= HEADER_BYTES else None)
        return out

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Fetch and verify blocks into ``outs``; per key the payload bytes or None (a miss:
        absent, corrupt (then removed from the cluster), larger than its out, or a peer that
        did not serve it). Raises MediaIOError (master unreachable, deadline, breaker open,
        staging busy), InvalidAccess (lengths differ, a bad key, a read-only out)."""
        ctx = self._ctx
        if len(keys) != len(outs):
            raise InvalidAccess(f"{len(keys)} keys but {len(outs)} output buffers")
        names = [ctx.object_name(k) for k in keys]
        views = [byte_view(out, writable=True) for out in outs]
        results: list[int | None] = [None] * len(keys)
        if not keys:
            return results
        store = ctx.session()
        cap = ctx.staging.nbytes
        sizes = [min(object_bytes(v.nbytes), cap) for v in views]
        corrupt: list[bytes] = []
        for group in _groups(ctx.staging, sizes, ctx.config.timeout_s):
            idx = [i for i, _ in group]
            leases = [lease for _, lease in group]
            rcs = self._call(store.batch_get_into, [names[i] for i in idx], [lease.address for lease in leases],
                             [sizes[i] for i in idx], nbytes=sum(sizes[i] for i in idx), leases=leases)
            try:
                for i, lease, rc in zip(idx, leases, rcs):
                    results[i] = self._take(keys[i], lease, rc, views[i], corrupt)
            finally:
                for lease in leases:
                    lease.release()
        if corrupt:
            self._drop(store, corrupt)
        return results

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """Store blocks in the cluster; per item True when the cluster holds it afterwards.
        Raises NoRoom (beyond this node's capacity, or a block larger than the largest),
        MediaIOError (master unreachable, deadline, breaker open), InvalidAccess (a bad key)."""
        ctx = self._ctx
        keys = [key for key, _ in items]
        for key in keys:
            check_key(key)
        views = [byte_view(data) for _, data in items]
        results = [False] * len(items)
        first: dict[bytes, int] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            if ctx.ledger.size(key) is not None:
                results[i] = True
            elif key not in first:
                first[key] = i
                todo.append(i)
        sizes = {i: object_bytes(views[i].nbytes) for i in todo}
        too_big = [i for i in todo if views[i].nbytes > self._max_block_bytes]
        if too_big:
            raise NoRoom(f"{ctx.name}: a {views[too_big[0]].nbytes}-byte block exceeds the largest remote block "
                         f"({self._max_block_bytes} bytes)")
        total = sum(sizes.values())
        if todo:
            store = ctx.session()
            ctx.guard.check()
        ctx.ledger.charge(total)
        outstanding = set(todo)                       # indices whose bytes are counted but not confirmed
        try:
            for group in _groups(ctx.staging, [sizes[i] for i in todo], ctx.config.timeout_s):
                idx = [todo[pos] for pos, _ in group]
                leases = [lease for _, lease in group]
                for i, lease in zip(idx, leases):
                    encode_into(lease.view, keys[i], views[i])
                rcs = self._call(store.batch_put_from, [ctx.object_name(keys[i]) for i in idx],
                                 [lease.address for lease in leases], [sizes[i] for i in idx], ctx.replicate,
                                 nbytes=sum(sizes[i] for i in idx), leases=leases)
                for lease in leases:
                    lease.release()
                outcomes = []
                for i, rc in zip(idx, rcs):
                    ok = rc in (0, OBJECT_ALREADY_EXISTS)
                    results[i] = ok
                    outstanding.discard(i)
                    outcomes.append((keys[i], views[i].nbytes, ok))
                ctx.ledger.settle(outcomes)
                failed = [rc for rc in rcs if rc not in (0, OBJECT_ALREADY_EXISTS)]
                if failed:
                    log.info("%s: %d of %d remote puts failed (first: %s)", ctx.name, len(failed), len(rcs),
                             code_name(failed[0]))
        finally:
            if outstanding:
                ctx.ledger.refund(sum(sizes[i] for i in outstanding))
        for i, key in enumerate(keys):
            if first.get(key, i) != i:
                results[i] = results[first[key]]
        return results

    # ------------------------------------------------------------------ helpers

    def _call(self, fn: Callable[..., list[int]], *args: Any, nbytes: int, leases: list[Lease]) -> list[int]:
        """One batch call on ``leases``: released here on failure, by the guard when the call
        is abandoned at its deadline, by the caller after a success."""
        def release_all() -> None:
            for lease in leases:
                lease.release()

        try:
            return self._ctx.guard.call(fn, *args, deadline_s=self._ctx.config.deadline_s(nbytes),
                                        judge=all_master_down, on_abandon=release_all)
        except RemoteTimeout:
            raise
        except BaseException:
            release_all()
            raise

    def _take(self, key: bytes, lease: Lease, rc: int, out: memoryview, corrupt: list[bytes]) -> int | None:
        """Copy one fetched block out after verifying it; None for a miss (counted)."""
        ctx = self._ctx
        if rc >= 0:
            try:
                payload = verify(lease.view[:rc], key)
            except BlockCorrupt as exc:
                ctx.faults.corrupt += 1
                log.warning("%s: %s; dropping that copy", ctx.name, exc)
                corrupt.append(key)
                return None
            out[:payload.nbytes] = payload
            return payload.nbytes
        stored = ctx.ledger.size(key)
        if rc == OBJECT_NOT_FOUND:
            ctx.ledger.forget(key)
        elif rc == INVALID_PARAMS and stored is not None and stored <= out.nbytes:
            ctx.faults.corrupt += 1                  # longer than the block this node stored
            log.warning("%s: remote block %s is longer than stored; dropping that copy", ctx.name, key.hex()[:16])
            corrupt.append(key)
        elif rc == INVALID_PARAMS:
            ctx.faults.oversize += 1
            log.warning("%s: remote block %s is larger than its %d-byte buffer", ctx.name, key.hex()[:16],
                        out.nbytes)
        else:
            ctx.faults.peer_errors += 1
            log.info("%s: remote block %s not served: %s", ctx.name, key.hex()[:16], code_name(rc))
        return None

    def _drop(self, store: Any, keys: list[bytes]) -> None:
        """Remove corrupt copies from the cluster so no node reads them again (best effort)."""
        ctx = self._ctx
        for key in keys:
            ctx.ledger.forget(key)
        try:
            ctx.guard.call(store.batch_remove, [ctx.object_name(k) for k in keys], True, judge=all_master_down)
        except MediaIOError as exc:
            log.warning("%s: could not remove %d corrupt remote copies: %s", ctx.name, len(keys), exc)


__all__ = ["BatchCalls"]
