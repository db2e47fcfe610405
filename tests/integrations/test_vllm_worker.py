"""Worker-side hooks of the vLLM connector with real tensors in vLLM's KV layouts, through a
real daemon: bit-exact round trips, load failures reported for recompute, TP head slicing."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/test-integrations.sh builds .venv-vllm)", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm_support as vs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from engine_adapter import store_io  # noqa: E402
from engine_adapter.layout import BlockLayout  # noqa: E402
from engine_adapter.vllm_connector import KVStoreConnector, KVStoreConnectorMetadata, assemble_heads  # noqa: E402
from engine_adapter.vllm_plan import BlockTransfer, StepPlan  # noqa: E402
from engine_adapter.vllm_worker import WorkerTransfers  # noqa: E402

BS, NB, H, HD, L = 16, 12, 2, 64, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SHAPES = {"cpu": (NB, H, BS, 2 * HD), "token": (NB, H, BS, 2 * HD), "kv_first": (2, NB, BS, H, HD)}
KEYS = [bytes([i]) * 32 for i in range(1, 4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vs.tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def worker(model_dir, target, kv_layout, fill: bool, **extra):
    cfg = vs.vllm_config(model_dir, target, block_size=BS, kv_layout=kv_layout, **extra)
    conn = KVStoreConnector(cfg, KVConnectorRole.WORKER)
    gen = torch.Generator().manual_seed(7)
    caches = {n: (torch.randn(SHAPES[kv_layout], generator=gen) if fill else torch.zeros(SHAPES[kv_layout]))
              for n in NAMES}
    conn.register_kv_caches(caches)
    return conn, caches


def step(conn, plan: StepPlan, caches) -> set[int]:
    """One engine step as vLLM drives the hooks; returns the failed block ids."""
    conn.bind_connector_metadata(KVStoreConnectorMetadata(plan))
    conn.start_load_kv(None)
    for name in NAMES:
        conn.wait_for_layer_load(name)
        conn.save_kv_layer(name, caches[name], None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.worker.flush(30)
    return conn.get_block_ids_with_load_errors()


def test_saves_when_start_load_comes_after_the_forward(daemon, client, model_dir):
    """vLLM calls start_load_kv after the forward when a step has no synchronous loads."""
    src, caches = worker(model_dir, daemon.address, "token", fill=True)
    src.bind_connector_metadata(KVStoreConnectorMetadata(StepPlan(saves=[BlockTransfer("r", tuple(KEYS), (3, 5, 7))])))
    for name in NAMES:
        src.wait_for_layer_load(name)
        src.save_kv_layer(name, caches[name], None)
    src.start_load_kv(None)
    src.wait_for_save()
    src.clear_connector_metadata()
    assert src.worker.flush(30)
    assert store_io.lookup_prefix(client, KEYS) == 3


def block(cache, layout, b):
    return cache[:, b] if layout == "kv_first" else cache[b]


@pytest.mark.parametrize("kv_layout", ["cpu", "token", "kv_first"])
def test_save_then_load_is_bit_exact(daemon, client, model_dir, kv_layout):
    src, src_caches = worker(model_dir, daemon.address, kv_layout, fill=True)
    assert step(src, StepPlan(saves=[BlockTransfer("r", tuple(KEYS), (3, 5, 7))]), src_caches) == set()
    assert store_io.lookup_prefix(client, KEYS) == 3
    layout = src.worker.layout
    assert len(client.get([KEYS[0]])[0].data) == layout.block_bytes == L * 2 * H * BS * HD * 4

    dst, dst_caches = worker(model_dir, daemon.address, kv_layout, fill=False)
    assert step(dst, StepPlan(loads=[BlockTransfer("s", tuple(KEYS), (1, 2, 4))]), dst_caches) == set()
    for name in NAMES:
        for s, d in ((3, 1), (5, 2), (7, 4)):
            assert torch.equal(block(dst_caches[name], kv_layout, d), block(src_caches[name], kv_layout, s))
        assert not block(dst_caches[name], kv_layout, 0).any()          # nothing else written


def test_token_layout_payload_is_layer_kv_head_token_dim(daemon, client, model_dir):
    src, caches = worker(model_dir, daemon.address, "token", fill=True)
    step(src, StepPlan(saves=[BlockTransfer("r", (KEYS[0],), (6,))]), caches)
    payload = torch.frombuffer(bytearray(client.get([KEYS[0]])[0].data), dtype=torch.float32)
    got = payload.reshape(L, 2, H, BS, HD)
    for layer, name in enumerate(NAMES):
        kv = caches[name][6]                                         # (H, BS, 2 * HD): [k | v] per token
        assert torch.equal(got[layer, 0], kv[..., :HD]) and torch.equal(got[layer, 1], kv[..., HD:])


def test_missing_and_short_blocks_are_reported_never_used(daemon, client, model_dir):
    src, src_caches = worker(model_dir, daemon.address, "cpu", fill=True)
    step(src, StepPlan(saves=[BlockTransfer("r", tuple(KEYS), (3, 5, 7))]), src_caches)
    client.delete([KEYS[1]])
    dst, dst_caches = worker(model_dir, daemon.address, "cpu", fill=False)
    failed = step(dst, StepPlan(loads=[BlockTransfer("s", tuple(KEYS), (1, 2, 4))]), dst_caches)
    assert failed == {2, 4}                       # from the missing block on: vLLM recomputes them
    for name in NAMES:
        assert torch.equal(dst_caches[name][1], src_caches[name][3])

    short = bytes(32 * [9])
    client.put([(short, b"\1" * 100)])           # a block of the wrong size under a key
    failed = step(dst, StepPlan(loads=[BlockTransfer("t", (KEYS[0], short), (8, 9))]), dst_caches)
    assert failed == {9}
    assert not dst_caches[NAMES[0]][9].any()


def test_daemon_down_fails_every_load(tmp_path, model_dir):
    dst, caches = worker(model_dir, f"unix:{tmp_path}/absent.sock", "cpu", fill=False, timeout_s=0.5)
    failed = step(dst, StepPlan(loads=[BlockTransfer("s", tuple(KEYS), (1, 2, 4))]), caches)
    assert failed == {1, 2, 4}
    assert not any(c.any() for c in caches.values())


def test_layer_not_waited_reports_blocks(daemon, client, model_dir):
    src, caches = worker(model_dir, daemon.address, "cpu", fill=True)
    step(src, StepPlan(saves=[BlockTransfer("r", tuple(KEYS), (3, 5, 7))]), caches)
    dst, dcaches = worker(model_dir, daemon.address, "cpu", fill=False)
    dst.bind_connector_metadata(KVStoreConnectorMetadata(StepPlan(loads=[BlockTransfer("s", tuple(KEYS), (1, 2, 4))])))
    dst.start_load_kv(None)
    dst.wait_for_layer_load(NAMES[0])             # layer 1 never waited for
    dst.wait_for_save()
    assert dst.get_block_ids_with_load_errors() == {1, 2, 4}


def _rank_caches(full: dict, h0: int, h1: int) -> dict:
    return {n: c[:, h0:h1].clone() for n, c in full.items()}


def test_blocks_written_at_tp2_are_read_at_tp1_and_back(daemon, client):
    layout = BlockLayout(num_layers=L, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    full = {n: torch.randn(SHAPES["cpu"], generator=gen) for n in NAMES}
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
    one = {n: torch.zeros(SHAPES["cpu"]) for n in NAMES}
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
    w.bind(plan)
    w.start_load()
    for name in NAMES:
        w.wait_layer(name)
        w.save_layer(name)
    w.end_step()
    assert w.flush(30)
    return w.take_load_errors()
