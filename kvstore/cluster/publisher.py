"""Copies of local blocks into the cluster, in batches: write-through and ``publish = "all"``.

Placement copies a block to the cluster one at a time when it is demoted (through the
copy queues). Publishing copies many at once instead: :meth:`Publisher.publish_now`
pins the blocks, makes room in this node's share of the cluster (evicting its coldest
blocks there), stores them with one ``put_many`` per staging-full (no lock held), and
records each stored copy in the catalogue (a clean lower copy, so evicting the local one
later costs nothing). Two users:

- ``[policy] write = "write_through"``: a put call returns once the cluster holds its
  blocks too (:meth:`Publisher.put_done`, called at the end of each put call);
- ``publish = "all"``: every committed put is queued (a catalogue event) and published
  by a background thread, batched; a put never waits for it.

A cluster that is down or slow makes these copies fail within the tier's deadlines
(counted in ``remote_publish_failed``); local puts are not failed by it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tiers import errors as terr

from kvstore.store.catalogue import BlockEvent, Entry
from kvstore.common.errors import KVStoreError
from kvstore.policy import NoVictim

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.cluster.cluster import Cluster

log = logging.getLogger("kvstore.cluster.cluster")

OBJECT_OVERHEAD = 64
"""Bytes a cluster object may add to a block (the remote tier's header), for batch sizing."""


class Publisher:
    """Batched copies of local blocks into the cluster of ``cluster`` (see the module
    docstring). ``background``: run the ``publish = "all"`` queue; ``write_through``:
    :meth:`put_done` publishes synchronously."""

    def __init__(self, cluster: "Cluster", *, background: bool, write_through: bool, backlog: int):
        self.c = cluster
        self.m = cluster.m
        self.write_through = write_through
        self.backlog = backlog
        self._queue: collections.deque[bytes] = collections.deque()
        self._busy = False
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if background and not write_through:
            self.m.events.subscribe(self._on_event)
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
            loc = self.m.locate(key)
            if loc is None:
                continue
            if batch and total + loc[0] + OBJECT_OVERHEAD > self.c.chunk_bytes:
                stored += self._publish_keys(batch)
                batch, total = [], 0
            batch.append(key)
            total += loc[0] + OBJECT_OVERHEAD
        if batch:
            stored += self._publish_keys(batch)
        return stored

    def _publish_keys(self, keys: list[bytes]) -> int:
        cat = self.m.catalogue
        entries: list[Entry] = []
        with cat.lock:
            for key in keys:
                e = cat.get(key)
                if e is not None and self.c.index not in e.tiers and not self.c.paging(key):
                    cat.pin_entry(e)
                    entries.append(e)
        try:
            return self._publish_batch(entries) if entries else 0
        finally:
            for e in entries:
                cat.unpin(e)

    def _publish_batch(self, batch: list[Entry]) -> int:
        c, cat, p = self.c, self.m.catalogue, self.m.placement
        counters = self.m.counters
        with cat.lock:
            try:
                p.make_room_locked(c.index, sum(e.size + OBJECT_OVERHEAD for e in batch), incoming=None)
            except (KVStoreError, NoVictim) as err:      # beyond what this node may keep in the cluster
                counters.inc("remote_publish_failed", len(batch))
                log.debug("publishing %d blocks: no room in the cluster: %s", len(batch), err)
                return 0
        items: list[tuple[bytes, Any]] = []
        for e in batch:
            data = self._payload(e)
            if data is None:
                counters.inc("remote_publish_failed")
            else:
                items.append((e.key, data))
        try:
            ok = c.store.put_many(items) if items else []
        except terr.MediaError as err:
            counters.inc("remote_publish_failed", len(items))
            log.debug("publishing %d blocks failed: %s", len(items), err)
            return 0
        stored = 0
        now = self.m.clock()
        by_key = {e.key: e for e in batch}
        with cat.lock:
            for (key, _), good in zip(items, ok):
                e = by_key[key]
                if not good:
                    counters.inc("remote_publish_failed")
                elif cat.raw(key) is e and not e.deleted and e.tiers and c.index not in e.tiers:
                    p.policies[c.index].insert(key, e.size, now)
                    p.add_copy(e, c.index, "write_through")
                    stored += 1
                elif c.index not in e.tiers:
                    c.tier.free(key)         # deleted meanwhile: its cluster copy goes too (in the background)
        counters.inc("remote_published", stored)
        return stored

    def _payload(self, e: Entry) -> Any:
        """The block's bytes: a zero-copy view of the host arena's copy, else read from
        its fastest tier. None when no copy can be read."""
        dest = self.c.dest
        if dest is not None and dest in e.tiers:
            try:
                return self.m.tiers[dest].capabilities.host.view(e.key)
            except terr.MediaError:
                pass
        for i in list(e.tiers):
            if i == self.c.index:
                continue
            buf = np.empty(e.size, np.uint8)
            try:
                self.m.tiers[i].read_into(e.key, buf)
                return buf
            except terr.MediaError as err:
                log.debug("reading block %s to publish it failed: %s", e.key.hex()[:16], err)
        return None

    # ------------------------------------------------------------------ write-through

    def put_done(self, keys: Sequence[bytes]) -> None:
        """A put call committed ``keys``: with write-through, return once the cluster
        holds them too (batched; bounded by the tier's deadlines)."""
        if self.write_through and keys:
            self.publish_now(keys)

    # ------------------------------------------------------------------ publish = "all"

    def _on_event(self, event: BlockEvent) -> None:
        """A committed put (catalogue lock held): queue it."""
        if event.kind == "stored" and event.reason == "put" and not self.c.paging(event.key):
            with self._cond:
                if len(self._queue) >= self.backlog:
                    self._queue.popleft()
                    self.m.counters.inc("remote_publish_failed")
                self._queue.append(event.key)
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
            self.m.events.unsubscribe(self._on_event)
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout=30)


__all__ = ["Publisher"]
