"""A put's router metadata (META records of PutRaw frames) is never split across frames.

The daemon decodes each META record whole; a gRPC put of many blocks whose BlockMeta was
larger than the room left in a frame failed with "a BlockMeta record does not decode"
(300 blocks of 1 KiB, 4,000 token ids each).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.common.types import BlockMeta
from kvstore.common.wire import FOUND, META, decode, frames
from kvstore.service.startup import start_server
from support.daemon import daemon_config


def test_meta_records_start_a_new_frame_rather_than_split():
    meta = b"m" * 3000
    items = [(bytes([i]) * 32, META, 0, len(meta), meta) for i in range(5)]
    items = [x for i in range(5) for x in (items[i], (bytes([i]) * 32, FOUND, 0, 1000, b"d" * 1000))]
    out = [decode(f) for f in frames(iter(items), 8192, 4096)]
    assert all(len(f) <= 8192 for f in frames(iter(items), 8192, 4096))
    metas = [r for records in out for r in records if r.flags & META]
    assert len(metas) == 5 and all(bytes(r.data) == meta and r.offset == 0 for r in metas)
    blocks = b"".join(bytes(r.data) for records in out for r in records if not r.flags & META)
    assert blocks == b"d" * 5000
    with pytest.raises(ValueError, match="META record"):
        list(frames(iter([(b"k" * 32, META, 0, 9000, b"m" * 9000)]), 8192, 4096))


def test_a_grpc_put_of_many_blocks_with_large_metadata_stores_them_all(tmp_path):
    d = start_server(daemon_config(tmp_path, host="64MiB", nvme=None))
    try:
        n = 300
        keys = [i.to_bytes(4, "big") * 8 for i in range(n)]
        data = np.arange(n * 1024, dtype=np.uint32).astype(np.uint8).reshape(n, 1024)
        metas = [BlockMeta(engine_hash=i.to_bytes(8, "big"), parent_engine_hash=b"", token_ids=(i,) * 4000,
                           block_tokens=16) for i in range(n)]
        with KVStoreClient(d.address, timeout=60, shared_memory=False) as g:
            r = g.put([(k, data[i]) for i, k in enumerate(keys)], meta=metas)
            assert r.stored == n
            got = g.get(keys)
        assert [bytes(x.data) for x in got] == [bytes(row) for row in data]
        assert [d.manager.catalogue.raw(k).meta.engine_hash for k in keys] == [m.engine_hash for m in metas]
    finally:
        d.stop(0)
