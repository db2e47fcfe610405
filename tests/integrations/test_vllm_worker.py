"""Worker-side hooks of the vLLM connector with real tensors in vLLM's KV layouts, through a
real daemon: bit-exact round trips, load failures reported for recompute. (TP head slicing,
which needs no vLLM, is in tests/engine_adapter/test_plugin_core.py.)"""

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
from engine_adapter.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata  # noqa: E402
from engine_adapter.vllm.plan import BlockTransfer, StepPlan  # noqa: E402

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
