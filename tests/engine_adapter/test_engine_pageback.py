"""Page back at TP=1 against an in-memory store: same logits as recompute, and every failure
(missing, corrupt, store down, store hanging, store unreachable) falls back to recompute."""

import logging
import threading
import time

import numpy as np
import pytest

from ea_support import TINY, FaultyStore, MemoryStore, engine
from engine_adapter.reference import adapter as adapter_mod
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.session import AgentSession, SessionOptions, play_session
from engine_adapter.reference.tp import TPGroup
from engine_adapter.reference.transfer import layer_groups
from kvstore.client.client import KVStoreClient

BT = 16
SESSION = AgentSession(turns=6, system_tokens=96, observation_tokens=40, answer_tokens=8, seed=7)


def assert_same(a, b):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def baseline():
    """Recompute-only generations of two prompts (the second extends the first)."""
    runner = Runner(TINY, engine(), TPGroup.single())
    p1 = np.random.default_rng(0).integers(0, TINY.vocab_size, 150).tolist()
    g1 = runner.generate(p1, 4, page_back=False, store=False)
    p2 = p1 + g1.tokens + np.random.default_rng(1).integers(0, TINY.vocab_size, 30).tolist()
    g2 = runner.generate(p2, 4, page_back=False, store=False)
    return p1, g1, p2, g2


def two_turns(store, baseline, arm=None, after=None, **eng):
    """Turn 1 stores the prefix; ``arm(keys)`` injects a fault; turn 2 pages back (then
    ``after()`` runs, before anything is released). Returns turn 2."""
    p1, g1, p2, g2 = baseline
    runner = Runner(TINY, engine(**eng), TPGroup.single(), store=store)
    assert_same(runner.generate(p1, 4), g1)
    assert runner.flush()
    if arm is not None:
        arm(runner.adapter.keyer.keys(p2))
    out = runner.generate(p2, 4)
    if after is not None:
        after()
    assert_same(out, g2)
    runner.close()
    return out


def test_session_page_back_equals_recompute():
    runner = Runner(TINY, engine(), TPGroup.single(), store=MemoryStore())
    records = play_session(runner, SESSION, SessionOptions(baseline=True))
    for rec in records:
        assert_same(rec.result, rec.baseline)
        assert rec.result.stats.paged_tokens + rec.result.stats.prefilled_tokens == rec.prompt_tokens
        assert rec.result.stats.restarts == 0 and not rec.result.stats.problems
    # turn i pages back every full block of turn i-1's prompt and answer but the last token
    for prev, rec in zip(records, records[1:]):
        assert rec.result.stats.paged_tokens == (prev.prompt_tokens + SESSION.answer_tokens - 1) // BT * BT
    assert records[0].result.stats.paged_tokens == 0


def test_one_get_into_per_layer_group_for_the_whole_prefix(baseline):
    store = MemoryStore()
    two_turns(store, baseline, arm=lambda keys: store.calls.clear())
    assert layer_groups(TINY.num_layers) == [(0, 1), (1, 4)]
    assert store.calls.count("get_into") == 2
    assert store.calls[0] == "lookup"


def test_layer_load_overlaps_previous_layer_compute(baseline, monkeypatch):
    """The Get of layers 1-3 is still in flight when layer 0's attention starts: the second
    get_into waits for layer 0's compute, which only an overlapping loader lets happen (a
    loader that fetched every group before computing would wait in vain)."""
    computed = [threading.Event() for _ in range(TINY.num_layers)]
    overlapped = []
    gets = []

    class GatedStore(MemoryStore):
        def get_into(self, *a, **kw):
            n = len(gets)
            gets.append(n)
            if n > 0:
                overlapped.append(computed[0].wait(60))
            return super().get_into(*a, **kw)

    real_call = adapter_mod.PageBackGate.__call__

    def gate_call(self, layer):
        real_call(self, layer)
        computed[layer].set()

    monkeypatch.setattr(adapter_mod.PageBackGate, "__call__", gate_call)
    store = GatedStore()
    two_turns(store, baseline, arm=lambda keys: gets.clear())
    assert gets == [0, 1]                      # layer 0, then layers 1-3
    assert overlapped == [True]
    assert all(e.is_set() for e in computed)


