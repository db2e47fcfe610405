"""The cluster level of the store: what the core does with a remote tier (Mooncake Store).

A remote tier (:class:`tiers.base.RemoteStore`, e.g. :class:`tiers.mooncake.MooncakeTier`)
is the **last** tier of the manager, so placement treats it as one more level: a block
evicted from the last local tier (NVMe) is demoted into the cluster, the background
cleaner copies cold blocks there ahead of need, and its eviction policy bounds what this
node keeps there. What only a cluster needs lives here, called from a few points of the
core (:class:`Cluster`), which it reaches only through the port it declares
(:class:`kvstore.cluster.port.LocalStore`, implemented by the store):

- **Lookup** (:meth:`Cluster.lookup_rest`, from the store's Lookup):
  after a local prefix miss, one ``exists_many`` over the rest of the prefix, within
  ``lookup_timeout_s``; blocks other nodes put count as hits of tier ``REMOTE``. A cluster
  that fails or is slow answers "miss".
- **Page-in** (:meth:`Cluster.pull`, from reads, Get streams, leases and prefetch): blocks
  held only in the cluster are fetched in batches (``sizes_many`` then ``get_many_into``)
  straight into reservations in the host arena and committed there through the put
  protocol (catalogue entry, policies), then served like any other hit. The remote tier
  verifies every block it returns (header, key, xxh3), so a corrupt or truncated copy is
  a miss, never wrong bytes. A block this node keeps only in the cluster is promoted into
  the arena the same way (one fetch).
- **Publish** (:mod:`kvstore.cluster.publisher`, batched): with ``publish = "all"`` every
  put is also copied to the cluster in the background; with ``"demoted"`` (the default)
  blocks reach the cluster only by demotion. With ``[policy] write = "write_through"`` a
  put call returns once the cluster holds its blocks too (:meth:`Cluster.put_done`, which
  the store calls at the end of each put call).

Failure rules: every cluster call has a deadline and the tier's circuit breaker refuses
calls at once while the cluster is down (:mod:`tiers.mooncake.guard`); any failure here is
a miss or a skipped copy, counted (``remote_*`` counters), never an error of a local
request. The page-in never holds the catalogue lock across a network call. The tiers
this level is given raise store errors (:mod:`kvstore.store.media` translates the
media's), so a failed cluster call is a :class:`~kvstore.common.errors.TierIOError`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from tiers.base import TierKind

from kvstore.cluster.port import LocalStore
from kvstore.cluster.publisher import Publisher
from kvstore.common.errors import KVStoreError
from kvstore.common.types import PUBLISH_CHOICES

log = logging.getLogger("kvstore.cluster.cluster")

_REMOTE = int(TierKind.REMOTE)
_JOIN_WAIT_S = 30.0      # longest wait for another request's page-in of the same blocks (it has deadlines)


@dataclass(frozen=True)
class ClusterOptions:
    """How the core uses its remote tier (``[tiers.remote]``, parsed).

    Attributes:
        publish: ``"demoted"``: blocks reach the cluster when they leave the last local
            tier; ``"all"``: every put is also copied there in the background.
        lookup_timeout_s: deadline of the existence check a Lookup makes (seconds).
        publish_backlog: puts waiting to be published; beyond it the oldest are skipped.
        chunk_bytes: most bytes one page-in reserves and fetches at once (0: the remote
            tier's largest block, i.e. its staging buffer).
    """

    publish: str = "demoted"
    lookup_timeout_s: float = 0.5
    publish_backlog: int = 65536
    chunk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.publish not in PUBLISH_CHOICES:
            raise ValueError(f"publish must be one of {', '.join(PUBLISH_CHOICES)}, got {self.publish!r}")
        if not self.lookup_timeout_s > 0 or self.publish_backlog < 1 or self.chunk_bytes < 0:
            raise ValueError("lookup_timeout_s and publish_backlog must be > 0, chunk_bytes >= 0")


class Cluster:
    """The cluster level of one node's store (see the module docstring). Made by the store
    when its last tier has the ``remote`` capability.

    Args:
        local: this node's store (:class:`~kvstore.cluster.port.LocalStore`).
        tiers: the store's tiers, fastest first, as the store calls them (each with
            ``name``, ``kind``, ``host_addressable``, ``write_view``, ``max_block_bytes``
            and ``remote``, the cluster's batch calls, raising store errors:
            :class:`kvstore.store.media.TierAdapter`).
        counters: the store's counters (``remote_*``).
        options: publish rule and deadlines.
        shared_tier: index of the tier same-node clients map (the host arena), or None.
        write_through: the store's write policy is ``write_through`` (:meth:`put_done`).
    Raises ValueError when the remote tier is not the last tier.
    """

    def __init__(self, local: LocalStore, tiers: Sequence[Any], counters: Any, options: ClusterOptions | None = None,
                 *, shared_tier: int | None = None, write_through: bool = False):
        self.local = local
        self.options = options or ClusterOptions()
        self.index = len(tiers) - 1
        self.tier = tiers[self.index]
        remote = self.tier.remote
        if remote is None or any(t.remote is not None for t in tiers[:-1]):
            raise ValueError("a remote tier must be the last tier, and there can be only one")
        self.remote = remote
        self.counters = counters
        self._kinds = [int(t.kind) for t in tiers]
        self.dest = _arena_tier(tiers[:self.index], shared_tier)
        """Index of the tier blocks are paged into (the host arena), or None: plain puts."""
        self._arena = tiers[self.dest] if self.dest is not None else None
        limit = self.options.chunk_bytes or self.tier.max_block_bytes
        self.chunk_bytes = max(1, limit)
        self._lock = threading.Lock()
        self._inflight: dict[bytes, threading.Event] = {}   # keys being paged in (single flight)
        self._paging: set[bytes] = set()                    # keys committed by a page-in right now
        self._stop = threading.Event()
        self._ahead: collections.deque = collections.deque()   # (keys, on_done) for pull_ahead
        self._ahead_wake = threading.Event()
        self._ahead_thread: threading.Thread | None = None
        self.publisher = Publisher(local, remote, self.index, dest=self.dest, chunk_bytes=self.chunk_bytes,
                                   counters=counters, skip=self.paging,
                                   background=self.options.publish == "all", write_through=write_through,
                                   backlog=self.options.publish_backlog)

    # ------------------------------------------------------------------ lookup

    def lookup_rest(self, keys: Sequence[bytes]) -> bytes:
        """Tier codes (one byte per block, :class:`TierKind`) of the leading blocks of
        ``keys`` (the rest of a prefix after a local miss) that are held here or in the
        cluster. One ``exists_many`` for the blocks not held here, waited on
        ``lookup_timeout_s`` at most; a failure is an answer of "miss" (counted in
        ``remote_lookup_failures``)."""
        if not keys:
            return b""
        local = self.local.fastest(keys)
        ask = [k for k, t in zip(keys, local) if t is None]
        found: set[bytes] = set()
        if ask:
            self.counters.inc("remote_lookups")
            try:
                hits = self.remote.exists_many(ask, deadline_s=self.options.lookup_timeout_s)
                found = {k for k, hit in zip(ask, hits) if hit}
            except KVStoreError as e:
                self.counters.inc("remote_lookup_failures")
                log.debug("cluster lookup of %d blocks failed: %s", len(ask), e)
        codes = bytearray()
        remote = 0
        for key, t in zip(keys, local):
            if t is not None:
                codes.append(self._kinds[t])
            elif key in found:
                codes.append(_REMOTE)
                remote += 1
            else:
                break
        self.counters.inc("remote_lookup_hit_blocks", remote)
        return bytes(codes)

    # ------------------------------------------------------------------ page-in

    def pull(self, keys: Sequence[bytes], *, prefix: bool = False) -> set[bytes]:
        """Bring the blocks of ``keys`` that are held only in the cluster into the host
        arena (see the module docstring); blocks held locally cost nothing (no network
        call). With ``prefix``, stop at the first block that is neither here nor in the
        cluster. Returns the keys paged in by this call. Never raises for a cluster
        failure: those blocks stay misses (counted)."""
        absent: list[bytes] = []
        remote_only: list[bytes] = []
        for k, t in zip(keys, self.local.fastest(keys)):
            if t is None:
                absent.append(k)
            elif t == self.index:
                remote_only.append(k)
        if not absent and not remote_only:
            return set()
        mine: list[bytes] = []
        theirs: list[threading.Event] = []
        with self._lock:
            for k in dict.fromkeys(absent):
                ev = self._inflight.get(k)
                if ev is not None:
                    theirs.append(ev)           # another request is paging it in: wait for that
                elif not self.local.writing(k):     # (a client writing it now: a miss, as without a cluster)
                    self._inflight[k] = threading.Event()
                    mine.append(k)
        pulled: set[bytes] = set()
        stop_at: bytes | None = None
        try:
            if mine:
                stop_at = self._fetch_absent(mine, prefix, pulled)
        finally:
            with self._lock:
                for k in mine:
                    self._inflight.pop(k).set()
        for ev in theirs:                   # another request is paging the same blocks in
            ev.wait(_JOIN_WAIT_S)
        if self.dest is not None:
            last = keys.index(stop_at) if stop_at is not None else len(keys)
            for k in remote_only:
                if keys.index(k) > last:
                    break
                if self.local.promote(k, self.dest):
                    pulled.add(k)
        return pulled

    def pull_ahead(self, keys: Sequence[bytes], on_done=None) -> None:
        """:meth:`pull` ``keys`` (a prefix) on a background thread, then call
        ``on_done(paged_keys, seconds)``: for callers that must not wait on the network
        (prefetch, which holds its own lock)."""
        with self._lock:
            self._ahead.append((list(keys), on_done))
            if self._ahead_thread is None:
                self._ahead_thread = threading.Thread(target=self._ahead_loop, name="kvstore-page-in", daemon=True)
                self._ahead_thread.start()
        self._ahead_wake.set()

    def _ahead_loop(self) -> None:
        while not self._stop.is_set():
            self._ahead_wake.wait(0.25)
            self._ahead_wake.clear()
            while self._ahead and not self._stop.is_set():
                keys, on_done = self._ahead.popleft()
                try:
                    t0 = time.perf_counter()
                    paged = self.pull(keys, prefix=True)
                    if on_done is not None:
                        on_done(paged, time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - keep the thread; the error is logged loudly
                    log.exception("background page-in failed")

    def _fetch_absent(self, keys: list[bytes], prefix: bool, pulled: set[bytes]) -> bytes | None:
        """Page in ``keys`` (none held here); returns the key a prefix stopped at."""
        try:
            sizes = self.remote.sizes_many(keys)
        except KVStoreError as e:
            self.counters.inc("remote_pull_failures")
            log.debug("cluster size check of %d blocks failed: %s", len(keys), e)
            return keys[0] if prefix else None
        items: list[tuple[bytes, int]] = []
        stop_at = None
        for key, size in zip(keys, sizes):
            if size is None:
                if prefix:
                    stop_at = key
                    break
                continue
            items.append((key, size))
        for chunk in _chunks(items, self.chunk_bytes):
            if not self._page_in(chunk, pulled):
                break                        # no room here, or the cluster failed: the rest are misses
        return stop_at

    def _page_in(self, chunk: list[tuple[bytes, int]], pulled: set[bytes]) -> bool:
        """Reserve room for ``chunk`` in the arena, fetch it in one batch, commit what
        verified. Returns False when nothing more should be tried now."""
        local = self.local
        claims = []
        go_on = True
        try:
            for key, size in chunk:
                try:
                    out = local.begin_put(key, size, tier=self.dest) if self.dest is not None else None
                except KVStoreError as e:        # no room (TierFull), medium failure, a conflicting put
                    log.debug("no room to page in block %s: %s", key.hex()[:16], e)
                    self.counters.inc("remote_pull_misses")
                    go_on = False
                    break
                if out is None:
                    claims.append((key, size, None))
                elif out.pending is not None:
                    claims.append((key, size, out.pending))
            if not claims:
                return go_on
            if self._arena is not None:
                outs = [self._arena.write_view(key)[:size] for key, size, _ in claims]
            else:
                outs = [np.empty(size, np.uint8) for _, size, _ in claims]
            try:
                got = self.remote.get_many_into([key for key, _, _ in claims], outs)
            except KVStoreError as e:
                self.counters.inc("remote_pull_failures")
                log.debug("cluster get of %d blocks failed: %s", len(claims), e)
                got = [None] * len(claims)
                go_on = False
            done, claims = claims, []
            for (key, size, claim), n, out in zip(done, got, outs):
                if n == size and self._commit(key, claim, out):
                    pulled.add(key)
                    self.counters.inc("remote_pulled_blocks")
                    self.counters.inc("remote_pulled_bytes", size)
                else:
                    if claim is not None:
                        local.abort_put(claim)
                    self.counters.inc("remote_pull_misses")
            return go_on
        finally:
            for _, _, claim in claims:
                if claim is not None:
                    local.abort_put(claim)

    def _commit(self, key: bytes, claim, out) -> bool:
        self._paging.add(key)               # not published again (publish = "all")
        try:
            if claim is None:
                self.local.put(key, out)
            else:
                self.local.commit_put(claim, in_place=True)
            return True
        except KVStoreError as e:
            log.debug("paging in block %s failed: %s", key.hex()[:16], e)
            return False
        finally:
            self._paging.discard(key)

    def paging(self, key: bytes) -> bool:
        """Whether ``key`` is being committed by a page-in now (it is in the cluster
        already: not published again)."""
        return key in self._paging

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, int]:
        """The remote tier's call counters for Stats (``remote_*``), when it keeps them."""
        return {f"remote_{name}": n for name, n in self.remote.call_counters().items()}

    def put_done(self, keys: Sequence[bytes]) -> None:
        """A put call committed ``keys`` (called at its end): with write-through, returns
        once the cluster holds them too (batched, within the tier's deadlines)."""
        self.publisher.put_done(keys)

    def wait_published(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued publish was done or given up (tests, benchmarks)."""
        return self.publisher.wait_idle(timeout_s)

    def close(self) -> None:
        """Stop publishing and paging ahead."""
        self._stop.set()
        self._ahead_wake.set()
        if self._ahead_thread is not None:
            self._ahead_thread.join(timeout=10)
        self.publisher.close()


def _arena_tier(local: Sequence[Any], shared_tier: int | None) -> int | None:
    """Where blocks are paged in: the shared arena, else the first host-addressable host
    (then HBM) tier among the ``local`` tiers; None: plain puts."""
    if shared_tier is not None:
        return shared_tier
    for kind in (TierKind.HOST, TierKind.HBM):
        for i, t in enumerate(local):
            if t.kind is kind and t.host_addressable:
                return i
    return None


def _chunks(items: list[tuple[bytes, int]], limit: int) -> Iterator[list[tuple[bytes, int]]]:
    """``items`` in order, in runs of at most ``limit`` bytes (a larger item alone)."""
    run: list[tuple[bytes, int]] = []
    total = 0
    for item in items:
        if run and total + item[1] > limit:
            yield run
            run, total = [], 0
        run.append(item)
        total += item[1]
    if run:
        yield run


__all__ = ["Cluster", "ClusterOptions", "PUBLISH_CHOICES"]
