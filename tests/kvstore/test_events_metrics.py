"""KV events for routers (vLLM's format over ZMQ) and Prometheus metrics, against a real daemon."""

from __future__ import annotations

import hashlib
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from support.daemon import daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from kvstore.common.types import BlockMeta

DEADLINE = 30.0


def K(i: int) -> bytes:
    return hashlib.sha256(f"ev-{i}".encode()).digest()


def block(i: int, n: int = 64 << 10) -> np.ndarray:
    return np.full(n, i % 251, dtype=np.uint8)


class Subscriber:
    def __init__(self, endpoint: str, topic: str = "kvstore"):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list]] = []

    def events(self, until, what: str) -> list[dict]:
        """Receive batches until ``until(events)`` holds; returns every event so far."""
        deadline = time.monotonic() + DEADLINE
        out = [e for _, evs in self.batches for e in evs]
        while not until(out):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {out[-5:]}"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                ts, events = msgpack.unpackb(payload, raw=False)[:2]
                assert isinstance(ts, float)
                self.batches.append((int.from_bytes(seq, "big"), events))
                out.extend(events)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="64MiB", extra={
        "events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"},
        "metrics": {"listen": "127.0.0.1:0"}, "blocks": {"block_tokens": 16}}))
    yield d
    d.stop(0)


def test_events_tell_routers_what_is_stored_where(daemon):
    sub = Subscriber(daemon.events.endpoint)
    try:
        time.sleep(0.2)                                   # a PUB socket drops what comes before the SUB
        metas = [BlockMeta(engine_hash=f"vllm-{i}".encode(), parent_engine_hash=f"vllm-{i - 1}".encode() if i else b"",
                           token_ids=tuple(range(16 * i, 16 * i + 16)), block_tokens=16) for i in range(3)]
        with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
            c.put_from([K(i) for i in range(3)], [block(i) for i in range(3)], meta=metas)
            stored = sub.events(lambda ev: sum(e["type"] == "BlockStored" for e in ev) >= 3, "3 BlockStored")
            first = next(e for e in stored if e["type"] == "BlockStored" and e["block_hashes"] == [b"vllm-0"])
            assert first == {"type": "BlockStored", "block_hashes": [b"vllm-0"], "parent_block_hash": None,
                             "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "CPU",
                             "lora_name": None}
            second = next(e for e in stored if e.get("block_hashes") == [b"vllm-1"])
            assert second["parent_block_hash"] == b"vllm-0" and second["medium"] == "CPU"
            # 20 more blocks than the 1 MiB host tier holds: the first ones are demoted to NVMe
            c.put_from([K(i) for i in range(3, 23)], [block(i) for i in range(3, 23)])
            evs = sub.events(lambda ev: any(e.get("block_hashes") == [b"vllm-0"] and e.get("medium") == "STORAGE"
                                            and e["type"] == "BlockStored" for e in ev), "vllm-0 stored on NVMe")
            assert any(e["type"] == "BlockStored" and e["block_hashes"] == [K(3)] for e in evs)  # our key: no meta
            assert c.delete([K(1)]) == 1
            evs = sub.events(lambda ev: any(e["type"] == "BlockRemoved" and e["block_hashes"] == [b"vllm-1"]
                                            for e in ev), "vllm-1 removed")
        seqs = [s for s, _ in sub.batches]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # replay: a subscriber that missed batches asks for them from a sequence number
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(daemon.events.replay_endpoint)
        dealer.send_multipart((b"", seqs[0].to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(int(DEADLINE * 1000)), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(seq, "big"))
            seen = dict(sub.batches)
            if replayed[-1] in seen:                      # the same batch, byte for byte decoded
                assert msgpack.unpackb(payload, raw=False)[1] == seen[replayed[-1]]
        dealer.close(linger=0)
        assert replayed[:len(seqs)] == seqs
        assert daemon.manager.counters["events_dropped"] == 0
    finally:
        sub.close()


def test_events_decode_with_vllms_own_structs(daemon):
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed here")
    import msgspec
    sub = Subscriber(daemon.events.endpoint)
    try:
        time.sleep(0.2)
        with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
            c.put_from([K(100)], [block(100)], meta=[BlockMeta(b"h", b"", tuple(range(16)), 16)])
        sub.events(lambda ev: any(e.get("block_hashes") == [b"h"] for e in ev), "the stored event")
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        for _, events in sub.batches:
            batch = decoder.decode(msgpack.packb([time.time(), events], use_bin_type=True))
            for e in batch.events:
                assert isinstance(e, (kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared))
    finally:
        sub.close()


def scrape(daemon) -> dict:
    with urllib.request.urlopen(f"http://{daemon.metrics.address}/metrics", timeout=DEADLINE) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_say_what_happened(daemon):
    with KVStoreClient(daemon.address, timeout=DEADLINE) as c:
        keys = [K(200 + i) for i in range(4)]
        c.put_from(keys, [block(i) for i in range(4)])
        assert c.lookup(keys + [K(999)]).hit_blocks == 4
        out = np.zeros((4, 64 << 10), dtype=np.uint8)
        assert c.get_into(keys, out).found == 4
    m = scrape(daemon)
    assert m[("kvstore:lookups_total", (("tenant", ""),))] == 1
    assert m[("kvstore:lookup_blocks_total", (("tenant", ""),))] == 5
    assert m[("kvstore:hit_blocks_total", (("tenant", ""),))] == 4
    assert m[("kvstore:hit_tokens_total", (("tenant", ""),))] == 4 * 16
    assert m[("kvstore:blocks_put_total", ())] == 4 and m[("kvstore:bytes_put_total", ())] == 4 * (64 << 10)
    assert m[("kvstore:stored_bytes_total", (("tier", "host"),))] >= 4 * (64 << 10)
    assert m[("kvstore:capacity_bytes", (("policy", "lru"), ("tier", "host")))] == 1 << 20
    assert m[("kvstore:blocks", (("policy", "lru"), ("tier", "host")))] == 4
    assert m[("kvstore:serving", ())] == 1.0
    assert m[("kvstore:request_seconds_count", (("method", "Lookup"), ("tenant", "")))] == 1
    def same_node(m) -> int:        # a lease, or a read from the block table (its note may follow)
        return sum(m.get(("kvstore:request_seconds_count", (("method", name), ("tenant", ""))), 0)
                   for name in ("Lease", "Touch"))
    deadline = time.monotonic() + DEADLINE
    while not same_node(m) and time.monotonic() < deadline:
        time.sleep(0.05)
        m = scrape(daemon)
    assert same_node(m) >= 1
