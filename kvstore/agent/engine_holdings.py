"""Which blocks the engines still hold in their own KV caches, read from their KV events.

A block an engine still holds is never loaded from the store: the engine's prefix cache
hits it first. Paging it back for a waiting trajectory spends fast-tier room (and displaces
blocks that will be loaded) for nothing. On the agent benchmark of ``bench/agent_serving.py``
more than half of the blocks prefetch copied up were held by vLLM at the time. This module
lets the daemon see what its engines hold, so that the prefetch scheduler pages back only
what an engine would load (:class:`kvstore.agent.page_back.Pager`), and pages a block back
as soon as its engine drops it while its trajectory waits.

**Source.** vLLM publishes its prefix cache's changes as KV events (``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``):
ZMQ PUB, multipart ``topic | sequence (8 bytes, big-endian) | msgpack [ts, [event, ...]]``,
events ``BlockStored`` / ``BlockRemoved`` (``block_hashes``, ``medium``) and
``AllBlocksCleared`` (``vllm/distributed/kv_events.py``). The daemon subscribes to each
endpoint in ``[engines] kv_events`` (one SUB socket each, the same pattern as the KV-aware
routers of llm-d and Dynamo, which index engines' events the same way). The vLLM connector
sends vLLM's block hash of every block it saves (``BlockMeta.engine_hash``), so a stored
block's key maps to the hash the engine's events name: the low 64 bits of the hash, as
vLLM's events carry it by default (:func:`event_hash`).

**Advice, never correctness.** Holdings only decide what prefetch skips. Whatever is
uncertain counts as *not held*, which is the behaviour without this module: the blocks of
an engine whose events have a gap (a sequence number skipped: events were lost), that
restarted (its sequence numbers start again), or that disconnected are forgotten;
a block saved without an engine hash is never held. A wrong "held" (an engine that drops a
block without an event) costs a load from a slower tier, never wrong KV.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger("kvstore.agent.engine_holdings")

HELD_MEDIA = frozenset({"GPU", "CPU"})
"""Media of an engine's own caches (vLLM: its GPU prefix cache, its native CPU offload)."""

MAX_HELD = 1 << 24
"""Block hashes remembered per engine at most (an engine that never removes: bounded)."""

MAX_REMOVED = 1 << 16
"""Removals kept for :meth:`EngineHoldings.take_removed`; more between two takes count as
"everything may have been dropped"."""


def event_hash(engine_hash) -> int:
    """A block hash as vLLM's KV events carry it: an int as is, bytes as their low 64 bits
    (big-endian), both reduced to 64 bits."""
    if isinstance(engine_hash, int):
        return engine_hash & ((1 << 64) - 1)
    return int.from_bytes(bytes(engine_hash)[-8:], "big")


class _Engine:
    """One engine's event stream: its held hashes and the last sequence number seen."""

    __slots__ = ("endpoint", "held", "stored_at", "seq")

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.held: dict[int, int] = {}      # hash -> how many of HELD_MEDIA hold it
        self.stored_at: dict[int, float] = {}   # held hash -> when its last BlockStored arrived
        self.seq: int | None = None


