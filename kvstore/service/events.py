"""KV events for cache-aware routers, in vLLM's format (ZMQ PUB, msgpack batches).

Routers such as llm-d's KV-cache manager and NVIDIA Dynamo subscribe to engines' KV
events to learn which node holds which prefix. The daemon publishes the same events for
the blocks it stores, so a router can send an agent's next turn to the node whose store
already holds its prefix.

**Format** (vLLM's ``ZmqEventPublisher``, ``vllm/distributed/kv_events.py``):

- a multipart message per batch: ``topic | sequence number (8 bytes, big-endian) |
  payload``; the payload is msgpack of ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``,
  an array), each event a map with a ``type`` tag:
  ``{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p, "token_ids": [...],
  "block_size": n, "lora_id": None, "medium": m, "lora_name": l}``,
  ``{"type": "BlockRemoved", "block_hashes": [h], "medium": m}``,
  ``{"type": "AllBlocksCleared"}``;
- ``medium``: ``GPU`` (HBM), ``CPU`` (host), ``STORAGE`` (NVMe, and the cluster tier with
  ``locality = "REMOTE"``);
- the block hash is the engine's own hash when the put carried it (``BlockMeta``:
  vLLM's block hash from our connector), else the store's 32-byte key;
- sequence numbers count batches from 0 at every start of the daemon, one per batch;
- with a replay endpoint (ZMQ ROUTER), a subscriber sends the first sequence number it
  wants (8 bytes, big-endian; a REQ or DEALER socket) and receives the batches still
  buffered (the last ``buffer_steps``) from there, then an end marker (sequence -1, empty
  payload).

**Snapshots.** A *snapshot* is ``AllBlocksCleared`` followed by ``BlockStored`` for every
copy the daemon holds (no token ids: they are not kept), in ordinary numbered batches.
The daemon publishes one

- at start (the blocks recovered from NVMe);
- whenever a subscriber joins (the PUB socket is a ZMQ XPUB and sees subscriptions; a
  router that reconnects after a restart of the daemon joins again);
- when its event queue overflowed: events are queued without blocking the store (the
  catalogue lock is held when they are emitted); a full queue drops the newest events,
  counts them (``events_dropped``) and is answered by a snapshot, never the store slowed;
- when a replay request asks for a batch no longer buffered;
- every ``snapshot_interval_s`` seconds when set (for subscribers behind a proxy, which
  the daemon cannot see join).

Events emitted after a snapshot starts follow it, so applying the snapshot and then the
batches after it gives the daemon's true set of blocks (``events_snapshots`` counts them).

**What a router does** (README, "Events and metrics"): keep, per node, the set of
``(block hash, medium)`` it holds; apply batches in sequence order (``AllBlocksCleared``
empties the set); on a gap (a batch numbered above the last applied + 1) ask the replay
endpoint for the missing ones and apply those it gets; a batch numbered at or below the
last applied one means the daemon restarted: apply on from it. If the replay lacks some of
the missing batches, a snapshot follows on the stream. Configured in ``[events]``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import msgpack
import zmq

from tiers.base import TierKind

from kvstore.config.node import EventsConfig
from kvstore.store.catalogue import BlockEvent
from kvstore.store.counters import Counters

log = logging.getLogger("kvstore.service.events")

MEDIUM = {TierKind.HBM: "GPU", TierKind.HOST: "CPU", TierKind.NVME: "STORAGE", TierKind.REMOTE: "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH = 1024
"""Most events in one batch (a snapshot's batches included)."""
SNAPSHOT_CHUNK = 1024
"""Blocks read per hold of the store's lock while a snapshot is taken."""
CLEARED = {"type": "AllBlocksCleared"}


def to_vllm(event: BlockEvent, block_tokens: int) -> dict[str, Any]:
    """One catalogue event as a vLLM ``KVCacheEvent`` map (``type`` tag first)."""
    meta = event.meta
    block_hash = meta.engine_hash if meta is not None and meta.engine_hash else event.key
    medium = MEDIUM.get(event.medium, "STORAGE")
    if event.kind == "stored":
        out = {"type": "BlockStored", "block_hashes": [block_hash],
               "parent_block_hash": (meta.parent_engine_hash or None) if meta is not None else None,
               "token_ids": list(meta.token_ids) if meta is not None else [],
               "block_size": (meta.block_tokens or block_tokens) if meta is not None else block_tokens,
               "lora_id": None, "medium": medium,
               "lora_name": (meta.lora_name or None) if meta is not None else None}
    else:
        out = {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": medium}
    if event.medium == TierKind.REMOTE:
        out["locality"] = "REMOTE"
    return out


def held_blocks(manager, chunk: int = SNAPSHOT_CHUNK) -> Iterator[list[BlockEvent]]:
    """A ``stored`` event for every copy ``manager`` holds, ``chunk`` blocks at a time.

    The store's lock is held per chunk only, so a snapshot of millions of blocks never
    stalls the store. Each block is read as it is at some moment after the call; with the
    events emitted after the call applied on top, the result is the store's true set.
    """
    keys = manager.catalogue.keys()
    get = manager.catalogue.get
    tiers = [(manager.tier_name(t), manager.tier_kind(t)) for t in range(manager.num_tiers)]
    for i in range(0, len(keys), chunk):
        with manager.lock:              # copied under the lock, events built after it
            held = [(e.key, e.size, e.meta, tuple(e.tiers)) for e in map(get, keys[i:i + chunk]) if e is not None]
        yield [BlockEvent("stored", key, *tiers[t], size, "held", meta=meta)
               for key, size, meta, where in held for t in where]


class KVEventPublisher:
    """Publishes the store's block events and snapshots (see the module docstring).

    Args:
        config: ``[events]``.
        block_tokens: the node's tokens per block (``block_size`` when a put gave none).
        counters: the daemon's counters (``events_published``, ``events_dropped``,
            ``events_snapshots``).
        held: the blocks held now, in chunks (:func:`held_blocks`); called on the
            publisher's thread for every snapshot.
    Raises zmq.ZMQError when an endpoint cannot be bound.
    """

    def __init__(self, config: EventsConfig, block_tokens: int, counters: Counters,
                 held: Callable[[], Iterable[list[BlockEvent]]]):
        self.config = config
        self.block_tokens = block_tokens
        self.counters = counters
        self._held = held
        self._queue: queue.Queue[BlockEvent] = queue.Queue(maxsize=config.max_queue)
        self._qlock = threading.Lock()           # the overflow flag and draining, against on_event
        self._overflowed = False
        self._due = "start"                      # why a snapshot is due; "": none
        self._last_snapshot = time.monotonic()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)    # every subscriber's subscription, not the first only
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)

    def start(self) -> "KVEventPublisher":
        """Start sending: a snapshot of the blocks held now, then the events that follow."""
        self._thread.start()
        return self

    def on_event(self, event: BlockEvent) -> None:
        """Catalogue listener: queue one event (never blocks). A full queue drops it and
        every event after it until the snapshot that replaces them is taken."""
        with self._qlock:
            if not self._overflowed:
                try:
                    self._queue.put_nowait(event)
                    return
                except queue.Full:
                    self._overflowed = True
        self.counters.inc("events_dropped")

    # ------------------------------------------------------------------ the publisher's thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        interval = self.config.snapshot_interval_s
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                for sock, _ in poller.poll(0):
                    if sock is self._pub:
                        self._read_subscriptions()
                    else:
                        self._serve_replay()
                if interval > 0 and time.monotonic() - self._last_snapshot >= interval:
                    self._due = self._due or "period"
                with self._qlock:
                    due = self._due or ("overflow" if self._overflowed else "")
                if due:
                    self._send_snapshot(due)
                    continue
            batch = self._take_batch()
            if batch:
                self._send([to_vllm(e, self.block_tokens) for e in batch])
            elif stopping:
                return

    def _take_batch(self) -> list[BlockEvent]:
        try:
            batch = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.config.batch_ms / 1e3
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _read_subscriptions(self) -> None:
        """A subscriber joined (``\\x01`` + its topic prefix, which our topic matches): a
        snapshot is due, so it starts with the true set of blocks."""
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01" and self._topic.startswith(msg[1:]):
                self._due = self._due or "subscriber"

    def _send_snapshot(self, reason: str) -> None:
        """``AllBlocksCleared`` and every block held, in numbered batches. The queue's
        events so far are covered by it and dropped; those queued from now on follow it."""
        with self._qlock:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._overflowed = False
            self._due = ""
        self._last_snapshot = time.monotonic()
        self.counters.inc("events_snapshots")
        batch: list[dict] = [CLEARED]
        blocks = 0
        for chunk in self._held():
            if self._stop.is_set():         # stopping: the rest would go to nobody
                return
            batch.extend(to_vllm(e, self.block_tokens) for e in chunk)
            blocks += len(chunk)
            while len(batch) >= MAX_BATCH:
                self._send(batch[:MAX_BATCH])
                batch = batch[MAX_BATCH:]
        if batch:
            self._send(batch)
        log.info("KV events: sent a snapshot of %d block copies (%s)", blocks, reason)

    def _send(self, events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))     # replayable even if this send fails
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as e:
            log.warning("publishing %d KV events failed: %s", len(events), e)
            return
        self.counters.inc("events_published", len(events))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("bad KV event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            oldest = self._buffer[0][0] if self._buffer else self._seq
            if first < oldest:            # those batches are gone: the asker needs a snapshot
                self._due = self._due or "replay"
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def stop(self) -> None:
        """Send what is queued (up to 5 seconds), then close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._close_sockets()
