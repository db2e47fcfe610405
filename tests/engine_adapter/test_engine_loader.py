"""The page-back loader: layer groups, byte ranges of several layers, what each layer
delivers, the test fake's get_into against the real client, and a loader abandoned on a
timeout that copies late into its staging tensor."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ea_support import TINY, MemoryStore, engine, start_daemon
from engine_adapter.layout import BlockLayout
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.tp import TPGroup, shard_bounds
from engine_adapter.reference.transfer import LayerLoader, layer_groups
from kvstore.client.buffers import host_view
from kvstore.client.client import GetIntoResult, KVStoreClient
from kvstore.common.errors import InvalidRequest

LAYOUT = BlockLayout(num_layers=8, num_kv_heads=4, block_tokens=4, head_dim=8, dtype=torch.float32)


def stored(n: int, tag: str = "b") -> tuple[MemoryStore, list[bytes], torch.Tensor]:
    store = MemoryStore()
    keys = [f"{tag}{i}".encode().ljust(32, b"-") for i in range(n)]
    blocks = torch.randn((n,) + LAYOUT.block_shape(), generator=torch.Generator().manual_seed(n))
    store.put_from(keys, blocks, sizes=LAYOUT.block_bytes)
    return store, keys, blocks


def test_layer_groups_grow_by_doubling():
    assert layer_groups(1) == [(0, 1)]
    assert layer_groups(2) == [(0, 1), (1, 2)]
    assert layer_groups(4) == [(0, 1), (1, 4)]                  # no 1-layer call at the end
    assert layer_groups(7) == [(0, 1), (1, 3), (3, 7)]
    assert layer_groups(32) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 32)]
    assert layer_groups(80, first=2) == [(0, 2), (2, 6), (6, 14), (14, 30), (30, 80)]
    with pytest.raises(ValueError):
        layer_groups(0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_group_ranges_are_the_heads_of_those_layers(tp):
    block = torch.randn(LAYOUT.block_shape())
    payload = LAYOUT.to_payload(block)
    for rank in range(tp):
        h0, h1 = shard_bounds(4, rank, tp)
        ranges = LAYOUT.group_ranges((2, 5), (h0, h1))
        assert len(ranges) == (1 if tp == 1 else 6)        # all heads of adjacent layers merge
        data = b"".join(payload[o:o + n] for o, n in ranges)
        got = torch.frombuffer(bytearray(data), dtype=torch.float32).view(3, 2, h1 - h0, 4, 8)
        assert torch.equal(got, block[2:5, :, h0:h1])
    with pytest.raises(ValueError):
        LAYOUT.group_ranges((3, 3), (0, 4))


@pytest.mark.parametrize("tp", [1, 2])
def test_loader_delivers_every_layer_of_its_heads_in_one_call_per_group(tp):
    store, keys, blocks = stored(5)
    for rank in range(tp):
        store.calls.clear()
        heads = shard_bounds(4, rank, tp)
        loader = LayerLoader(store, keys, LAYOUT, heads, 5.0).start()
        for layer in range(LAYOUT.num_layers):
            got = loader.wait(layer, time.monotonic() + 30)
            assert (got.valid_blocks, got.problem) == (5, None)
            assert torch.equal(got.data[:, 0], blocks[:, layer, :, heads[0]:heads[1]])
        assert store.calls == ["get_into"] * 3 == ["get_into"] * loader.calls     # layers 0, 1-2, 3-7
        assert loader.bytes_received == 5 * LAYOUT.block_bytes // tp


def test_loader_refuses_a_staging_tensor_of_the_wrong_shape():
    store, keys, _ = stored(2)
    with pytest.raises(ValueError, match="staging"):
        LayerLoader(store, keys, LAYOUT, (0, 4), 5.0, staging=torch.empty(3, *LAYOUT.block_shape()))
    with pytest.raises(ValueError, match="cover"):
        LayerLoader(store, keys, LAYOUT, (0, 4), 5.0, groups=[(0, 2), (3, 8)])


@pytest.fixture(scope="module")
def client_and_fake(tmp_path_factory):
    """The same blocks in the real daemon and in the fake."""
    daemon = start_daemon(tmp_path_factory.mktemp("fake-vs-client"))
    fake, keys, blocks = stored(4, tag="contract")
    with KVStoreClient(daemon.address, shared_memory=False) as c:
        c.put_from(keys, blocks, sizes=LAYOUT.block_bytes)
    yield daemon.address, fake, keys
    daemon.stop(0)


@pytest.mark.parametrize("shared_memory", [False, True])
def test_fake_get_into_behaves_as_the_client(client_and_fake, shared_memory):
    """Same calls, same results and bytes: ranges, offsets, per-key buffers, a miss in the
    middle with and without stop_at_miss, and the errors."""
    address, fake, keys = client_and_fake
    missing = b"not-stored".ljust(32, b"-")
    asked = keys[:2] + [missing] + keys[2:]
    ranges = LAYOUT.group_ranges((1, 3), (1, 3))
    per = sum(n for _, n in ranges)
    with KVStoreClient(address, shared_memory=shared_memory) as real:
        assert real.shared_memory == shared_memory
        for stop in (True, False):
            outs = []
            for store in (real, fake):
                out = np.full(len(asked) * per + 64, 7, dtype=np.uint8)
                r = store.get_into(asked, out, ranges=ranges, offsets=[64 + i * per for i in range(len(asked))],
                                   stop_at_miss=stop)
                outs.append((r.found, r.sizes, out.tobytes()))
            assert outs[0] == outs[1]
            bufs = [[torch.zeros(LAYOUT.block_bytes // 4) for _ in asked] for _ in (real, fake)]
            got = [s.get_into(asked, b, stop_at_miss=stop) for s, b in zip((real, fake), bufs)]
            assert (got[0].found, got[0].sizes) == (got[1].found, got[1].sizes)
            assert all(torch.equal(a, b) for a, b in zip(*bufs))
        for store in (real, fake):
            r = store.get_into(keys[:1], np.empty(LAYOUT.block_bytes), ranges=[(LAYOUT.block_bytes - 4, 8)])
            assert (r.found, r.sizes) == (0, [0])                # too short for the ranges: a miss
            with pytest.raises(InvalidRequest):
                store.get_into(keys[:2], np.empty(LAYOUT.block_bytes, dtype=np.uint8))


class LateCopyStore(MemoryStore):
    """Once armed, the next ``get_into`` hangs until the following call has copied its
    blocks, then writes garbage over its own ``out`` (a copy that lands late) and
    reports every block found; only then does the following call return."""

    def __init__(self):
        super().__init__()
        self.armed = False
        self.stale_out = None
        self.next_copied = threading.Event()
        self.scribbled = threading.Event()

    def get_into(self, keys, out, **kw):
        if self.armed:
            self.armed = False
            self.stale_out = out
            self.next_copied.wait(30)
            host_view(out, writable=True).array[:] = 0xFF
            self.scribbled.set()
            return GetIntoResult(len(keys), [0] * len(keys), b"\2" * len(keys))
        result = super().get_into(keys, out, **kw)
        if self.stale_out is not None:
            self.next_copied.set()
            self.scribbled.wait(30)
        return result


def test_a_late_copy_of_an_abandoned_loader_never_reaches_the_next_page_back():
    rng = np.random.default_rng(3)
    p1 = rng.integers(0, TINY.vocab_size, 100).tolist()
    p2 = p1 + rng.integers(0, TINY.vocab_size, 40).tolist()
    p3 = p1 + rng.integers(0, TINY.vocab_size, 40).tolist()   # the same 6 blocks hit: same staging size
    ref = Runner(TINY, engine(), TPGroup.single()).generate(p3, 2, page_back=False, store=False)
    store = LateCopyStore()
    runner = Runner(TINY, engine(load_timeout_s=0.5), TPGroup.single(), store=store)
    runner.generate(p1, 1)
    assert runner.flush()
    store.armed = True
    out2 = runner.generate(p2, 1)                  # times out: recomputed
    assert out2.stats.paged_tokens == 0 and "load timeout" in out2.stats.problems[0]
    assert runner.flush()
    out3 = runner.generate(p3, 2)                  # the stale loader writes while this one loads
    assert store.scribbled.is_set()
    assert out3.stats.paged_tokens == len(p1) // 16 * 16
    assert out3.tokens == ref.tokens
    np.testing.assert_allclose(out3.logits, ref.logits, rtol=0, atol=1e-5)
    runner.close()
