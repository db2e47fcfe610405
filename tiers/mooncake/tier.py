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
from typing import Any, Sequence

from tiers.base import Tier, TierKind
from tiers.buffers import ByteRanges, byte_view
from tiers.capabilities import Capabilities
from tiers.errors import InvalidAccess, MediaIOError, NoRoom
from tiers.mooncake.batch import BatchCalls
from tiers.mooncake.client import (
    OBJECT_ALREADY_EXISTS,
    Connector,
    MooncakeConfig,
    code_name,
    master_down,
    replicate_config,
    store_class,
)
from tiers.mooncake.context import RemoteContext
from tiers.mooncake.guard import CallGuard, RemoteHealth, RemoteState, RemoteTimeout
from tiers.mooncake.ledger import Ledger, StagedWrite
from tiers.mooncake.object_format import HEADER_BYTES, check_key, object_bytes, pack_header
from tiers.mooncake.read import BlockReads
from tiers.mooncake.remover import Remover
from tiers.mooncake.staging import StagingArena

log = logging.getLogger("kvstore.tiers.remote")
_KEPT: list = []            # sessions not closed because a library call may still use them


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

    Its parts share one :class:`tiers.mooncake.context.RemoteContext`: the
    :class:`~tiers.mooncake.ledger.Ledger` of the blocks this node put, single-block
    reads (:class:`~tiers.mooncake.read.BlockReads`), the batch calls
    (:class:`~tiers.mooncake.batch.BatchCalls`) and background removals
    (:class:`~tiers.mooncake.remover.Remover`).
    """

    kind = TierKind.REMOTE
    volatile = False

    def __init__(self, config: MooncakeConfig, name: str = "remote", *, wait_connected_s: float = 0.0):
        store_class()
        self.config = config
        self.name = name
        staging = StagingArena(config.staging_bytes)
        guard = CallGuard(f"{name}(mooncake {config.master})", timeout_s=config.timeout_s,
                          failure_threshold=config.failure_threshold, cooldown_s=config.cooldown_s,
                          max_in_flight=config.max_in_flight)
        replicate = replicate_config(config)
        self._ledger = Ledger(config.capacity_bytes, name)
        connector = Connector(config, staging.address, staging.nbytes, name, on_connect=guard.reset)
        self._ctx = ctx = RemoteContext(name, config, staging, guard, connector, self._ledger, replicate)
        self._reads = BlockReads(ctx)
        self._batches = BatchCalls(ctx, self.max_block_bytes)
        self._remover = Remover(ctx)
        if wait_connected_s > 0:
            self.wait_connected(wait_connected_s)

    # ------------------------------------------------------------------ session

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the session; True once connected."""
        return self._ctx.connector.connected.wait(timeout_s)

    def object_name(self, key: bytes) -> str:
        """The cluster object name of a block (``prefix + key hex``)."""
        return self._ctx.object_name(key)

    def keys(self) -> list[bytes]:
        """The blocks this node put and still tracks (no network call)."""
        return self._ledger.keys()

    # ------------------------------------------------------------------ accounting

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(remote=self)

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._ledger.used_bytes

    @property
    def max_block_bytes(self) -> int:
        """Largest payload: what fits in the staging buffer with its header (bytes)."""
        return min(self._ctx.staging.nbytes, self.config.capacity_bytes) - HEADER_BYTES

    def __contains__(self, key: bytes) -> bool:
        """True when this node put ``key`` and has not seen it gone (no network call)."""
        return key in self._ledger

    def __len__(self) -> int:
        return len(self._ledger)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in this node's share of the cluster (capacity only: an
        unreachable cluster is not a full one; :meth:`reserve` raises MediaIOError then)."""
        return nbytes <= self.max_block_bytes and \
            self._ledger.used_bytes + object_bytes(nbytes) <= self.config.capacity_bytes

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
        self._ctx.session()
        self._ctx.guard.check()
        self._ledger.open_write(key, nbytes, self._ctx.staging.lease)

    def write(self, key: bytes, offset: int, data: Any) -> None:
        w = self._ledger.write_of(key)
        w.write(offset, byte_view(data))

    def send(self, key: bytes) -> None:
        """Store a fully written reservation in the cluster now (one ``put_from``, the
        network part of :meth:`commit`), so that the commit that follows only records
        it. Call it without holding locks others wait on. A block the cluster already
        holds under this key counts as stored (keys name content).

        Raises BlockNotStored, InvalidAccess (not fully written), MediaIOError (the
        cluster failed; the reservation stays until :meth:`abort`)."""
        w = self._ledger.written(key)
        if not w.sent:
            self._put_staged(key, w)

    def _put_staged(self, key: bytes, w: StagedWrite) -> None:
        ctx = self._ctx
        obj = object_bytes(w.nbytes)
        pack_header(w.lease.view, key, w.nbytes, w.hasher.intdigest())
        try:
            rc = ctx.guard.call(ctx.session().put_from, ctx.object_name(key), w.lease.address, obj, ctx.replicate,
                                deadline_s=self.config.deadline_s(obj), judge=master_down,
                                on_abandon=w.lease.release)
        except RemoteTimeout:
            w.abandoned = True          # the lease goes back when the call really ends
            raise
        if rc not in (0, OBJECT_ALREADY_EXISTS):
            raise MediaIOError(f"{self.name}: put of {key.hex()[:16]} failed: {code_name(rc)}")
        w.sent = True

    def commit(self, key: bytes) -> None:
        """Make a written reservation a block of this node, putting it into the cluster
        first unless :meth:`send` did (then this call waits on the network).

        Raises BlockNotStored, InvalidAccess (not fully written; the reservation stays),
        MediaIOError (the reservation is dropped)."""
        w = self._ledger.close_write(key)
        stored = False
        try:
            if not w.sent:
                self._put_staged(key, w)
            stored = True
        finally:
            self._ledger.finish(key, w, stored)
            w.release()

    def abort(self, key: bytes) -> None:
        """Drop a reservation. One already sent stays in the cluster, untracked here
        (its bytes are valid under its key; another node may have put it too)."""
        w = self._ledger.drop_write(key)
        if w is not None:
            w.release()

    # ------------------------------------------------------------------ reads

    def size_of(self, key: bytes) -> int:
        """Payload bytes of a block in the cluster (no call when this node put it).
        Raises BlockNotStored, BlockCorrupt (an object too short for a header), MediaIOError."""
        return self._reads.size_of(key)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Copy a block (or the concatenation of ``ranges`` of it) from the cluster into
        the start of ``out``; return the bytes copied.

        The whole object is fetched into the staging buffer and verified even when
        ``ranges`` ask for part of it: the checksum covers the whole payload. A block
        this node did not put costs one more call (its size).

        Raises BlockNotStored, InvalidAccess, BlockCorrupt (wrong, truncated or foreign
        copy; the caller drops it with :meth:`free`), MediaIOError (master or peer down,
        deadline passed, breaker open)."""
        return self._reads.read_into(key, out, ranges)

    # ------------------------------------------------------------------ delete

    def free(self, key: bytes) -> None:
        """Forget a block at once and remove it from the cluster in the background,
        whichever node put it (forced: a reader holding a lease may then read a reused
        region, which its checksum catches). Never waits on the network, so a store
        core may call it under its lock; :meth:`flush` waits for queued removals.
        Raises InvalidAccess (a malformed key)."""
        check_key(key)
        self._ledger.forget(key)
        self._remover.submit(self._ctx.object_name(key))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` seconds until every queued removal was tried."""
        return self._remover.wait_idle(timeout_s)

    # ------------------------------------------------------------------ batches (RemoteStore)

    def exists_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[bool]:
        """For each key, whether the cluster holds its block now (one ``batch_is_exist``,
        waited on ``deadline_s`` seconds at most, default ``timeout_s``). Keys this node
        put and the cluster lost are forgotten. Raises MediaIOError, InvalidAccess."""
        return self._batches.exists_many(keys, deadline_s)

    def sizes_many(self, keys: Sequence[bytes], deadline_s: float | None = None) -> list[int | None]:
        """See :meth:`tiers.base.RemoteStore.sizes_many` (one ``batch_get_replica_desc``)."""
        return self._batches.sizes_many(keys, deadline_s)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """See :meth:`tiers.base.RemoteStore.get_many_into`. Fetches with
        ``batch_get_into``, as many blocks per call as the staging buffer holds."""
        return self._batches.get_many_into(keys, outs)

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """See :meth:`tiers.base.RemoteStore.put_many`. Stages blocks with their headers
        and stores them with ``batch_put_from``, as many per call as staging holds."""
        return self._batches.put_many(items)

    # ------------------------------------------------------------------ state

    @property
    def health(self) -> RemoteHealth:
        """Connection and breaker state plus counters, for health checks and metrics."""
        ctx = self._ctx
        stats = ctx.guard.stats()
        if ctx.connector.closed:
            state = RemoteState.CLOSED
        elif ctx.connector.store is None:
            state = RemoteState.CONNECTING
        else:
            state = {"closed": RemoteState.HEALTHY, "open": RemoteState.OPEN}.get(stats.breaker, RemoteState.HALF_OPEN)
        return RemoteHealth(state, self.config.master, ctx.connector.error or stats.last_error, len(self._ledger),
                            self._ledger.used_bytes, ctx.staging.used_bytes, ctx.faults.corrupt,
                            ctx.faults.peer_errors, ctx.faults.oversize, stats)

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
        ctx = self._ctx
        if ctx.connector.closed:
            return
        self._remover.stop(self.config.timeout_s)
        store = ctx.connector.detach()
        for w in self._ledger.close_writes():
            w.release()
        idle = ctx.guard.wait_idle(max(5.0, 4 * self.config.timeout_s))
        ended = store is None
        if store is not None and idle:
            try:
                ctx.guard.call(store.close, deadline_s=max(5.0, 4 * self.config.timeout_s))
                ended = True
            except MediaIOError as exc:
                log.warning("%s: closing the Mooncake session: %s", self.name, exc)
        if not ended:
            log.warning("%s: a Mooncake call is still running; its session stays open until exit", self.name)
            _KEPT.append(store)
        ctx.guard.close()
        ctx.staging.close(keep=not ended)

    def describe(self) -> str:
        return f"{self.name}(remote mooncake {self.config.master}, {self.capacity_bytes} bytes)"


__all__ = ["MooncakeConfig", "MooncakeTier", "RemoteHealth"]
