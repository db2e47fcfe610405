"""Blocks saved through the plug-ins are announced in the daemon's KV events under the
engine's own block hash, with their parent's hash and their token ids (not under the
store's internal keys). vLLM: the scheduler half's plan, pickled as vLLM ships it, carried
out by the worker half against a real daemon. (SGLang: tests/integrations/test_sglang_backend.py.)"""

from __future__ import annotations

import pickle

import pytest
import torch

import ns_support as nss
from ea_support import engine
from engine_adapter.layout import BlockLayout
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.tp import TPGroup
from engine_adapter.vllm.plan import StepPlan
from engine_adapter.vllm.scheduler import SchedulerPlanner
from engine_adapter.vllm.settings import ConnectorSettings, namespace_of
from engine_adapter.vllm.worker import WorkerTransfers
from kvstore.client.client import KVStoreClient
from support.daemon import daemon_config
from support.kv_events import Subscriber

BS, NB, H, HD, L = 16, 16, 2, 8, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture
def daemon(tmp_path):
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, extra={
        "events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0"}, "blocks": {"block_tokens": BS}}))
    yield d
    d.stop(0)


def stored(events: list[dict]) -> dict[bytes, dict]:
    return {e["block_hashes"][0]: e for e in events if e["type"] == "BlockStored"}


def drive(w: WorkerTransfers, plan: StepPlan) -> None:
    """One engine step's hooks, as vLLM calls them."""
    w.bind(pickle.loads(pickle.dumps(plan)))          # vLLM pickles the metadata to the workers
    w.start_load()
    for name in NAMES:
        w.wait_layer(name)
        w.save_layer(name)
    w.end_step()
    assert w.flush(60)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["arena", "grpc"])
def test_vllm_saves_are_announced_under_vllms_hashes(daemon, shared_memory):
    sub = Subscriber(daemon.events.endpoint)
    with KVStoreClient(daemon.address, timeout=60, shared_memory=shared_memory) as client:
        sub.join(client)
        ns = namespace_of(nss.vllm_config("no-such-org/m", block_size=BS), ConnectorSettings(target="unix:/x"))
        planner = SchedulerPlanner(ns, BS, client, 60.0)
        layout = BlockLayout(num_layers=L, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
        caches = {n: torch.randn((NB, H, BS, 2 * HD)) for n in NAMES}
        worker = WorkerTransfers(client, NAMES, caches, "cpu", layout, (0, H))
        tokens = list(range(1000, 1000 + 3 * BS + 5))
        req = nss.request("r", tokens, BS)
        assert planner.num_new_matched_tokens(req, 0) == 0
        drive(worker, planner.build(nss.first_step("r", [4, 7, 9, 11], len(tokens))))   # prefill: blocks 0-2
        # a decode step later completes block 3: its parent is block 2, saved in the step before
        req.all_token_ids += list(range(5000, 5000 + BS - 5))
        req.block_hashes = nss.block_hashes(req.all_token_ids, BS)
        step = nss.first_step("r", [], BS - 5)
        step.scheduled_new_reqs = []
        step.scheduled_cached_reqs.req_ids, step.scheduled_cached_reqs.new_block_ids = ["r"], [None]
        step.scheduled_cached_reqs.num_computed_tokens = [len(tokens)]
        drive(worker, planner.build(step))
        hashes = req.block_hashes
        events = stored(sub.wait(lambda ev: all(h in stored(ev) for h in hashes[:4]), "4 BlockStored"))
    sub.close()
    for i in range(4):
        e = events[hashes[i]]
        assert e["parent_block_hash"] == (hashes[i - 1] if i else None)
        assert e["token_ids"] == req.all_token_ids[i * BS:(i + 1) * BS] and e["block_size"] == BS
    assert not set(events) & set(planner.request_keys(planner._track(req))), "no block under a store key"


def test_reference_runner_saves_carry_tokens_and_parent(daemon):
    sub = Subscriber(daemon.events.endpoint)
    prompt = list(range(1, 3 * BS + 4))
    with KVStoreClient(daemon.address, timeout=60) as client:
        sub.join(client)
        runner = Runner(nss.MODEL, engine(), TPGroup.single(), store=client)
        runner.generate(prompt, 1)
        assert runner.flush()
        keys = runner.adapter.keyer.keys(prompt)
        runner.close()
        events = stored(sub.wait(lambda ev: all(k in stored(ev) for k in keys), "3 BlockStored"))
    sub.close()
    for i, k in enumerate(keys):
        assert events[k]["parent_block_hash"] == (keys[i - 1] if i else None)
        assert events[k]["token_ids"] == prompt[i * BS:(i + 1) * BS]
