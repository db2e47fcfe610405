"""Copies of local blocks into the cluster, in batches: write-through and ``publish = "all"``.

The store copies a block to the cluster one at a time when it is demoted (through the
copy queues). Publishing copies many at once instead: :meth:`Publisher.publish_now`
pins the blocks, makes room in this node's share of the cluster (evicting its coldest
blocks there), stores them with one ``put_many`` per staging-full (no lock held), and
records each stored copy in the catalogue (a clean lower copy, so evicting the local one
later costs nothing), all through the store's port (:class:`~kvstore.cluster.port.LocalStore`).
Two users:

- ``[policy] write = "write_through"``: a put call returns once the cluster holds its
  blocks too (:meth:`Publisher.put_done`, called at the end of each put call);
- ``publish = "all"``: every committed put is queued (:meth:`LocalStore.watch_puts`) and published
  by a background thread, batched; a put never waits for it.

A cluster that is down or slow makes these copies fail within the tier's deadlines
(counted in ``remote_publish_failed``); local puts are not failed by it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Sequence

from kvstore.cluster.port import Held, LocalStore
from kvstore.common.errors import KVStoreError

log = logging.getLogger("kvstore.cluster.cluster")

OBJECT_OVERHEAD = 64
"""Bytes a cluster object may add to a block (the remote tier's header), for batch sizing."""


class Publisher:
    """Batched copies of local blocks into the cluster (see the module docstring).

    Args:
        local: this node's store (:class:`~kvstore.cluster.port.LocalStore`).
        remote: the cluster's batch calls (``put_many``), raising store errors.
        index: the remote tier's index; dest: the host arena's (zero-copy reads), or None.
        chunk_bytes: most bytes one ``put_many`` carries.
        counters: the store's counters (``remote_published``, ``remote_publish_failed``).
        skip: True for a key not to publish now (being paged in: the cluster holds it).
        background: run the ``publish = "all"`` queue; write_through: :meth:`put_done`
            publishes synchronously; backlog: most queued keys (the oldest are skipped).
    """

    def __init__(self, local: LocalStore, remote: Any, index: int, *, dest: int | None, chunk_bytes: int,
                 counters: Any, skip: Callable[[bytes], bool], background: bool, write_through: bool,
                 backlog: int):
        self.local = local
        self.remote = remote
        self.index = index
        self.dest = dest
        self.chunk_bytes = chunk_bytes
        self.counters = counters
        self._skip = skip
        self.write_through = write_through
        self.backlog = backlog
        self._queue: collections.deque[bytes] = collections.deque()
        self._busy = False
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._unwatch: Callable[[], None] | None = None
        if background and not write_through:
            self._unwatch = local.watch_puts(self._on_put)
            self._thread = threading.Thread(target=self._run, name="kvstore-publish", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the batch copy

    def publish_now(self, keys: Sequence[bytes]) -> int:
        """Copy the blocks of ``keys`` not yet in the cluster there now, in batches (each
        pinned only while it is copied); returns how many were stored. Never raises for a
        cluster failure (counted in ``remote_publish_failed``)."""
        stored = 0
        batch: list[bytes] = []
        total = 0
        for key in dict.fromkeys(keys):
            size = self.local.size_of(key)
            if size is None:
                continue
            if batch and total + size + OBJECT_OVERHEAD > self.chunk_bytes:
                stored += self._publish_keys(batch)
                batch, total = [], 0
            batch.append(key)
            total += size + OBJECT_OVERHEAD
        if batch:
            stored += self._publish_keys(batch)
        return stored

    def _publish_keys(self, keys: list[bytes]) -> int:
        held = self.local.pin_missing(keys, self.index, self._skip)
        try:
            return self._publish_batch(held) if held else 0
        finally:
            for h in held:
                self.local.unpin(h)

    def _publish_batch(self, batch: list[Held]) -> int:
        counters = self.counters
        try:
            self.local.make_room(self.index, sum(h.size + OBJECT_OVERHEAD for h in batch))
        except KVStoreError as err:      # beyond what this node may keep in the cluster (NoVictim too)
            counters.inc("remote_publish_failed", len(batch))
            log.debug("publishing %d blocks: no room in the cluster: %s", len(batch), err)
            return 0
        items: list[tuple[bytes, Any]] = []
        sent: list[Held] = []
        for h in batch:
            data = self.local.payload(h, prefer=self.dest, skip=self.index)
            if data is None:
                counters.inc("remote_publish_failed")
            else:
                items.append((h.key, data))
                sent.append(h)
        try:
            ok = self.remote.put_many(items) if items else []
        except KVStoreError as err:
            counters.inc("remote_publish_failed", len(items))
            log.debug("publishing %d blocks failed: %s", len(items), err)
            return 0
        failed = sum(1 for _, good in zip(items, ok) if not good)
        if failed:
            counters.inc("remote_publish_failed", failed)
        stored = self.local.record_copies(sent, ok, self.index)
        counters.inc("remote_published", stored)
        return stored

    # ------------------------------------------------------------------ write-through

    def put_done(self, keys: Sequence[bytes]) -> None:
        """A put call committed ``keys``: with write-through, return once the cluster
        holds them too (batched; bounded by the tier's deadlines)."""
        if self.write_through and keys:
            self.publish_now(keys)

    # ------------------------------------------------------------------ publish = "all"

    def _on_put(self, key: bytes) -> None:
        """A committed put (catalogue lock held): queue it."""
        if not self._skip(key):
            with self._cond:
                if len(self._queue) >= self.backlog:
                    self._queue.popleft()
                    self.counters.inc("remote_publish_failed")
                self._queue.append(key)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                keys = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                self.publish_now(keys)
            except Exception:  # noqa: BLE001 - keep publishing; the error is logged loudly
                log.exception("publishing to the cluster failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block was published or given up (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy,
                                       max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._thread is not None:
            if self._unwatch is not None:
                self._unwatch()
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout=30)


__all__ = ["Publisher"]
