"""The remote tier: blocks as objects in a Mooncake Store cluster shared by many nodes.

Each block is one cluster object named ``prefix + key.hex()``, holding a 64-byte header
(magic, key, size, xxh3_64; :mod:`tiers.remote_format`) and the payload. Every read
fetches the whole object into the staging buffer and verifies it before a byte is
copied out, so a wrong, truncated or foreign copy raises BlockCorrupt (or is a miss in
a batch), never wrong KV.

What this node tracks (``in``, ``len``, ``used_bytes`` against ``capacity_bytes``) is the
blocks *it* put. The cluster may drop them without telling us (its own eviction, a
peer or the master restarting); a read or :meth:`MooncakeTier.exists_many` that finds one
gone forgets it. :meth:`MooncakeTier.read_into`, :meth:`~MooncakeTier.size_of`,
:meth:`~MooncakeTier.free` and the batch calls work on any block in the cluster,
whichever node put it.

Failures cost only remote hits: every library call runs on a worker thread with a
deadline (``timeout_s`` plus ``nbytes / min_throughput``) behind a circuit breaker
(:mod:`tiers.remote_guard`), and the session with the master is made in the background,
so a master that is down at start, dies, stalls or is partitioned gives TierIOError
quickly, never a hang or a crash. Measured behaviour: ``docs/remote_tier.md``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import xxhash

from .base import ByteRanges, Capabilities, Tier, TierKind, byte_view, check_chunk, check_ranges, output_view
from .errors import BlockCorrupt, BlockExists, BlockNotStored, InvalidAccess, TierFull, TierIOError
from .mooncake_batch import get_many_into, put_many
from .mooncake_client import (INVALID_PARAMS, MASTER_DOWN, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, Connector,
                              MooncakeConfig, code_name, replicate_config, store_class)
from .remote_format import HEADER_BYTES, check_key, object_bytes, object_name, pack_header, verify
from .remote_guard import CallGuard, RemoteHealth, RemoteState, RemoteTimeout
from .staging import Lease, StagingArena

log = logging.getLogger("kvstore.tiers.remote")
_KEPT: list = []            # sessions not closed because a library call may still use them


class _Pending:
    __slots__ = ("lease", "nbytes", "written", "hasher")

    def __init__(self, lease: Lease, nbytes: int):
        self.lease = lease
        self.nbytes = nbytes
        self.written = 0
        self.hasher = xxhash.xxh3_64()


def _master_down(rc: int) -> str | None:
    return f"master unreachable: {code_name(rc)}" if rc in MASTER_DOWN else None


def _any_error(rcs: list[int]) -> str | None:
    bad = [rc for rc in rcs if rc < 0]
    return f"existence check failed: {code_name(bad[0])}" if bad else None


class MooncakeTier(Tier):
    """A :class:`tiers.base.Tier` and :class:`tiers.base.RemoteStore` over Mooncake Store.

    Args:
        config: connection, capacity, staging and deadline settings.
        name: the tier's name in logs and stats.
        wait_connected_s: block up to this many seconds for the first session (the
            tier is usable without it: calls raise TierIOError until it connects).

    Raises:
        MooncakeUnavailable: the Mooncake wheel or libibverbs1 is missing.
        ValueError: bad settings.
    """

    kind = TierKind.REMOTE
    volatile = False

    def __init__(self, config: MooncakeConfig, name: str = "remote", *, wait_connected_s: float = 0.0):
        store_class()
        self.config = config
        self.name = name
        self._prefix = config.prefix
        self._staging = StagingArena(config.staging_bytes)
        self._guard = CallGuard(f"{name}(mooncake {config.master})", timeout_s=config.timeout_s,
                                failure_threshold=config.failure_threshold, cooldown_s=config.cooldown_s,
                                max_in_flight=config.max_in_flight)
        self._replicate = replicate_config(config)
        self._lock = threading.Lock()
        self._own: dict[bytes, int] = {}            # key -> payload bytes, blocks this node put
        self._pending: dict[bytes, _Pending] = {}
        self._used = 0                              # object bytes of _own and _pending
        self._corrupt = self._peer_errors = self._oversize = 0
        self._conn = Connector(config, self._staging.address, self._staging.nbytes, name,
                               on_connect=self._guard.reset)
        if wait_connected_s > 0:
            self.wait_connected(wait_connected_s)

    # ------------------------------------------------------------------ session

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the session; True once connected."""
        return self._conn.connected.wait(timeout_s)

    def _session(self) -> Any:
        return self._conn.require()

    def _name(self, key: bytes) -> str:
        return object_name(self._prefix, key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            n = self._own.pop(key, None)
            if n is not None:
                self._used -= object_bytes(n)

    # ------------------------------------------------------------------ accounting

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(remote=self)

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def max_block_bytes(self) -> int:
        """Largest payload: what fits in the staging buffer with its header (bytes)."""
        return min(self._staging.nbytes, self.config.capacity_bytes) - HEADER_BYTES

    def __contains__(self, key: bytes) -> bool:
        """True when this node put ``key`` and has not seen it gone (no network call)."""
        with self._lock:
            return key in self._own

    def __len__(self) -> int:
        return len(self._own)

    def fits(self, nbytes: int) -> bool:
        obj = object_bytes(nbytes)
        if self._conn.store is None or self._guard.breaker == "open":
            return False
        return self._used + obj <= self.config.capacity_bytes and self._staging.can_lease(obj)

    # ------------------------------------------------------------------ two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        """Reserve room for a block; its bytes are staged in host memory until commit.

        Raises TierFull (beyond capacity or :attr:`max_block_bytes`), BlockExists,
        TierIOError (not connected, breaker open, or the staging buffer full now).
        """
        check_key(key)
        if nbytes < 0:
            raise InvalidAccess(f"block size must be >= 0 bytes, got {nbytes}")
        if nbytes > self.max_block_bytes:
            raise TierFull(f"{self.name}: a {nbytes}-byte block exceeds the largest remote block "
                           f"({self.max_block_bytes} bytes)")
        self._session()
        self._guard.check()
        obj = object_bytes(nbytes)
        with self._lock:
            if key in self._own or key in self._pending:
                raise BlockExists(f"{self.name}: block {key.hex()[:16]} already stored or being written")
            if self._used + obj > self.config.capacity_bytes:
                raise TierFull(f"{self.name}: {obj} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
            lease = self._staging.lease(obj)
            self._pending[key] = _Pending(lease, nbytes)
            self._used += obj

    def write(self, key: bytes, offset: int, data: Any) -> None:
        p = self._pending.get(key)
        if p is None:
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not reserved")
        view = byte_view(data)
        check_chunk(offset, view.nbytes, p.written, p.nbytes)
        start = HEADER_BYTES + offset
        p.lease.view[start:start + view.nbytes] = view
        p.hasher.update(view)
        p.written += view.nbytes

    def commit(self, key: bytes) -> None:
        """Put the staged block into the cluster (one ``put_from``). A block the cluster
        already holds under this key counts as stored (keys name content).

        Raises BlockNotStored, InvalidAccess (not fully written; the reservation stays),
        TierIOError (the reservation is dropped)."""
        with self._lock:
            p = self._pending.get(key)
            if p is None:
                raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not reserved")
            if p.written != p.nbytes:
                raise InvalidAccess(f"commit of {key.hex()[:16]} after {p.written} of {p.nbytes} bytes")
            del self._pending[key]
        obj = object_bytes(p.nbytes)
        pack_header(p.lease.view, key, p.nbytes, p.hasher.intdigest())
        stored = False
        try:
            rc = self._call_with_lease(p.lease, obj, "put_from", self._name(key), p.lease.address, obj,
                                       self._replicate)
            if rc not in (0, OBJECT_ALREADY_EXISTS):
                raise TierIOError(f"{self.name}: put of {key.hex()[:16]} failed: {code_name(rc)}")
            stored = True
        finally:
            with self._lock:
                if stored:
                    self._own[key] = p.nbytes
                else:
                    self._used -= obj

    def _call_with_lease(self, lease: Lease, nbytes: int, method: str, *args: Any) -> int:
        """One scalar library call on ``lease``, released afterwards (or, for a call
        abandoned at its deadline, when it really ends)."""
        abandoned = False
        try:
            store = self._session()
            return self._guard.call(getattr(store, method), *args, deadline_s=self.config.deadline_s(nbytes),
                                    judge=_master_down, on_abandon=lease.release)
        except RemoteTimeout:
            abandoned = True
            raise
        finally:
            if not abandoned:
                lease.release()

    def abort(self, key: bytes) -> None:
        with self._lock:
            p = self._pending.pop(key, None)
            if p is None:
                return
            self._used -= object_bytes(p.nbytes)
        p.lease.release()

    # ------------------------------------------------------------------ reads

    def size_of(self, key: bytes) -> int:
        """Payload bytes of a block in the cluster (no call when this node put it).
        Raises BlockNotStored, BlockCorrupt (an object too short for a header), TierIOError."""
        check_key(key)
        n = self._own.get(key)
        if n is not None:
            return n
        rc = self._guard.call(self._session().get_size, self._name(key), judge=_master_down)
        if rc == OBJECT_NOT_FOUND:
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not in the cluster")
        if rc < 0:
            raise TierIOError(f"{self.name}: size of {key.hex()[:16]}: {code_name(rc)}")
        if rc < HEADER_BYTES:
            self._corrupt += 1
            raise BlockCorrupt(f"{self.name}: remote block {key.hex()[:16]} is {rc} bytes, shorter than its header")
        return rc - HEADER_BYTES

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Copy a block (or the concatenation of ``ranges`` of it) from the cluster into
        the start of ``out``; return the bytes copied.

        The whole object is fetched into the staging buffer and verified even when
        ``ranges`` ask for part of it: the checksum covers the whole payload. A block
        this node did not put costs one more call (its size).

        Raises BlockNotStored, InvalidAccess, BlockCorrupt (wrong, truncated or foreign
        copy; the caller drops it with :meth:`free`), TierIOError (master or peer down,
        deadline passed, breaker open)."""
        size = self.size_of(key)
        total = check_ranges(ranges, size)
        dst = output_view(out, total)
        obj = object_bytes(size)
        lease = self._staging.lease(obj, wait_s=self.config.timeout_s)
        # An object longer than ``obj`` fails with INVALID_PARAMS (it cannot be ours).
        rc = self._read_call(lease, obj, self._name(key))
        if rc == OBJECT_NOT_FOUND:
            self._forget(key)
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not in the cluster")
        if rc == INVALID_PARAMS:
            self._corrupt += 1
            raise BlockCorrupt(f"{self.name}: remote block {key.hex()[:16]} is longer than its {size} bytes")
        if rc < 0:
            self._peer_errors += 1
            raise TierIOError(f"{self.name}: read of {key.hex()[:16]} failed: {code_name(rc)}")
        try:
            try:
                payload = verify(lease.view[:rc], key, size)
            except BlockCorrupt:
                self._corrupt += 1
                raise
            if not ranges:
                dst[:] = payload
            else:
                pos = 0
                for off, length in ranges:
                    dst[pos:pos + length] = payload[off:off + length]
                    pos += length
            return total
        finally:
            lease.release()

    def _read_call(self, lease: Lease, obj: int, name: str) -> int:
        """``get_into`` into ``lease``; on a negative code or an exception the lease is
        released here, on success the caller releases it after verifying."""
        try:
            store = self._session()
            rc = self._guard.call(store.get_into, name, lease.address, obj, deadline_s=self.config.deadline_s(obj),
                                  judge=_master_down, on_abandon=lease.release)
        except RemoteTimeout:
            raise
        except BaseException:
            lease.release()
            raise
        if rc < 0:
            lease.release()
        return rc

    # ------------------------------------------------------------------ delete

    def free(self, key: bytes) -> None:
        """Remove a block from the cluster, whichever node put it (forced: readers that
        hold a lease may then read a reused region, which their checksum catches).
        Raises BlockNotStored, TierIOError."""
        check_key(key)
        rc = self._guard.call(self._session().remove, self._name(key), True, judge=_master_down)
        with self._lock:
            n = self._own.pop(key, None)
            if n is not None and rc in (0, OBJECT_NOT_FOUND):
                self._used -= object_bytes(n)
            elif n is not None:
                self._own[key] = n
        if rc == OBJECT_NOT_FOUND and n is None:
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not in the cluster")
        if rc < 0 and rc != OBJECT_NOT_FOUND:
            raise TierIOError(f"{self.name}: remove of {key.hex()[:16]} failed: {code_name(rc)}")

    # ------------------------------------------------------------------ batches (RemoteStore)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the cluster holds its block now (one ``batch_is_exist``).
        Keys this node put and the cluster lost are forgotten. Raises TierIOError,
        InvalidAccess."""
        names = [self._name(k) for k in keys]
        if not names:
            return []
        rcs = self._guard.call(self._session().batch_is_exist, names, judge=_any_error)
        found = [rc == 1 for rc in rcs]
        for key, hit in zip(keys, found):
            if not hit and key in self._own:
                self._forget(key)
        return found

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """See :meth:`tiers.base.RemoteStore.get_many_into`. Fetches with
        ``batch_get_into``, as many blocks per call as the staging buffer holds."""
        return get_many_into(self, keys, outs)

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """See :meth:`tiers.base.RemoteStore.put_many`. Stages blocks with their headers
        and stores them with ``batch_put_from``, as many per call as staging holds."""
        return put_many(self, items)

    # ------------------------------------------------------------------ state

    @property
    def health(self) -> RemoteHealth:
        """Connection and breaker state plus counters, for health checks and metrics."""
        stats = self._guard.stats()
        if self._conn.closed:
            state = RemoteState.CLOSED
        elif self._conn.store is None:
            state = RemoteState.CONNECTING
        else:
            state = {"closed": RemoteState.HEALTHY, "open": RemoteState.OPEN}.get(stats.breaker, RemoteState.HALF_OPEN)
        return RemoteHealth(state, self.config.master, self._conn.error or stats.last_error, len(self._own),
                            self._used, self._staging.used_bytes, self._corrupt, self._peer_errors, self._oversize,
                            stats)

    def close(self) -> None:
        """End the session and drop the staging buffer. Calls abandoned at their deadline
        are waited for first (up to ``4 * timeout_s``, at least 5 s): closing the library's
        client under a running call can crash the process, so if one is still running the
        session and the buffer are kept alive instead (leaked) and a warning is logged."""
        if self._conn.closed:
            return
        store = self._conn.detach()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.lease.release()
        idle = self._guard.wait_idle(max(5.0, 4 * self.config.timeout_s))
        ended = store is None
        if store is not None and idle:
            try:
                self._guard.call(store.close, deadline_s=max(5.0, 4 * self.config.timeout_s))
                ended = True
            except TierIOError as exc:
                log.warning("%s: closing the Mooncake session: %s", self.name, exc)
        if not ended:
            log.warning("%s: a Mooncake call is still running; its session stays open until exit", self.name)
            _KEPT.append(store)
        self._guard.close()
        self._staging.close(keep=not ended)

    def describe(self) -> str:
        return f"{self.name}(remote mooncake {self.config.master}, {self.capacity_bytes} bytes)"


__all__ = ["MooncakeConfig", "MooncakeTier", "RemoteHealth"]
