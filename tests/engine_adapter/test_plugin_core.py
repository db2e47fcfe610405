"""The engine plugins' parts that need no engine: store_io, engine keys, TP heads, worker transfers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ea_support import run_step
from engine_adapter import store_io
from engine_adapter.engine_keys import IncrementalKeys, engine_namespace, key_from_engine_hash
from engine_adapter.layout import BlockLayout
from engine_adapter.vllm.plan import BlockTransfer, StepPlan
from engine_adapter.vllm.settings import tp_heads
from engine_adapter.vllm.worker import WorkerTransfers, assemble_heads
from kvstore.common.errors import StoreUnavailable
from kvstore.common.keys import BlockKeyer, chain_key

BS, NB, H, HD, L = 16, 12, 2, 64, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
CPU_SHAPE = (NB, H, BS, 2 * HD)
KEYS = [bytes([i]) * 32 for i in range(1, 4)]


def ns(scheme="block_hash", **kw):
    base = dict(model="m", dtype="float32", block_tokens=4, num_layers=2, num_kv_heads=2, head_dim=8,
                scheme=scheme, engine="vllm")
    base.update(kw)
    return engine_namespace(**base)


# ---------------------------------------------------------------- store_io

def test_save_and_load_rows_numpy_and_torch(client):
    src = np.arange(3 * 256, dtype=np.float32).reshape(3, 256)
    assert store_io.save_blocks(client, KEYS, src).stored == 3
    assert store_io.save_blocks(client, KEYS, src).already_present == 3
    assert store_io.lookup_prefix(client, KEYS + [b"\x09" * 32]) == 3
    out = torch.zeros(4, 256)
    assert store_io.load_blocks(client, KEYS + [b"\x09" * 32], out) == [True, True, True, False]
    assert torch.equal(out[:3], torch.from_numpy(src)) and not out[3].any()
    part = np.zeros((3, 2), dtype=np.float32)                   # bytes [8, 16) of each block: elements 2, 3
    assert store_io.load_blocks(client, KEYS, part, ranges=[(8, 8)]) == [True] * 3
    assert part.tolist() == src[:, 2:4].tolist()


def test_short_block_misses_alone_in_a_ranged_batch(client):
    store_io.save_blocks(client, KEYS, np.ones((3, 64), dtype=np.uint8))
    short = b"\x07" * 32
    client.put([(short, b"\x01" * 10)])
    out = np.zeros((4, 16), dtype=np.uint8)
    assert store_io.load_blocks(client, [KEYS[0], short, KEYS[1], KEYS[2]], out, ranges=[(32, 16)]) == \
        [True, False, True, True]


def test_buffers_are_checked(client):
    with pytest.raises(ValueError, match="2 rows for 3 blocks"):
        store_io.load_blocks(client, KEYS, np.zeros((2, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        store_io.save_blocks(client, KEYS, np.zeros((8, 3), dtype=np.uint8).T)
    assert store_io.load_blocks(client, [], np.zeros((0, 8))) == []


def test_daemon_down_raises(tmp_path):
    c = store_io.connect(f"unix:{tmp_path}/absent.sock", timeout_s=0.5)
    with pytest.raises(StoreUnavailable):
        store_io.lookup_prefix(c, KEYS)
    with pytest.raises(StoreUnavailable):
        store_io.load_blocks(c, KEYS, np.zeros((3, 8), dtype=np.uint8))


# ---------------------------------------------------------------- keys

def test_block_hash_keys_are_rooted_in_the_namespace():
    h = [bytes([i]) * 32 for i in range(3)]
    a = IncrementalKeys(ns()).extend(block_hashes=h)
    assert a == [key_from_engine_hash(ns().fingerprint(), x) for x in h] and len(set(a)) == 3
    assert IncrementalKeys(ns(tenant="t")).extend(block_hashes=h)[0] != a[0]
    assert IncrementalKeys(ns(engine="sglang")).extend(block_hashes=h)[0] != a[0]
    assert IncrementalKeys(ns(kv_format="vllm-cpu/vec")).extend(block_hashes=h)[0] != a[0]
    with pytest.raises(TypeError):
        key_from_engine_hash(ns().fingerprint(), 123)


def test_token_keys_are_blockkeyer_keys_and_extend_incrementally():
    tokens = list(range(10, 30))
    keys = IncrementalKeys(ns("tokens"), {"lora": "x"})
    assert keys.extend(tokens=tokens[:9]) == BlockKeyer(ns("tokens")).keys(tokens[:9], {"lora": "x"})
    assert keys.extend(tokens=tokens) == BlockKeyer(ns("tokens")).keys(tokens, {"lora": "x"})
    assert len(keys.keys) == 5
    assert IncrementalKeys(ns("tokens")).extend(tokens=tokens) != keys.keys
    with pytest.raises(ValueError, match="key scheme"):
        ns("other")


@pytest.mark.parametrize("extra", [None, {"lora": "x", "cache_salt": "s"}])
def test_bulk_keys_are_the_chain_of_the_definition_as_a_request_grows(extra):
    """The keys a request's blocks get, computed in bulk as vLLM's request grows by odd
    steps, are chain_key's block by block (tokens) and key_from_engine_hash's (hashes):
    the keys of blocks stored by earlier releases."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**32, 4 * 23 + 3, dtype=np.uint64).tolist()
    root = ns("tokens").fingerprint()
    want, parent = [], root
    for i in range(len(tokens) // 4):
        parent = chain_key(parent, tokens[4 * i:4 * i + 4], extra)
        want.append(parent)
    keys = IncrementalKeys(ns("tokens"), extra)
    for end in (0, 3, 4, 9, 9, 40, len(tokens)):
        assert keys.extend(tokens=tokens[:end]) == want[:end // 4]
    hashes = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (32, 32, 8, 0, 64, 32)]
    by_hash = IncrementalKeys(ns())
    for end in (1, 1, 4, len(hashes)):
        assert by_hash.extend(block_hashes=hashes[:end]) == [key_from_engine_hash(ns().fingerprint(), h)
                                                             for h in hashes[:end]]
    with pytest.raises(TypeError, match="bytes"):
        IncrementalKeys(ns()).extend(block_hashes=[b"\x01" * 32, 7])
    with pytest.raises(ValueError, match="2\\*\\*32"):
        IncrementalKeys(ns("tokens")).extend(tokens=[1, 2, 3, -4])


def test_tp_heads_split_and_replicate():
    assert [tp_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [tp_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError):
        tp_heads(3, 2, 0)


# ---------------------------------------------------------------- worker transfers, TP

def _rank_caches(full: dict, h0: int, h1: int) -> dict:
    return {n: c[:, h0:h1].clone() for n, c in full.items()}


def test_blocks_written_at_tp2_are_read_at_tp1_and_back(daemon, client):
    layout = BlockLayout(num_layers=L, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    full = {n: torch.randn(CPU_SHAPE, generator=gen) for n in NAMES}
    conn = store_io.connect(daemon.address)
    parts = {}

    def gather_for(rank):
        def gather(staging):
            parts[rank] = staging.clone()
            if rank != 0:
                return None
            return assemble_heads([parts[0], parts[1]], [(0, 1), (1, 2)], H)
        return gather

    saves = StepPlan(saves=[BlockTransfer("r", tuple(KEYS), (0, 4, 8))])
    for rank in (1, 0):                            # rank 1 contributes first; rank 0 assembles and puts
        caches = _rank_caches(full, rank, rank + 1)
        w = WorkerTransfers(conn, NAMES, caches, "cpu", layout, (rank, rank + 1), is_first_rank=rank == 0,
                            gather_heads=gather_for(rank))
        _drive(w, saves)
    # TP=1 reads all heads
    one = {n: torch.zeros(CPU_SHAPE) for n in NAMES}
    w1 = WorkerTransfers(conn, NAMES, one, "cpu", layout, (0, H))
    assert _drive(w1, StepPlan(loads=[BlockTransfer("s", tuple(KEYS), (1, 2, 3))])) == set()
    for n in NAMES:
        assert torch.equal(one[n][[1, 2, 3]], full[n][[0, 4, 8]])
    # and TP=2 ranks read their own heads of what TP=1 wrote
    keys_tp1 = tuple(bytes([40 + i]) * 32 for i in range(3))
    _drive(WorkerTransfers(conn, NAMES, one, "cpu", layout, (0, H)),
           StepPlan(saves=[BlockTransfer("w", keys_tp1, (1, 2, 3))]))
    for rank in (0, 1):
        mine = {n: torch.zeros((NB, 1, BS, 2 * HD)) for n in NAMES}
        w = WorkerTransfers(conn, NAMES, mine, "cpu", layout, (rank, rank + 1))
        assert _drive(w, StepPlan(loads=[BlockTransfer("s", keys_tp1, (5, 6, 7))])) == set()
        for n in NAMES:
            assert torch.equal(mine[n][[5, 6, 7]], full[n][[0, 4, 8]][:, rank:rank + 1])
    conn.close()


def _drive(w: WorkerTransfers, plan: StepPlan) -> set[int]:
    return run_step(w, NAMES, plan)


def test_kv_views_address_vllm_layouts():
    from engine_adapter.vllm.kv_views import detect_layout, kernel_view

    kv = torch.zeros(CPU_SHAPE)
    view, lay = kernel_view(kv, "token", HD)                 # (2, blocks, heads, block_size, head_dim)
    assert lay == "HND" and tuple(view.shape) == (2, NB, H, BS, HD)
    view[1, 3, 1, 5] = 7.0                                   # v of block 3, head 1, token 5
    assert kv[3, 1, 5, HD:].eq(7).all() and kv.sum() == 7 * HD
    kv.zero_()
    view, _ = kernel_view(kv, "cpu", HD)                      # per (block, head): all keys, then all values
    view[1, 3, 1, 5, 2] = 9.0
    assert kv.view(NB, H, 2, BS, HD)[3, 1, 1, 5, 2] == 9 and kv.sum() == 9
    assert kernel_view(torch.zeros(2, NB, BS, H, HD), "kv_first", HD)[1] == "NHD"
    assert detect_layout(kv) == "cpu" and detect_layout(torch.zeros(2, NB, BS, H, HD)) == "kv_first"
    with pytest.raises(ValueError, match="'token' layout needs"):
        kernel_view(torch.zeros(NB, H, BS, HD), "token", HD)
    with pytest.raises(ValueError, match="contiguous"):
        kernel_view(torch.zeros(NB, BS, H, 2 * HD).transpose(1, 2), "cpu", HD)


def test_saves_beyond_the_writer_queue_are_dropped_not_stalled():
    import threading

    release = threading.Event()

    class SlowStore:                      # put blocks until released; records what it stored
        def __init__(self):
            self.keys = []

        def put_from(self, keys, src, timeout=None, **kw):
            release.wait(30)
            self.keys += list(keys)
            from kvstore.common.types import PutResult
            return PutResult(len(self.keys), 0, 0)

    layout = BlockLayout(num_layers=L, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
    store = SlowStore()
    caches = {n: torch.randn(CPU_SHAPE) for n in NAMES}
    w = WorkerTransfers(store, NAMES, caches, "cpu", layout, (0, H), max_pending_saves=1)
    for i in range(4):                    # 1 in the writer, 1 queued, the rest dropped
        _drive_no_flush(w, StepPlan(saves=[BlockTransfer("r", (bytes([i]) * 32,), (i,))]))
    assert w.saves_dropped >= 1
    release.set()
    assert w.flush(30)
    assert len(store.keys) == 4 - w.saves_dropped and store.keys[0] == bytes([0]) * 32


def _drive_no_flush(w: WorkerTransfers, plan: StepPlan) -> None:
    w.bind(plan)
    w.start_load()
    for name in NAMES:
        w.wait_layer(name)
        w.save_layer(name)
    w.end_step()
