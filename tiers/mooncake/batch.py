"""Batched calls of the Mooncake remote tier (:class:`tiers.mooncake.MooncakeTier`).

On a local miss the daemon asks the cluster for many blocks at once; each batch here
is as few library calls as the staging buffer allows (one ``batch_get_into`` or
``batch_put_from`` per staging-full of blocks), each bounded by the tier's deadline.
Block sizes come from one ``batch_get_replica_desc`` call (:func:`sizes_many`), and
removals run in the background, batched (:class:`Remover`), so that freeing a block
never waits on the network.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from tiers.base import byte_view
from tiers.errors import BlockCorrupt, InvalidAccess, NoRoom, MediaIOError
from tiers.mooncake.client import (
    INVALID_PARAMS,
    MASTER_DOWN,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    code_name,
)
from tiers.mooncake.object_format import HEADER_BYTES, check_key, encode_into, object_bytes, verify
from tiers.mooncake.guard import RemoteTimeout
from tiers.mooncake.staging import Lease, StagingArena, StagingBusy

if TYPE_CHECKING:
    from tiers.mooncake.tier import MooncakeTier

log = logging.getLogger("kvstore.tiers.remote")


def _all_master_down(rcs: list[int]) -> str | None:
    return f"master unreachable: {code_name(rcs[0])}" if rcs and all(rc in MASTER_DOWN for rc in rcs) else None


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


def _batch_call(tier: "MooncakeTier", fn: Callable[..., list[int]], *args: Any, nbytes: int,
                leases: list[Lease]) -> list[int]:
    """One batch call on ``leases``: released here on failure, by the guard when the call
    is abandoned at its deadline, by the caller after a success."""
    def release_all() -> None:
        for lease in leases:
            lease.release()

    try:
        return tier._guard.call(fn, *args, deadline_s=tier.config.deadline_s(nbytes), judge=_all_master_down,
                                on_abandon=release_all)
    except RemoteTimeout:
        raise
    except BaseException:
        release_all()
        raise


def get_many_into(tier: "MooncakeTier", keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
    """Fetch and verify blocks into ``outs``; per key the payload bytes or None (a miss:
    absent, corrupt (then removed from the cluster), larger than its out, or a peer that
    did not serve it). Raises MediaIOError (master unreachable, deadline, breaker open,
    staging busy), InvalidAccess (lengths differ, a bad key, a read-only out)."""
    if len(keys) != len(outs):
        raise InvalidAccess(f"{len(keys)} keys but {len(outs)} output buffers")
    names = [tier._name(k) for k in keys]
    views = [byte_view(out, writable=True) for out in outs]
    results: list[int | None] = [None] * len(keys)
    if not keys:
        return results
    store = tier._session()
    cap = tier._staging.nbytes
    sizes = [min(object_bytes(v.nbytes), cap) for v in views]
    corrupt: list[bytes] = []
    for group in _groups(tier._staging, sizes, tier.config.timeout_s):
        idx = [i for i, _ in group]
        leases = [lease for _, lease in group]
        rcs = _batch_call(tier, store.batch_get_into, [names[i] for i in idx], [lease.address for lease in leases],
                          [sizes[i] for i in idx], nbytes=sum(sizes[i] for i in idx), leases=leases)
        try:
            for i, lease, rc in zip(idx, leases, rcs):
                results[i] = _take(tier, keys[i], lease, rc, views[i], corrupt)
        finally:
            for lease in leases:
                lease.release()
    if corrupt:
        _drop(tier, store, corrupt)
    return results


def _take(tier: "MooncakeTier", key: bytes, lease: Lease, rc: int, out: memoryview,
          corrupt: list[bytes]) -> int | None:
    if rc >= 0:
        try:
            payload = verify(lease.view[:rc], key)
        except BlockCorrupt as exc:
            tier._corrupt += 1
            log.warning("%s: %s; dropping that copy", tier.name, exc)
            corrupt.append(key)
            return None
        out[:payload.nbytes] = payload
        return payload.nbytes
    if rc == OBJECT_NOT_FOUND:
        tier._forget(key)
    elif rc == INVALID_PARAMS and tier._own.get(key, out.nbytes + 1) <= out.nbytes:
        tier._corrupt += 1                       # longer than the block this node stored
        log.warning("%s: remote block %s is longer than stored; dropping that copy", tier.name, key.hex()[:16])
        corrupt.append(key)
    elif rc == INVALID_PARAMS:
        tier._oversize += 1
        log.warning("%s: remote block %s is larger than its %d-byte buffer", tier.name, key.hex()[:16], out.nbytes)
    else:
        tier._peer_errors += 1
        log.info("%s: remote block %s not served: %s", tier.name, key.hex()[:16], code_name(rc))
    return None


def _drop(tier: "MooncakeTier", store: Any, keys: list[bytes]) -> None:
    """Remove corrupt copies from the cluster so no node reads them again (best effort)."""
    for key in keys:
        tier._forget(key)
    try:
        tier._guard.call(store.batch_remove, [tier._name(k) for k in keys], True, judge=_all_master_down)
    except MediaIOError as exc:
        log.warning("%s: could not remove %d corrupt remote copies: %s", tier.name, len(keys), exc)


def put_many(tier: "MooncakeTier", items: Sequence[tuple[bytes, Any]]) -> list[bool]:
    """Store blocks in the cluster; per item True when the cluster holds it afterwards.
    Raises NoRoom (beyond this node's capacity, or a block larger than the largest),
    MediaIOError (master unreachable, deadline, breaker open), InvalidAccess (a bad key)."""
    keys = [key for key, _ in items]
    for key in keys:
        check_key(key)
    views = [byte_view(data) for _, data in items]
    results = [False] * len(items)
    first: dict[bytes, int] = {}
    todo: list[int] = []
    for i, key in enumerate(keys):
        if key in tier._own:
            results[i] = True
        elif key not in first:
            first[key] = i
            todo.append(i)
    sizes = {i: object_bytes(views[i].nbytes) for i in todo}
    too_big = [i for i in todo if views[i].nbytes > tier.max_block_bytes]
    if too_big:
        raise NoRoom(f"{tier.name}: a {views[too_big[0]].nbytes}-byte block exceeds the largest remote block "
                       f"({tier.max_block_bytes} bytes)")
    total = sum(sizes.values())
    if todo:
        store = tier._session()
        tier._guard.check()
    with tier._lock:
        if tier._used + total > tier.capacity_bytes:
            raise NoRoom(f"{tier.name}: {total} bytes do not fit ({tier._used}/{tier.capacity_bytes} used)")
        tier._used += total
    outstanding = set(todo)                       # indices whose bytes are counted but not confirmed
    try:
        for group in _groups(tier._staging, [sizes[i] for i in todo], tier.config.timeout_s):
            idx = [todo[pos] for pos, _ in group]
            leases = [lease for _, lease in group]
            for i, lease in zip(idx, leases):
                encode_into(lease.view, keys[i], views[i])
            rcs = _batch_call(tier, store.batch_put_from, [tier._name(keys[i]) for i in idx],
                              [lease.address for lease in leases], [sizes[i] for i in idx], tier._replicate,
                              nbytes=sum(sizes[i] for i in idx), leases=leases)
            for lease in leases:
                lease.release()
            with tier._lock:
                for i, rc in zip(idx, rcs):
                    ok = rc in (0, OBJECT_ALREADY_EXISTS)
                    results[i] = ok
                    outstanding.discard(i)
                    if ok:
                        tier._own[keys[i]] = views[i].nbytes
                    else:
                        tier._used -= sizes[i]
            failed = [rc for rc in rcs if rc not in (0, OBJECT_ALREADY_EXISTS)]
            if failed:
                log.info("%s: %d of %d remote puts failed (first: %s)", tier.name, len(failed), len(rcs),
                         code_name(failed[0]))
    finally:
        if outstanding:
            with tier._lock:
                tier._used -= sum(sizes[i] for i in outstanding)
    for i, key in enumerate(keys):
        if first.get(key, i) != i:
            results[i] = results[first[key]]
    return results


def sizes_many(tier: "MooncakeTier", keys: Sequence[bytes], deadline_s: float | None = None) -> list[int | None]:
    """Payload bytes of each block the cluster holds (None: absent, or an object too
    short to be a block), from one ``batch_get_replica_desc`` call. The library may
    answer from its metadata cache, so a size is a hint: the get that follows
    verifies. Raises MediaIOError (unreachable, deadline, breaker open), InvalidAccess."""
    names = [tier._name(k) for k in keys]
    if not names:
        return []
    descs = tier._guard.call(tier._session().batch_get_replica_desc, names, deadline_s=deadline_s)
    out: list[int | None] = []
    for name in names:
        size = None
        for replica in descs.get(name, ()):
            if replica.is_memory_replica() and replica.status.name == "COMPLETE":
                size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                break
        out.append(size - HEADER_BYTES if size is not None and size >= HEADER_BYTES else None)
    return out


class Remover:
    """Removes objects from the cluster on a background thread, up to ``batch`` names
    per forced ``batch_remove``, so a caller holding a lock never waits on the network.
    A removal that fails (cluster unreachable) is dropped: the object is then gone
    with the master anyway, or left to the cluster's own eviction (its bytes stay
    valid under its key). ``failed`` counts names not removed."""

    def __init__(self, tier: "MooncakeTier", batch: int = 256):
        self._tier = tier
        self._batch = batch
        self._names: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"{tier.name}-remove", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        with self._cond:
            if not self._stopped:
                self._names.append(name)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._names and not self._stopped:
                    self._cond.wait()
                if self._stopped and not self._names:
                    return
                names = [self._names.popleft() for _ in range(min(self._batch, len(self._names)))]
                self._busy = True
            try:
                store = self._tier._session()
                self._tier._guard.call(store.batch_remove, names, True, judge=_all_master_down)
            except MediaIOError as exc:
                self.failed += len(names)
                log.info("%s: %d remote removals dropped: %s", self._tier.name, len(names), exc)
            except Exception:                          # never let the thread die
                self.failed += len(names)
                log.exception("%s: remote removal failed", self._tier.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until every submitted removal was tried."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._names and not self._busy, timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Try what is queued (up to ``timeout_s`` seconds), then end the thread."""
        self.wait_idle(timeout_s)
        with self._cond:
            self._stopped = True
            self._names.clear()
            self._cond.notify_all()


__all__ = ["Remover", "get_many_into", "put_many", "sizes_many"]
