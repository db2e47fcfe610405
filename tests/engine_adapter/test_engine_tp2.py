"""TP=2 (two processes, gloo, CPU) against the real daemon: a 6-turn agent session pages its
prefixes back with the same logits and greedy tokens as a full recompute, also when a block
is deleted between turns, when one rank fails to get a block mid-load, and when the daemon
is stopped mid-session; blocks written at TP=2 are read at TP=1 and the reverse."""

import threading

import numpy as np
import pytest
import torch.multiprocessing as mp

from ea_support import TINY, engine, start_daemon
from ea_tp_worker import tp2_scenarios
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.session import AgentSession, SessionOptions, play_session
from engine_adapter.reference.tp import TPGroup, launch
from kvstore.client.client import KVStoreClient

pytestmark = pytest.mark.slow         # two spawned TP ranks, seven scenarios

BT = 16
SESSION = AgentSession(turns=6, system_tokens=96, observation_tokens=40, answer_tokens=8, seed=11)
TIGHT = 1e-5     # page back vs recompute at the same TP size (fp32)
TP_TOL = 1e-4    # TP=2 vs TP=1 (all-reduce summation order)


def tp1_session(tenant, client, **options):
    runner = Runner(TINY, engine(tenant), TPGroup.single(), store=client)
    try:
        return play_session(runner, SESSION, SessionOptions(**options))
    finally:
        runner.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("daemon_a"))
    daemon_b = start_daemon(tmp_path_factory.mktemp("daemon_b"))
    client = KVStoreClient(daemon.address, timeout=60.0)
    try:
        tp1_wrote = tp1_session("x", client)                      # read at TP=2 in the spawn
        ctx = mp.get_context("spawn")
        stop_request, stopped = ctx.Event(), ctx.Event()

        def stopper():
            if stop_request.wait(120):
                daemon_b.stop(0)
                stopped.set()

        threading.Thread(target=stopper, daemon=True).start()
        ranks = launch(tp2_scenarios, 2, daemon.address, daemon_b.address, stop_request, stopped, SESSION,
                       timeout_s=300)
        tp1_reads = tp1_session("a", client, baseline=True)       # blocks written at TP=2
        yield dict(ranks=ranks, tp1_wrote=tp1_wrote, tp1_reads=tp1_reads)
    finally:
        client.close()
        daemon.stop(0)
        daemon_b.stop(0)


def check_same(turns, reference, tol=TIGHT):
    assert len(turns) == len(reference) == SESSION.turns
    for t, ref in zip(turns, reference):
        assert t["tokens"] == ref["tokens"], f"turn {t['turn']}"
        np.testing.assert_allclose(t["logits"], ref["logits"], rtol=0, atol=tol, err_msg=f"turn {t['turn']}")
        assert t["paged"] + t["prefilled"] == t["prompt_tokens"]


def test_ranks_agree_on_everything(run):
    r0, r1 = run["ranks"]
    for r in (r0, r1):
        assert "disagree on the store namespace" in r["mismatch_error"]
    for name in (k for k in r0 if k != "mismatch_error"):
        for a, b in zip(r0[name], r1[name]):
            assert (a["tokens"], a["paged"], a["restarts"]) == (b["tokens"], b["paged"], b["restarts"]), name
            np.testing.assert_array_equal(a["logits"], b["logits"])


def test_tp2_matches_tp1(run):
    tp2 = run["ranks"][0]["recompute"]
    tp1 = [dict(tokens=r.baseline.tokens, logits=r.baseline.logits, paged=0, prefilled=r.prompt_tokens,
                prompt_tokens=r.prompt_tokens, turn=r.turn) for r in run["tp1_reads"]]
    check_same(tp2, tp1, tol=TP_TOL)


def test_session_page_back_equals_recompute(run):
    ref = run["ranks"][0]["recompute"]
    got = run["ranks"][0]["page_back"]
    check_same(got, ref)
    assert got[0]["paged"] == 0
    for prev, t in zip(got, got[1:]):
        assert t["paged"] == (prev["prompt_tokens"] + SESSION.answer_tokens - 1) // BT * BT
        assert t["prefilled"] < 64 and t["restarts"] == 0 and not t["problems"]


def test_block_deleted_between_turns_is_recomputed_from_there(run):
    ref = run["ranks"][0]["recompute"]
    got = run["ranks"][0]["deleted"]
    check_same(got, ref)
    assert got[3]["lookup_hit"] == got[3]["paged"] == 5 * BT
    assert got[4]["paged"] == run["ranks"][0]["page_back"][4]["paged"]   # re-stored in turn 4


def test_one_rank_failing_mid_load_makes_both_recompute(run):
    ref = run["ranks"][0]["recompute"]
    for rank, result in enumerate(run["ranks"]):
        got = result["rank1_missing"]
        check_same(got, ref)
        turn4 = got[3]
        assert turn4["restarts"] == 1 and turn4["paged"] == 4 * BT
        assert turn4["lookup_hit"] > 4 * BT
        expected = "block 4 missing in layers 1-3" if rank == 1 else "another TP rank fell short"
        assert expected in turn4["problems"][0]
        assert got[4]["restarts"] == 0 and got[4]["paged"] > turn4["paged"]


def test_ranks_agree_on_the_shortest_lookup_before_loading(run):
    ref = run["ranks"][0]["recompute"]
    r0, r1 = (r["rank1_lookup_miss"] for r in run["ranks"])
    check_same(r0, ref)
    assert r1[3]["lookup_hit"] == 6 * BT < r0[3]["lookup_hit"]
    assert r0[3]["paged"] == r1[3]["paged"] == 6 * BT
    assert r0[3]["restarts"] == r1[3]["restarts"] == 0


def test_daemon_stopped_mid_session(run):
    ref = run["ranks"][0]["recompute"]
    got = run["ranks"][0]["daemon_stopped"]
    check_same(got, ref)
    assert all(t["paged"] > 0 for t in got[1:3])
    for t in got[3:]:
        assert t["paged"] == 0 and "lookup failed" in t["problems"][0]


def test_blocks_written_at_tp1_are_read_at_tp2(run):
    ref = run["ranks"][0]["recompute"]
    got = run["ranks"][0]["from_tp1"]
    check_same(got, ref)
    assert all(t["paged"] > 0 for t in got)    # turn 1 too: TP=1 stored its prompt


def test_blocks_written_at_tp2_are_read_at_tp1(run):
    for rec in run["tp1_reads"]:
        assert rec.result.tokens == rec.baseline.tokens
        np.testing.assert_allclose(rec.result.logits, rec.baseline.logits, rtol=0, atol=TIGHT)
        assert rec.result.stats.paged_tokens > 0
