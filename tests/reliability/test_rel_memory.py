"""Memory bound on big blocks (issue 9, item 6): a Get streams a block from its tier in
pieces, so concurrent gets of a block larger than the documented overhead bound leave the
daemon's peak RSS (VmHWM) within its RSS after start-up plus that bound.

The daemon runs the documented small-memory example config (docs/reliability.md, "Memory
bound": 8 gRPC workers, 4 MiB messages, bound 192 MiB) in its own process; the host tier
(preallocated and populated at start, so its pages are in the start-up RSS) holds one
256 MiB block, read by 3 clients at once over the raw-frame path and the protobuf path.
"""

from __future__ import annotations

import hashlib
import threading

import grpc
import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.common.transport import channel_options
from rel_support import DaemonProcess, key, short_socket_dir, write_toml
from test_rel_load import overhead_bound

MiB = 1 << 20
WORKERS = 8
MAX_MESSAGE = 4 * MiB
BLOCK = 256 * MiB
READERS = 3

pytestmark = pytest.mark.slow


def big_payload() -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(b"big block").digest(1 << 16), dtype=np.uint8).copy().repeat(BLOCK >> 16)


def test_concurrent_gets_of_a_block_larger_than_the_bound(tmp_path):
    bound = overhead_bound(WORKERS, MAX_MESSAGE)
    assert BLOCK > bound
    address = f"unix:{short_socket_dir()}/kvstore.sock"
    cfg = write_toml(tmp_path / "node.toml", {
        # (a reader on a saturated machine may not read for longer than the 30 s default idle
        # bound: this test is about memory, so a stream is never cancelled for idling here)
        "server": {"listen": address, "workers": WORKERS, "max_message_bytes": MAX_MESSAGE,
                   "stream_idle_timeout_s": 600},
        "tiers": {"host": {"capacity": BLOCK + 64 * MiB}, "nvme": {"enabled": False}},
    })
    d = DaemonProcess(cfg, address, tmp_path / "daemon.log").start()
    try:
        rss_start = d.status("VmRSS")
        data = big_payload()
        digest = hashlib.sha256(data).digest()
        k = key(1, "big")
        with KVStoreClient(address, max_message_bytes=MAX_MESSAGE, shared_memory=False, timeout=300) as c:
            assert c.put([(k, data)]).stored == 1
        del data
        errors: list[BaseException] = []
        digests: list[bytes] = []

        def raw_reader():
            with KVStoreClient(address, max_message_bytes=MAX_MESSAGE, shared_memory=False, timeout=300) as c:
                got = c.get([k])[0]
                digests.append(hashlib.sha256(got.data).digest())

        def proto_reader():
            h = hashlib.sha256()
            with grpc.insecure_channel(address, options=channel_options(MAX_MESSAGE)) as ch:
                for batch in pb_grpc.KVStoreStub(ch).Get(pb.GetRequest(keys=[k]), timeout=300):
                    for chunk in batch.chunks:
                        h.update(chunk.data)
            digests.append(h.digest())

        def run(fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)
        for readers in ([raw_reader] * READERS, [proto_reader] * READERS):
            threads = [threading.Thread(target=run, args=(fn,)) for fn in readers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
        assert not errors, errors
        assert digests == [digest] * (2 * READERS)
        peak = d.status("VmHWM")
        print(f"\nRSS after start {rss_start / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB "
              f"(+{(peak - rss_start) / MiB:.0f} MiB; bound +{bound / MiB:.0f} MiB) for a put and "
              f"{2 * READERS} gets of a {BLOCK // MiB} MiB block, {READERS} at a time")
        assert peak - rss_start <= bound, d.log_tail()
    finally:
        d.stop()
