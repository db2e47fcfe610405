"""The engine side on a real GPU (skipped without one): the reference runner with its weights
and paged cache in HBM pages back what it stored and gets recompute's tokens, also through a
real daemon whose fastest tier is HBM; the vLLM worker's loads and saves with CUDA caches give
the same bytes as the CPU twin (the same caches on the CPU, the same layout).

Verdicts: tokens equal, logits within float32 rounding of recompute (cuBLAS may choose a
different kernel for a different prefill length), cache blocks and stored payloads bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ea_support import TINY, MemoryStore, engine, run_step
from engine_adapter.layout import BlockLayout
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.session import AgentSession, SessionOptions, play_session
from engine_adapter.reference.tp import TPGroup
from engine_adapter.vllm.plan import BlockTransfer, StepPlan
from engine_adapter.vllm.worker import WorkerTransfers
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from tiers.base import TierKind
from tiers.gpu import gpu_info

from support.daemon import daemon_config

info = gpu_info()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (info.available and torch.cuda.is_available()),
                                                  reason=info.reason or "torch sees no CUDA device")]

BT = 16
SESSION = AgentSession(turns=5, system_tokens=96, observation_tokens=40, answer_tokens=8, seed=11)
ATOL = 1e-4


def check_session(records) -> None:
    for rec in records:
        assert rec.result.tokens == rec.baseline.tokens
        torch.testing.assert_close(torch.as_tensor(rec.result.logits), torch.as_tensor(rec.baseline.logits),
                                   rtol=0, atol=ATOL)
        assert rec.result.stats.restarts == 0 and not rec.result.stats.problems
    for prev, rec in zip(records, records[1:]):      # every full block of the last turn, paged back
        assert rec.result.stats.paged_tokens == (prev.prompt_tokens + SESSION.answer_tokens - 1) // BT * BT


def test_page_back_on_the_gpu_equals_recompute():
    runner = Runner(TINY, engine(device="cuda"), TPGroup.single(), store=MemoryStore())
    assert runner.cache.device.type == "cuda"
    check_session(play_session(runner, SESSION, SessionOptions(baseline=True)))
    runner.close()


def test_the_gpu_runner_generates_the_cpu_runners_tokens():
    prompt = torch.randint(0, TINY.vocab_size, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    runners = [Runner(TINY, engine(device=dev), TPGroup.single()) for dev in ("cpu", "cuda")]
    try:
        cpu, gpu = (r.generate(prompt, 12, page_back=False, store=False) for r in runners)
    finally:
        for r in runners:
            r.close()
    assert gpu.tokens == cpu.tokens
    torch.testing.assert_close(torch.as_tensor(gpu.logits), torch.as_tensor(cpu.logits), rtol=0, atol=1e-3)


def test_page_back_through_a_daemon_with_an_hbm_tier(tmp_path):
    """HBM first, then pinned host memory (``pinned = "auto"`` on a GPU machine), then NVMe.
    Same-node puts land in the shared host arena; blocks then promoted to HBM (as a prefetch
    does) and moved out of the host arena are paged back from HBM (none read from NVMe, the
    only other copy) with recompute's result."""
    cfg = daemon_config(tmp_path, extra={"tiers": {"hbm": {"enabled": True, "capacity": "64MiB"},
                                                   "host": {"capacity": "64MiB"},
                                                   "nvme": {"enabled": True, "path": str(tmp_path / "nvme"),
                                                            "capacity": "256MiB"}}})
    d = start_server(cfg)
    try:
        assert d.manager.tier_name(0) == "hbm" and d.manager.tier_kind(0) == TierKind.HBM
        with KVStoreClient(d.address, timeout=60.0) as client:
            runner = Runner(TINY, engine(device="cuda"), TPGroup.single(), store=client)
            check_session(play_session(runner, SESSION, SessionOptions(baseline=True)))
            prompt = torch.randint(0, TINY.vocab_size, (200,), generator=torch.Generator().manual_seed(9)).tolist()
            runner.generate(prompt, 1)
            assert runner.flush()
            keys = runner.adapter.keyer.keys(prompt)[:200 // BT]
            for k in keys:                  # up to HBM (as a prefetch does), then out of the host arena
                assert d.manager.promote(k, 0) and d.manager.demote(k, 1)
            assert [d.manager.tier_of(k) for k in keys] == [TierKind.HBM] * len(keys)
            assert not any(k in d.manager.tiers[1] for k in keys)
            nvme_reads = d.manager.tiers[2].read_counters().reads
            longer = prompt + list(range(30))
            base = runner.generate(longer, 4, page_back=False, store=False)
            out = runner.generate(longer, 4, store=False)
            assert out.stats.paged_tokens == len(keys) * BT and not out.stats.problems
            assert d.manager.tiers[2].read_counters().reads == nvme_reads     # every block came from HBM
            assert out.tokens == base.tokens
            torch.testing.assert_close(torch.as_tensor(out.logits), torch.as_tensor(base.logits), rtol=0, atol=ATOL)
            runner.close()
    finally:
        d.stop(0)


# ---------------------------------------------------------------- vLLM worker, CUDA caches

BS, H, HD, LAYERS = 16, 2, 16, 4
LAYOUT = BlockLayout(num_layers=LAYERS, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SHAPES = {"token": (24, H, BS, 2 * HD), "kv_first": (2, 24, BS, H, HD)}


def step(w: WorkerTransfers, plan: StepPlan) -> set[int]:
    return run_step(w, NAMES, plan)


@pytest.mark.parametrize("kv_layout", ["token", "kv_first"])
def test_vllm_worker_with_cuda_caches_moves_the_cpu_twins_bytes(tmp_path, kv_layout):
    d = start_server(daemon_config(tmp_path))
    try:
        with KVStoreClient(d.address, timeout=60.0) as client:
            gen = torch.Generator().manual_seed(5)
            src = {n: torch.randn(SHAPES[kv_layout], generator=gen) for n in NAMES}
            keys = [f"gpu-{kv_layout}-{i}".encode().ljust(32, b".") for i in range(6)]
            twin_keys = [f"cpu-{kv_layout}-{i}".encode().ljust(32, b".") for i in range(6)]
            gpu_caches = {n: t.clone().cuda() for n, t in src.items()}
            cpu_caches = {n: t.clone() for n, t in src.items()}
            gpu = WorkerTransfers(client, NAMES, gpu_caches, kv_layout, LAYOUT, (0, H), timeout_s=60.0)
            cpu = WorkerTransfers(client, NAMES, cpu_caches, kv_layout, LAYOUT, (0, H), timeout_s=60.0)
            ids = (3, 7, 1, 20, 11, 5)
            assert step(gpu, StepPlan(saves=[BlockTransfer("g", tuple(keys), ids)])) == set()
            assert step(cpu, StepPlan(saves=[BlockTransfer("c", tuple(twin_keys), ids)])) == set()
            got = [bytes(r.data) for r in client.get(keys + twin_keys) if r.found]
            assert len(got) == 12
            assert got[:6] == got[6:]                  # the GPU's save is the CPU twin's, byte for byte
            for caches in (gpu_caches, cpu_caches):    # load the blocks into other cache slots
                for t in caches.values():
                    t[:, 12:18].zero_() if kv_layout == "kv_first" else t[12:18].zero_()
            dest = (12, 13, 14, 15, 16, 17)
            assert step(gpu, StepPlan(loads=[BlockTransfer("g", tuple(keys), dest)])) == set()
            assert step(cpu, StepPlan(loads=[BlockTransfer("c", tuple(twin_keys), dest)])) == set()
            for n in NAMES:
                assert torch.equal(gpu_caches[n].cpu(), cpu_caches[n])
                pick = (lambda t, b: t[:, list(b)]) if kv_layout == "kv_first" else (lambda t, b: t[list(b)])
                assert torch.equal(pick(cpu_caches[n], dest), pick(src[n], ids))
    finally:
        d.stop(0)


def step_without_host_sync(w: WorkerTransfers, plan: StepPlan, then) -> None:
    """The step's hooks as vLLM's forward calls them, then ``then()`` (queued at once, as the
    next step would be), with torch raising on any operation that makes the host wait for the
    GPU (a ``.cpu()``, a blocking copy, ``.item()``, a sync). Its staging is pinned (a copy
    into pageable memory would wait without torch noticing)."""
    w.bind(plan)
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.start_load()
        assert w._save.staging.is_pinned() and w._load.staging[0].is_pinned()
        for name in NAMES:
            w.wait_layer(name)
            w.save_layer(name)
        w.end_step()
        then()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_vllm_worker_steps_never_make_the_host_wait_and_saves_precede_reuse(tmp_path):
    """A step that loads some blocks and saves others queues all its copies without a host
    sync; the forward's stream waits for the saves' copies, so a kernel that overwrites a saved
    block right after the step (vLLM reusing it) cannot reach the copy first; what is stored
    and loaded is the CPU twin's, bit for bit."""
    d = start_server(daemon_config(tmp_path))
    try:
        with KVStoreClient(d.address, timeout=60.0) as client:
            gen = torch.Generator().manual_seed(9)
            src = {n: torch.randn(SHAPES["token"], generator=gen) for n in NAMES}
            gpu_caches = {n: t.clone().cuda() for n, t in src.items()}
            cpu_caches = {n: t.clone() for n, t in src.items()}
            gpu = WorkerTransfers(client, NAMES, gpu_caches, "token", LAYOUT, (0, H), timeout_s=60.0)
            cpu = WorkerTransfers(client, NAMES, cpu_caches, "token", LAYOUT, (0, H), timeout_s=60.0)
            first = [f"ns-a{i}".encode().ljust(32, b".") for i in range(4)]
            assert step(cpu, StepPlan(saves=[BlockTransfer("c", tuple(first), (0, 1, 2, 3))])) == set()
            saved = (5, 9, 14, 2, 20)
            keys = [f"ns-g{i}".encode().ljust(32, b".") for i in range(len(saved))]
            twin = [f"ns-c{i}".encode().ljust(32, b".") for i in range(len(saved))]
            plan = StepPlan(loads=[BlockTransfer("g", tuple(first), (10, 11, 12, 13))],
                            saves=[BlockTransfer("g", tuple(keys), saved)])
            reuse = torch.tensor(saved, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(gpu._cuda.stream):
                torch.cuda._sleep(100_000_000)  # hold the copies' stream (tens of ms): the copies run late

            def reuse_blocks():                 # the next step overwrites the saved blocks at once
                for t in gpu_caches.values():
                    t.index_fill_(0, reuse, -7.0)
            step_without_host_sync(gpu, plan, reuse_blocks)
            assert gpu.flush(60.0) and gpu.take_load_errors() == set()
            assert step(cpu, StepPlan(loads=[BlockTransfer("c", tuple(first), (10, 11, 12, 13))],
                                      saves=[BlockTransfer("c", tuple(twin), saved)])) == set()
            got = [r for r in client.get(keys + twin)]
            assert all(r.found for r in got)
            assert [bytes(r.data) for r in got[:5]] == [bytes(r.data) for r in got[5:]]
            for n in NAMES:
                assert torch.equal(gpu_caches[n].cpu()[10:14], cpu_caches[n][10:14])
                assert torch.equal(cpu_caches[n][10:14], src[n][0:4])
    finally:
        d.stop(0)
