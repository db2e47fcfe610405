"""The vLLM worker's CUDA save and load path (:mod:`engine_adapter.vllm.cuda_copies`: layer-major
staging, block ids copied once per step, one event per step) run on the CPU with stand-ins for
torch's streams and events (CPU work is in order anyway), against the plain CPU path of the
same worker: the same bytes stored and loaded, bit for bit, also when a step missed a layer
(its save is dropped and the next step saves its own blocks, not the dropped step's), and the
pinned staging budget falls back to pageable staging beyond it."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from ea_support import MemoryStore
from engine_adapter.layout import BlockLayout
from engine_adapter.vllm import cuda_copies
from engine_adapter.vllm.plan import BlockTransfer, StepPlan
from engine_adapter.vllm.worker import WorkerTransfers

L, H, BS, HD = 3, 2, 4, 8
LAYOUT = BlockLayout(num_layers=L, num_kv_heads=H, block_tokens=BS, head_dim=HD, dtype=torch.float32)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


class _Stream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class _Event:
    synchronized = 0

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        _Event.synchronized += 1


@pytest.fixture
def cuda_standins(monkeypatch):
    """torch's stream API as no-ops, and ``pin_memory=True`` allocations as plain ones."""
    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    _Event.synchronized = 0


def _key(tag: str, i: int) -> bytes:
    return f"{tag}{i}".encode().ljust(32, b".")


def _step(w: WorkerTransfers, plan: StepPlan, skip: tuple[str, ...] = ()) -> set[int]:
    w.bind(plan)
    w.start_load()
    for name in NAMES:
        w.wait_layer(name)
        if name not in skip:
            w.save_layer(name)
    w.end_step()
    assert w.flush(30.0)
    return w.take_load_errors()


def _workers(max_pinned_bytes: int):
    gen = torch.Generator().manual_seed(3)
    src = {n: torch.randn((2, 24, BS, H, HD), generator=gen) for n in NAMES}
    twin_caches = {n: t.clone() for n, t in src.items()}
    plain_caches = {n: t.clone() for n, t in src.items()}
    store = MemoryStore()
    twin = WorkerTransfers(store, NAMES, twin_caches, "kv_first", LAYOUT, (0, H), direct_loads=False)
    twin._cuda = cuda_copies.CudaSaves(torch.device("cpu"), max_pinned_bytes=max_pinned_bytes)
    plain = WorkerTransfers(store, NAMES, plain_caches, "kv_first", LAYOUT, (0, H), direct_loads=False)
    return store, twin, plain, twin_caches, plain_caches


@pytest.mark.parametrize("max_pinned_bytes", [1 << 30, 0])
def test_cuda_save_path_stores_and_loads_the_plain_paths_bytes(cuda_standins, max_pinned_bytes):
    store, twin, plain, twin_caches, plain_caches = _workers(max_pinned_bytes)
    # a step that misses a layer stores nothing; the next one stores its own blocks
    for w, tag in ((twin, "t"), (plain, "p")):
        assert _step(w, StepPlan(saves=[BlockTransfer("r", (_key(tag + "x", 0), _key(tag + "x", 1)), (1, 2))]),
                     skip=(NAMES[2],)) == set()
        assert _step(w, StepPlan(saves=[BlockTransfer("r", tuple(_key(tag + "a", i) for i in range(3)),
                                                      (7, 9, 4))])) == set()
    assert not any(k in store.blocks for k in (_key("tx", 0), _key("px", 0)))
    assert [store.blocks[_key("ta", i)] for i in range(3)] == [store.blocks[_key("pa", i)] for i in range(3)]
    assert store.blocks[_key("ta", 0)] != store.blocks[_key("ta", 1)]
    # a step that loads the saved blocks into other slots and saves more
    for w, tag in ((twin, "t"), (plain, "p")):
        assert _step(w, StepPlan(loads=[BlockTransfer("r", tuple(_key(tag + "a", i) for i in range(3)),
                                                      (12, 13, 14))],
                                 saves=[BlockTransfer("r", (_key(tag + "b", 0),), (20,))])) == set()
    assert store.blocks[_key("tb", 0)] == store.blocks[_key("pb", 0)]
    for n in NAMES:
        assert torch.equal(twin_caches[n], plain_caches[n])
        assert torch.equal(twin_caches[n][:, 12:15], twin_caches[n][:, [7, 9, 4]])
    assert _Event.synchronized == 2                   # the writer waited for each stored step's copies
    gc.collect()
    assert twin._cuda.pinned_bytes == 0                # stored steps' staging freed, no longer counted


def test_pinned_staging_beyond_the_budget_is_pageable(cuda_standins):
    saves = cuda_copies.CudaSaves(torch.device("cpu"), max_pinned_bytes=4000)
    first = saves.staging(2, 3, 2, 4, 8, torch.float32)           # 3,072 bytes: pinned
    assert saves.pinned_bytes == first.numel() * 4
    second = saves.staging(2, 3, 2, 4, 8, torch.float32)          # would pass 4,000: pageable
    assert saves.pinned_bytes == first.numel() * 4
    del first
    gc.collect()
    assert saves.pinned_bytes == 0
    assert second.shape == (3, 2, 2, 2, 4, 8)
