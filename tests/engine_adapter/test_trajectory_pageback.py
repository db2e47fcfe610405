"""Trajectories without any hint, against a real daemon: the vLLM scheduler half (fake requests,
no vLLM) tells an in-process daemon when each request's trajectory starts to wait and when a
later request resumes it; the daemon learns the gap of the trajectories' class and pages a
waiting prefix back from NVMe into its fastest tier (host, a tiny one) before the resume
arrives; a trajectory that never comes back expires.

The daemon pages back when due (``[prefetch] confidence = 0``): with the default 0.7 a
page back also needs the class's learned gaps to say the trajectory is likely back within
``horizon_s``, which a handful of gaps (two pseudo-observations count against) and a hint
that reaches the daemon late on a loaded machine can deny: the verdict would depend on speed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from tiers.base import TierKind

from engine_adapter import store_io
from engine_adapter.engine_keys import IncrementalKeys, engine_namespace
from engine_adapter.hint_sender import HintSender
from engine_adapter.trajectories import AgentTracker
from engine_adapter.vllm.scheduler import SchedulerPlanner
from support.daemon import daemon_config

BS = 4
PAYLOAD = 64 * 1024                 # bytes per block: the 1 MiB host tier holds 16
SYSTEM = list(range(1, 1 + 2 * BS))  # the prompt every agent starts with (two blocks: the class)


def wait_for(cond, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def rig(tmp_path, request):
    # expire_factor: the expiry test's own (10); elsewhere large, so that a loaded machine's
    # slow steps never expire a wait the test expects back
    factor = getattr(request, "param", 1000.0)
    cfg = daemon_config(tmp_path, host="1MiB", nvme="16MiB", extra={"prefetch": {"enabled": True, "confidence": 0.0,
                                                                                  "expire_factor": factor}})
    daemon = start_server(cfg)
    client = KVStoreClient(daemon.address, timeout=30)
    client.wait_ready(30)
    store = store_io.GuardedStore(client)
    ns = engine_namespace(model="m", dtype="float32", block_tokens=BS, num_layers=2, num_kv_heads=2, head_dim=8,
                          scheme="tokens", engine="vllm")
    agent = AgentTracker(HintSender(store, timeout_s=30.0))
    planner = SchedulerPlanner(ns, BS, store, 30.0, agent=agent)
    yield SimpleNamespace(daemon=daemon, prefetch=daemon.service.hints, client=client, agent=agent, planner=planner)
    agent.close()
    store.close()
    client.close()
    daemon.stop(0)


def turn(rig, rid: str, tokens: list[int]) -> list[bytes]:
    """A request arrives, is computed in one step and its blocks stored (as the worker would);
    returns the keys of its stored prefix. It has not finished yet."""
    req = SimpleNamespace(request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens), block_hashes=[],
                          lora_request=None, cache_salt=None, mm_features=None, kv_transfer_params=None,
                          kv_hints=None, arrival_time=time.time())
    rig.planner.num_new_matched_tokens(req, 0)
    plan = rig.planner.build(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(range(len(tokens) // BS + 1)),),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={rid: len(tokens)}, finished_req_ids=set()))
    saved = [k for s in plan.saves for k in s.keys]
    # the hints sent on arrival (a Resume) reach the daemon before the step's saves, as on an
    # engine, where a forward pass lies between the two: a save must not be scored before it
    assert rig.agent.sender.flush(30)
    rig.client.put_from(saved, np.full((len(saved), PAYLOAD), len(saved), np.uint8))
    rig.last = req
    return IncrementalKeys(rig.planner.namespace).extend(tokens=tokens)[:len(tokens) // BS]


def finish(rig) -> None:
    rig.planner.finished(rig.last)


def tiers(rig, keys) -> tuple:
    res = rig.client.lookup(keys)
    return tuple(res.tiers) + (None,) * (len(keys) - res.hit_blocks)


def test_without_hints_a_waiting_prefix_is_paged_back_from_nvme_before_it_resumes(rig):
    p = rig.prefetch
    # 1. agent A: four turns 0.3 s apart; each later turn extends the one before (a resume)
    tokens = SYSTEM + list(range(100, 100 + BS + 1))
    first = []
    for i in range(4):
        keys = turn(rig, f"a{i}", tokens)
        first = first or keys
        finish(rig)
        time.sleep(0.3)
        tokens = tokens[:-1] + list(range(200 + 10 * i, 200 + 10 * i + BS)) + [7]
    assert rig.agent.sender.flush(30)
    wait_for(lambda: p.stats.resumes == 3, "A's three resumes at the daemon")
    assert p.stats.resumes_unknown == 0
    cls = rig.agent.class_of(first)
    learned = p.durations.tools.tools()
    assert learned.get(cls, 0) == 3                   # the gaps, learned under the trajectories' class
    assert 0.2 <= p.durations.tool_quantile(cls, 0.5) <= 30.0

    # 2. agent B (same class): its first turn is stored, then other traffic pushes it to NVMe
    b1 = SYSTEM + list(range(500, 500 + 2 * BS + 1))
    keys = turn(rig, "b1", b1)
    assert len(keys) == 4
    promoted = p.stats.promoted_blocks
    filler = [bytes([0xF0, i]) * 16 for i in range(40)]
    rig.client.put_from(filler, np.zeros((len(filler), PAYLOAD), np.uint8))
    wait_for(lambda: all(t == TierKind.NVME for t in tiers(rig, keys)), "B's blocks only on NVMe")
    finish(rig)                                        # B waits: no hint, only its blocks
    wait_for(lambda: all(t == TierKind.HOST for t in tiers(rig, keys)), "B's prefix paged back into host")
    assert p.stats.promoted_blocks >= promoted + 4     # moved by the page back (A's may have moved too)
    resumes, ready, whole = p.stats.resumes, p.stats.ready_blocks, p.stats.resumes_ready

    # 3. B's next turn arrives: it is the resume, and found its prefix ready in the fastest tier
    turn(rig, "b2", b1[:-1] + list(range(700, 700 + BS)) + [9])
    assert rig.agent.sender.flush(30)
    wait_for(lambda: p.stats.resumes == resumes + 1, "B's resume at the daemon")
    assert p.stats.resumes_unknown == 0
    assert p.stats.ready_blocks - ready == 4           # B's 4 blocks were ready in host when it resumed
    assert p.stats.resumes_ready - whole == 1
    assert rig.agent.stats()["resumed_prefix"] == 4


@pytest.mark.parametrize("rig", [10.0], indirect=True)
def test_a_trajectory_that_never_comes_back_expires(rig):
    p = rig.prefetch
    tokens = SYSTEM + list(range(300, 300 + BS + 1))
    for i in range(4):                                 # teach the class a short gap (0.2 s)
        turn(rig, f"c{i}", tokens)
        finish(rig)
        time.sleep(0.2)
        tokens = tokens[:-1] + list(range(400 + 10 * i, 400 + 10 * i + BS)) + [5]
    assert rig.agent.sender.flush(30)
    wait_for(lambda: p.stats.resumes == 3, "three resumes")
    # the fourth turn's wait never resumes: it leaves the daemon's table after
    # expire_factor (10) x its predicted wait
    (tid,) = list(p.waits)
    wait_for(lambda: tid not in p.waits, "the wait's expiry", deadline_s=120)
    assert p.stats.expired == 1 and p.stats.resumes == 3
