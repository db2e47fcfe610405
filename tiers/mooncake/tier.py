"""The remote tier: blocks as objects in a Mooncake Store cluster shared by many nodes.

Each block is one cluster object named ``prefix + key.hex()``, holding a 64-byte header
(magic, key, size, xxh3_64; :mod:`tiers.mooncake.object_format`) and the payload. Every read
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
(:mod:`tiers.mooncake.guard`), and the session with the master is made in the background,
so a master that is down at start, dies, stalls or is partitioned gives MediaIOError
quickly, never a hang or a crash. Measured behaviour: ``docs/remote_tier.md``.

The calls a store core makes while holding its own lock never touch the network:
``fits``, ``reserve``, ``write``, ``abort`` and ``free`` (removals are queued and run in
the background); the network put of a two-phase write is :meth:`MooncakeTier.send`
(run by the core's copy queue), after which :meth:`MooncakeTier.commit` only records
the block.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import xxhash

from tiers.base import ByteRanges, Capabilities, Tier, TierKind, byte_view, check_chunk
from tiers.errors import BlockExists, BlockNotStored, InvalidAccess, NoRoom, MediaIOError
from tiers.mooncake.batch import Remover, get_many_into, put_many, sizes_many
from tiers.mooncake.client import (
    MASTER_DOWN,
    OBJECT_ALREADY_EXISTS,
    Connector,
    MooncakeConfig,
    code_name,
    replicate_config,
    store_class,
)
from tiers.mooncake.read import read_into, size_of
from tiers.mooncake.object_format import HEADER_BYTES, check_key, object_bytes, object_name, pack_header
from tiers.mooncake.guard import CallGuard, RemoteHealth, RemoteState, RemoteTimeout
from tiers.mooncake.staging import Lease, StagingArena

log = logging.getLogger("kvstore.tiers.remote")
_KEPT: list = []            # sessions not closed because a library call may still use them


class _Pending:
    __slots__ = ("lease", "nbytes", "written", "hasher", "sent", "abandoned")

    def __init__(self, lease: Lease, nbytes: int):
        self.lease = lease
        self.nbytes = nbytes
        self.written = 0
        self.hasher = xxhash.xxh3_64()
        self.sent = False           # stored in the cluster by send(); commit only records it
        self.abandoned = False      # a put passed its deadline: the call releases the lease

    def release(self) -> None:
        if not self.abandoned:
            self.lease.release()


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
            tier is usable without it: calls raise MediaIOError until it connects).

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
        self._remover = Remover(self)
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
        """Whether ``nbytes`` fit in this node's share of the cluster (capacity only: an
        unreachable cluster is not a full one; :meth:`reserve` raises MediaIOError then)."""
        return nbytes <= self.max_block_bytes and self._used + object_bytes(nbytes) <= self.config.capacity_bytes

    # ------------------------------------------------------------------ two-phase write

    def reserve(self, key: bytes, nbytes: int) -> None:
        """Reserve room for a block; its bytes are staged in host memory until commit.

        Raises NoRoom (beyond capacity or :attr:`max_block_bytes`), BlockExists,
        MediaIOError (not connected, breaker open, or the staging buffer full now).
        """
        check_key(key)
        if nbytes < 0:
            raise InvalidAccess(f"block size must be >= 0 bytes, got {nbytes}")
        if nbytes > self.max_block_bytes:
            raise NoRoom(f"{self.name}: a {nbytes}-byte block exceeds the largest remote block "
                           f"({self.max_block_bytes} bytes)")
        self._session()
        self._guard.check()
        obj = object_bytes(nbytes)
        with self._lock:
            if key in self._own or key in self._pending:
                raise BlockExists(f"{self.name}: block {key.hex()[:16]} already stored or being written")
            if self._used + obj > self.config.capacity_bytes:
                raise NoRoom(f"{self.name}: {obj} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
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

    def _written(self, key: bytes) -> _Pending:
        p = self._pending.get(key)
        if p is None:
            raise BlockNotStored(f"{self.name}: block {key.hex()[:16]} is not reserved")
        if p.written != p.nbytes:
            raise InvalidAccess(f"{key.hex()[:16]}: {p.written} of {p.nbytes} bytes written")
        return p

    def send(self, key: bytes) -> None:
        """Store a fully written reservation in the cluster now (one ``put_from``, the
        network part of :meth:`commit`), so that the commit that follows only records
        it. Call it without holding locks others wait on. A block the cluster already
        holds under this key counts as stored (keys name content).

        Raises BlockNotStored, InvalidAccess (not fully written), MediaIOError (the
        cluster failed; the reservation stays until :meth:`abort`)."""
        with self._lock:
            p = self._written(key)
        if not p.sent:
            self._put_staged(key, p)

    def _put_staged(self, key: bytes, p: _Pending) -> None:
        obj = object_bytes(p.nbytes)
        pack_header(p.lease.view, key, p.nbytes, p.hasher.intdigest())
        try:
            rc = self._guard.call(self._session().put_from, self._name(key), p.lease.address, obj, self._replicate,
                                  deadline_s=self.config.deadline_s(obj), judge=_master_down,
                                  on_abandon=p.lease.release)
        except RemoteTimeout:
            p.abandoned = True          # the lease goes back when the call really ends
            raise
        if rc not in (0, OBJECT_ALREADY_EXISTS):
            raise MediaIOError(f"{self.name}: put of {key.hex()[:16]} failed: {code_name(rc)}")
        p.sent = True

    def commit(self, key: bytes) -> None:
        """Make a written reservation a block of this node, putting it into the cluster
        first unless :meth:`send` did (then this call waits on the network).

        Raises BlockNotStored, InvalidAccess (not fully written; the reservation stays),
        MediaIOError (the reservation is dropped)."""
        with self._lock:
            p = self._written(key)
            del self._pending[key]
        stored = False
        try:
            if not p.sent:
                self._put_staged(key, p)
            stored = True
        finally:
            with self._lock:
                if stored:
                    self._own[key] = p.nbytes
                else:
                    self._used -= object_bytes(p.nbytes)
            p.release()

    def abort(self, key: bytes) -> None:
        """Drop a reservation. One already sent stays in the cluster, untracked here
        (its bytes are valid under its key; another node may have put it too)."""
        with self._lock:
            p = self._pending.pop(key, None)
            if p is None:
                return
            self._used -= object_bytes(p.nbytes)
        p.release()

    # ------------------------------------------------------------------ reads

    def size_of(self, key: bytes) -> int:
        """Payload bytes of a block in the cluster (no call when this node put it).
        Raises BlockNotStored, BlockCorrupt (an object too short for a header), MediaIOError."""
        return size_of(self, key)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Copy a block (or the concatenation of ``ranges`` of it) from the cluster into
        the start of ``out``; return the bytes copied.

        The whole object is fetched into the staging buffer and verified even when
        ``ranges`` ask for part of it: the checksum covers the whole payload. A block
        this node did not put costs one more call (its size).

        Raises BlockNotStored, InvalidAccess, BlockCorrupt (wrong, truncated or foreign
        copy; the caller drops it with :meth:`free`), MediaIOError (master or peer down,
        deadline passed, breaker open)."""
        return read_into(self, key, out, ranges)

    # ------------------------------------------------------------------ delete

    def free(self, key: bytes) -> None:
        """Forget a block at once and remove it from the cluster in the background,
        whichever node put it (forced: a reader holding a lease may then read a reused
        region, which its checksum catches). Never waits on the network, so a store
        core may call it under its lock; :meth:`flush` waits for queued removals.
        Raises InvalidAccess (a malformed key)."""
        check_key(key)
        self._forget(key)
        self._remover.submit(self._name(key))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` seconds until every queued removal was tried."""
        return self._remover.wait_idle(timeout_s)

    # ------------------------------------------------------------------ batches (RemoteStore)

    def exists_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        """For each key, whether the cluster holds its block now (one ``batch_is_exist``,
        waited on ``deadline_s`` seconds at most, default ``timeout_s``). Keys this node
        put and the cluster lost are forgotten. Raises MediaIOError, InvalidAccess."""
        names = [self._name(k) for k in keys]
        if not names:
            return []
        rcs = self._guard.call(self._session().batch_is_exist, names, deadline_s=deadline_s, judge=_any_error)
        found = [rc == 1 for rc in rcs]
        for key, hit in zip(keys, found):
            if not hit and key in self._own:
                self._forget(key)
        return found

    def sizes_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[int | None]:
        """See :meth:`tiers.base.RemoteStore.sizes_many` (one ``batch_get_replica_desc``)."""
        return sizes_many(self, keys, deadline_s)

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

    def call_counters(self) -> dict[str, int]:
        """See :meth:`tiers.base.RemoteStore.call_counters`."""
        h = self.health
        g = h.guard
        return {"calls": g.calls, "call_failures": g.failures, "call_timeouts": g.timeouts,
                "calls_refused": g.rejected, "corrupt_copies": h.corrupt_blocks, "peer_errors": h.peer_errors}

    def problem(self) -> str | None:
        """What keeps the cluster from serving this node now (not connected, circuit
        open), or None. No network call."""
        h = self.health
        if h.state is RemoteState.HEALTHY:
            return None
        if h.state is RemoteState.CONNECTING:
            return f"not connected to the Mooncake master {h.master} ({h.last_error})"
        if h.state is RemoteState.OPEN:
            return (f"cluster unreachable, calls refused for {h.guard.open_for_s:.1f}s after "
                    f"{h.guard.consecutive_failures} failures (last: {h.last_error})")
        if h.state is RemoteState.HALF_OPEN:
            return f"cluster unreachable, probing (last: {h.last_error})"
        return "closed"

    def close(self) -> None:
        """End the session and drop the staging buffer. Calls abandoned at their deadline
        are waited for first (up to ``4 * timeout_s``, at least 5 s): closing the library's
        client under a running call can crash the process, so if one is still running the
        session and the buffer are kept alive instead (leaked) and a warning is logged."""
        if self._conn.closed:
            return
        self._remover.stop(self.config.timeout_s)
        store = self._conn.detach()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.release()
        idle = self._guard.wait_idle(max(5.0, 4 * self.config.timeout_s))
        ended = store is None
        if store is not None and idle:
            try:
                self._guard.call(store.close, deadline_s=max(5.0, 4 * self.config.timeout_s))
                ended = True
            except MediaIOError as exc:
                log.warning("%s: closing the Mooncake session: %s", self.name, exc)
        if not ended:
            log.warning("%s: a Mooncake call is still running; its session stays open until exit", self.name)
            _KEPT.append(store)
        self._guard.close()
        self._staging.close(keep=not ended)

    def describe(self) -> str:
        return f"{self.name}(remote mooncake {self.config.master}, {self.capacity_bytes} bytes)"


__all__ = ["MooncakeConfig", "MooncakeTier", "RemoteHealth"]