class EngineHoldings:
    """The engines' own holdings, from their KV event streams (see the module docstring).

    Args:
        endpoints: ZMQ endpoints of the engines' KV event publishers (``tcp://host:port``,
            ``ipc://path``); each gets its own SUB socket.
        topic: the topic the engines publish under (vLLM's ``topic``; "" subscribes to all).
        context: a ``zmq.Context`` (default: the process's shared instance).

    Attributes:
        batches, gaps, forgotten, malformed: event batches applied, batches lost (sequence
            numbers skipped), engines forgotten (gap, restart, disconnect), batches that did
            not parse (ignored).
    Raises ValueError for an endpoint that is not a string of the form ``scheme://address``.
    """

    def __init__(self, endpoints: Iterable[str], topic: str = "", context=None):
        import zmq

        self.endpoints = list(endpoints)
        for e in self.endpoints:
            if not isinstance(e, str) or "://" not in e:
                raise ValueError(f"engine KV event endpoint {e!r} is not scheme://address (e.g. tcp://127.0.0.1:5557)")
        self.topic = topic
        self._removed: list[int] = []
        self._everything = False
        self.batches = self.gaps = self.forgotten = self.malformed = 0
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._engines = [_Engine(e) for e in self.endpoints]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.clock: Callable[[], float] = time.monotonic
        self.on_removed: Callable[[list[int]], None] | None = None
        """Called (on the subscriber thread, outside the lock) with the hashes of the blocks
        one batch dropped, when it dropped some: the prefetch scheduler wakes for those it
        left to the engine. It must not block."""

    # ------------------------------------------------------------------ readings

    def holds(self, engine_hash) -> bool:
        """Whether some engine holds the block whose engine hash is ``engine_hash`` (bytes
        or int; empty or None: False)."""
        if engine_hash is None or engine_hash == b"":
            return False
        h = event_hash(engine_hash)
        return any(h in e.held for e in self._engines)

    def held_for(self, engine_hash) -> float | None:
        """Seconds since an engine last announced it stored the block (``BlockStored``), while
        one holds it; None when none does. A block stored moments ago belongs to a request that
        is running, or just ran."""
        if engine_hash is None or engine_hash == b"":
            return None
        h = event_hash(engine_hash)
        times = [t for t in (e.stored_at.get(h) for e in self._engines) if t is not None]
        return self.clock() - max(times) if times else None

    def take_removed(self) -> tuple[list[int], bool]:
        """The hashes of the blocks the engines dropped since the last call, and whether
        that list is incomplete (an engine was forgotten or there were more than
        :data:`MAX_REMOVED`): then any held block may have been dropped."""
        with self._lock:
            removed, everything = self._removed, self._everything
            self._removed, self._everything = [], False
        return removed, everything

    def held_count(self) -> int:
        """Blocks held, summed over the engines."""
        with self._lock:
            return sum(len(e.held) for e in self._engines)

    # ------------------------------------------------------------------ events

    def apply(self, engine: int, seq: int, payload: bytes) -> None:
        """Apply one batch of engine ``engine`` (index into ``endpoints``) with sequence
        number ``seq``: a gap or a restart first forgets what that engine held."""
        import msgpack

        e = self._engines[engine]
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = batch[1]
            if not isinstance(events, list):
                raise TypeError("events are not a list")
        except Exception as err:  # noqa: BLE001 - a peer's bad bytes: counted, never fatal
            self.malformed += 1
            log.debug("engine KV event batch from %s did not parse: %s", e.endpoint, err)
            return
        with self._lock:
            if e.seq is not None and seq != e.seq + 1:
                if seq > e.seq + 1:
                    self.gaps += seq - e.seq - 1
                self._forget(e, "lost events" if seq > e.seq else "its sequence numbers restarted")
            e.seq = seq
            self.batches += 1
            before = len(self._removed)
            for ev in events:
                self._apply_event(e, ev)
            dropped = self._removed[before:] if len(self._removed) > before else None
            if self._everything and dropped is None:
                dropped = []
        notify = self.on_removed
        if dropped is not None and notify is not None:
            try:
                notify(dropped)
            except Exception:  # noqa: BLE001 - advice: a failing listener never stops the events
                log.exception("engine KV event listener failed")

    def _apply_event(self, e: _Engine, ev) -> None:
        if isinstance(ev, dict):
            kind, hashes, medium = ev.get("type"), ev.get("block_hashes") or (), ev.get("medium")
        elif isinstance(ev, (list, tuple)) and ev:      # vLLM's array form: [tag, hashes, ...]
            kind = ev[0]
            hashes = ev[1] if len(ev) > 1 and isinstance(ev[1], list) else ()
            medium = None
        else:
            return
        if kind == "AllBlocksCleared":
            e.stored_at.clear()
            if e.held:
                e.held.clear()
                self._everything = True
            return
        if (medium or "GPU") not in HELD_MEDIA or not isinstance(hashes, (list, tuple)):
            return
        for raw in hashes:
            if not isinstance(raw, (int, bytes)):
                continue
            h = event_hash(raw)
            if kind == "BlockStored":
                if len(e.held) < MAX_HELD or h in e.held:
                    e.held[h] = e.held.get(h, 0) + 1
                    e.stored_at[h] = self.clock()
            elif kind == "BlockRemoved":
                n = e.held.get(h)
                if n is None:
                    continue
                if n > 1:
                    e.held[h] = n - 1
                    continue
                del e.held[h]
                e.stored_at.pop(h, None)
                if len(self._removed) < MAX_REMOVED:
                    self._removed.append(h)
                else:
                    self._everything = True

    def forget(self, engine: int, why: str) -> None:
        """Forget what engine ``engine`` holds (it disconnected, or lost events)."""
        with self._lock:
            self._forget(self._engines[engine], why)
            self._engines[engine].seq = None

    def _forget(self, e: _Engine, why: str) -> None:
        self.forgotten += 1
        e.stored_at.clear()
        if e.held:
            log.info("forgetting the %d blocks engine %s held (%s): prefetch pages them back as needed",
                     len(e.held), e.endpoint, why)
            e.held.clear()
            self._everything = True

    # ------------------------------------------------------------------ thread

    def start(self, timeout_s: float = 10.0) -> None:
        """Subscribe to every endpoint on a daemon thread (``kvstore-engine-events``)."""
        if self._thread is not None or not self._engines:
            return
        self._thread = threading.Thread(target=self._run, name="kvstore-engine-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the subscriber thread runs."""
        return self._thread is not None

    def stop(self) -> None:
        """Stop the thread and close the sockets (the daemon's background items stop so)."""
        self.close()

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        zmq = self._zmq
        socks, monitors = [], []
        poller = zmq.Poller()
        try:
            for i, e in enumerate(self._engines):
                s = self._ctx.socket(zmq.SUB)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVHWM, 0)         # never drop: a dropped batch is a gap
                s.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
                mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                s.connect(e.endpoint)               # connects again by itself after a disconnect
                socks.append(s)
                monitors.append(mon)
                poller.register(s, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
            self._ready.set()
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock in monitors:
                        i = monitors.index(sock)
                        sock.recv_multipart()
                        self.forget(i, "disconnected")
                        continue
                    i = socks.index(sock)
                    parts = sock.recv_multipart()
                    if len(parts) < 3 or len(parts[1]) != 8:
                        self.malformed += 1
                        continue
                    self.apply(i, int.from_bytes(parts[1], "big", signed=True), parts[2])
        except Exception:  # noqa: BLE001 - holdings are advice: prefetch goes on without them
            log.exception("engine KV event subscriber stopped; prefetch no longer knows what engines hold")
            with self._lock:
                for e in self._engines:
                    self._forget(e, "the subscriber stopped")
        finally:
            self._ready.set()
            for s in socks:
                s.disable_monitor()
                s.close(0)
            for m in monitors:
                m.close(0)
