"""A cache-aware router's view of one node, kept by the protocol the daemon documents
(kvstore/service/events.py, README "Events and metrics"): a ZMQ SUB socket on the event
stream and a DEALER on the replay endpoint, as llm-d's or Dynamo's indexers do.

The view is the set of ``(block hash, medium, locality)`` the node holds; :func:`true_blocks`
is the same set read from a daemon's catalogue, so a test compares the two.
"""

from __future__ import annotations

import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = {"hbm": "GPU", "host": "CPU", "nvme": "STORAGE", "remote": "STORAGE"}


def true_blocks(manager) -> set[tuple[bytes, str, str]]:
    """What a daemon holds, as a router indexes it (engine hash, else the store's key)."""
    out = set()
    with manager.lock:
        for e in manager.catalogue.entries():
            h = e.meta.engine_hash if e.meta is not None and e.meta.engine_hash else e.key
            for t in e.tiers:
                name = manager.tier_name(t)
                out.add((h, MEDIUM[name], "REMOTE" if name == "remote" else ""))
    return out


class Router:
    """Follows one node's KV events.

    Args:
        endpoint: the daemon's event endpoint; replay_endpoint: its replay endpoint.
        rcvhwm: the SUB socket's receive high-water mark (messages), or None.
    """

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "kvstore", rcvhwm: int | None = None):
        ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.sub = ctx.socket(zmq.SUB)
        if rcvhwm is not None:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.blocks: set[tuple[bytes, str, str]] = set()
        self.last: int | None = None
        self.seqs: list[int] = []          # every batch applied, in order (live and replayed)
        self.replays = 0
        self.restarts = 0
        self.cleared = 0

    def poll(self, timeout_ms: int = 100) -> bool:
        """Receive and apply the live batches waiting (up to ``timeout_ms`` for the first)."""
        got = False
        while self.sub.poll(timeout_ms if not got else 0):
            _, seq, payload = self.sub.recv_multipart()
            self._on_live(int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)[1])
            got = True
        return got

    def follow(self, until, what: str, deadline_s: float = 60.0) -> None:
        """Apply batches until ``until()`` holds; AssertionError after ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.poll(100)

    def _on_live(self, seq: int, events: list) -> None:
        if self.last is not None and seq <= self.last:       # numbered from 0 again: the daemon restarted
            self.restarts += 1
            self.last = None
        if self.last is not None and seq > self.last + 1:    # a gap: ask for the missing batches
            self._replay(self.last + 1, seq)
        self._apply(seq, events)

    def _replay(self, first: int, upto: int) -> None:
        self.replays += 1
        self.replay.send_multipart((b"", first.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(60_000), "no replay answer"
            _, _, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            s = int.from_bytes(seq, "big")
            if self.last < s < upto:                         # what is not there: a snapshot follows
                self._apply(s, msgpack.unpackb(payload, raw=False)[1])

    def _apply(self, seq: int, events: list) -> None:
        for e in events:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.cleared += 1
                continue
            for h in e["block_hashes"]:
                item = (h, e["medium"], e.get("locality", ""))
                if kind == "BlockStored":
                    self.blocks.add(item)
                else:
                    self.blocks.discard(item)
        self.last = seq
        self.seqs.append(seq)

    def disconnect(self) -> None:
        self.sub.disconnect(self.endpoint)

    def connect(self) -> None:
        self.sub.connect(self.endpoint)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
