"""KV events for cache-aware routers, in vLLM's format (ZMQ PUB, msgpack batches).

Routers such as llm-d's KV-cache manager and NVIDIA Dynamo subscribe to engines' KV
events to learn which node holds which prefix. The daemon publishes the same events for
the blocks it stores, so a router can send an agent's next turn to the node whose store
already holds its prefix:

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
- at start the publisher sends ``AllBlocksCleared`` and then ``BlockStored`` for every
  block recovered from NVMe, so a router's view of this node starts right;
- with a replay endpoint (ZMQ ROUTER), a subscriber that missed batches sends the first
  sequence number it wants (8 bytes, big-endian) and receives the buffered batches
  from there, then an end marker (sequence -1, empty payload).

Events are queued without blocking the store (the catalogue lock is held when they are
emitted) and sent by one thread; when the queue is full the newest events are dropped
and counted (``events_dropped``), never the store slowed. Configured in ``[events]``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import msgpack
import zmq

from tiers.base import TierKind

from kvstore.store.catalogue import BlockEvent
from kvstore.config.node import EventsConfig
from kvstore.store.counters import Counters

log = logging.getLogger("kvstore.service.events")

MEDIUM = {TierKind.HBM: "GPU", TierKind.HOST: "CPU", TierKind.NVME: "STORAGE", TierKind.REMOTE: "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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


class KVEventPublisher:
    """Publishes the store's block events (see the module docstring).

    Args:
        config: ``[events]``.
        block_tokens: the node's tokens per block (``block_size`` when a put gave none).
        counters: the daemon's counters (``events_published``, ``events_dropped``).
    Raises zmq.ZMQError when an endpoint cannot be bound.
    """

    def __init__(self, config: EventsConfig, block_tokens: int, counters: Counters):
        self.config = config
        self.block_tokens = block_tokens
        self.counters = counters
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
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

    def start(self, stored: list[BlockEvent]) -> "KVEventPublisher":
        """Start sending: ``AllBlocksCleared``, then ``stored`` (the blocks held now)."""
        self._queue.put({"type": "AllBlocksCleared"})
        for ev in stored:
            self.on_event(ev)
        self._thread.start()
        return self

    def on_event(self, event: BlockEvent) -> None:
        """Catalogue listener: queue one event (never blocks)."""
        try:
            self._queue.put_nowait(to_vllm(event, self.block_tokens))
        except queue.Full:
            self.counters.inc("events_dropped")

    def _run(self) -> None:
        wait = self.config.batch_ms / 1e3
        while not self._stop.is_set() or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + wait
            while len(batch) < 1024:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self._send(batch)

    def _send(self, events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as e:
            log.warning("publishing %d KV events failed: %s", len(events), e)
            return
        self._buffer.append((seq, payload))
        self.counters.inc("events_published", len(events))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("bad KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def stop(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._close_sockets()