@pytest.mark.parametrize("mode", ["missing", "corrupt"])
def test_block_missing_or_corrupt_mid_load_recomputes_from_it(baseline, caplog, mode):
    store = FaultyStore(MemoryStore())
    with caplog.at_level(logging.WARNING, logger="engine_adapter"):
        out = two_turns(store, baseline, arm=lambda keys: store.arm(mode, key=keys[3], after_gets=1))
    assert out.stats.lookup_hit_tokens == 9 * BT
    assert out.stats.restarts == 1
    assert out.stats.paged_tokens == 3 * BT
    assert f"block 3 {mode} in layers 1-3" in out.stats.problems[0]
    assert "recomputing 96 tokens" in caplog.text


def test_store_down_mid_load_recomputes_everything(baseline):
    store = FaultyStore(MemoryStore())
    out = two_turns(store, baseline, arm=lambda keys: store.arm("down", after_gets=1))
    assert (out.stats.restarts, out.stats.paged_tokens) == (1, 0)
    assert "store error in layers 1-3" in out.stats.problems[0]
    assert len(store.inner.blocks) == 150 // BT        # turn 2's new blocks were not stored (down)


def test_hanging_store_times_out_and_recomputes(baseline):
    """The hang lasts 60 s unless released: the turn returns long before, recomputed."""
    store = FaultyStore(MemoryStore())
    hung_at_return = []

    def after():
        hung_at_return.append(store.hanging.is_set())
        store.unhang.set()                    # now let the abandoned Get end
    try:
        out = two_turns(store, baseline, arm=lambda keys: store.arm("hang", after_gets=1, hang_s=120.0),
                        load_timeout_s=0.3, after=after)
    finally:
        store.unhang.set()
    assert out.stats.paged_tokens == 0
    assert "load timeout" in out.stats.problems[0]
    assert hung_at_return == [True]           # the prefill did not wait for the hanging Get


def test_unreachable_store_recomputes_with_one_warning(baseline, caplog, tmp_path):
    client = KVStoreClient(f"unix:{tmp_path}/nobody.sock", timeout=2.0)
    p1, g1, _, _ = baseline
    runner = Runner(TINY, engine(store_timeout_s=2.0), TPGroup.single(), store=client)
    caplog.clear()                                  # the start-up warning (cannot check the block size)
    with caplog.at_level(logging.WARNING, logger="engine_adapter"):
        out = runner.generate(p1, 4)
        runner.flush()
        breaker = runner.adapter.store.breaker
        deadline = time.monotonic() + 60
        while breaker.outages == 0 and time.monotonic() < deadline:   # its probe fails too: an outage
            time.sleep(0.02)
        out2 = runner.generate(p1, 4)               # while the breaker is open: no call, no log
        runner.flush()
    assert_same(out, g1)
    assert_same(out2, g1)
    assert "lookup failed" in out.stats.problems[0]
    outage = [r for r in caplog.records if "is unavailable" in r.getMessage()]
    assert len(outage) == 1 and outage[0].levelno == logging.WARNING
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1     # nothing else
    counts = breaker.counts()
    assert counts["lookup"][0] == 2 and counts["save"][1] == 2 * (150 // BT)
    runner.close()


def test_store_runs_in_background_and_owns_its_buffer(baseline):
    """A Put that cannot finish does not hold up the next steps, and reusing the cache
    blocks before the Put finished does not change what is stored."""
    p1, g1, p2, g2 = baseline
    store = FaultyStore(MemoryStore())
    store.puts_released.clear()                       # puts wait until released below
    runner = Runner(TINY, engine(), TPGroup.single(), store=store)
    try:
        runner.generate(p1, 4)
        other = np.random.default_rng(5).integers(0, TINY.vocab_size, 200).tolist()
        runner.generate(other, 2, page_back=False, store=False)   # overwrites the released blocks
        assert store.put_started.wait(60) and not store.inner.blocks   # the steps did not wait for it
    finally:
        store.puts_released.set()
    assert runner.flush(timeout_s=60)
    assert len(store.inner.blocks) == 150 // BT
    out = runner.generate(p2, 4, store=False)
    assert out.stats.paged_tokens == 150 // BT * BT
    assert_same(out, g2)
    runner.close()
