"""A subscriber of the daemon's KV events (ZMQ SUB, msgpack ``[ts, [event, ...]]`` batches),
for the tests of what the engine plug-ins' puts announce. Import as
``from support.kv_events import Subscriber``."""

from __future__ import annotations

import hashlib
import time


class Subscriber:
    """A ZMQ SUB socket on the daemon's KV events (msgpack ``[ts, [event, ...]]`` batches)."""

    def __init__(self, endpoint: str, topic: str = "kvstore"):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.events: list[dict] = []

    def _receive(self, timeout_ms: int) -> None:
        import msgpack

        while self.sock.poll(timeout_ms):
            _, _, payload = self.sock.recv_multipart()
            self.events.extend(msgpack.unpackb(payload, raw=False)[1])
            timeout_ms = 0

    def wait(self, until, what: str, deadline_s: float = 60.0) -> list[dict]:
        """Receive events until ``until(events)`` holds (generous deadline); returns them all."""
        deadline = time.monotonic() + deadline_s
        while not until(self.events):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.events[-5:]}"
            self._receive(100)
        return self.events

    def join(self, client, deadline_s: float = 60.0) -> None:
        """Wait until this subscription receives (a PUB socket drops what it sends before the
        SUB has joined): put probe blocks, one every 0.2 s, until an event of one arrives."""
        deadline = time.monotonic() + deadline_s
        probes: list[bytes] = []
        while not any(e.get("block_hashes", [None])[0] in probes for e in self.events):
            assert time.monotonic() < deadline, "the KV event subscription never received"
            probes.append(hashlib.sha256(b"probe %d" % len(probes)).digest())
            client.put([(probes[-1], b"\1" * 64)])
            self._receive(200)

    def close(self) -> None:
        self.sock.close(linger=0)
