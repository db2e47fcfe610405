"""The TP rank side of ``test_engine_tp2.py`` (runs in spawned processes, TP=2 on gloo).

One spawn plays every scenario in turn, each under its own tenant (fresh keys):

- ``recompute``: no store (the reference);
- ``page_back``: the store on, nothing goes wrong;
- ``deleted``: a block of the prefix deleted from the daemon between turns 3 and 4;
- ``rank1_missing``: TP rank 1 alone fails to get a block in the middle of turn 4's page back
  (its Lookup saw it; rank 0 loads it fine);
- ``rank1_lookup_miss``: TP rank 1's Lookup alone misses a block in turn 4 (the MIN
  agreement before loading);
- ``from_tp1``: the session's blocks were written by a TP=1 runner before the spawn;
- ``daemon_stopped``: a second daemon, stopped between turns 3 and 4.

It also checks that ranks whose namespaces differ refuse to start (``mismatch_error``).
"""

from __future__ import annotations

from ea_support import TINY, FaultyStore, engine, runner_namespace
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.session import AgentSession, SessionOptions, TurnRecord, play_session
from engine_adapter.reference.tp import TPGroup
from kvstore.client.client import KVStoreClient
from kvstore.common.keys import BlockKeyer


def summary(records: list[TurnRecord]) -> list[dict]:
    """Picklable per-turn results."""
    return [dict(turn=r.turn, prompt_tokens=r.prompt_tokens, tokens=r.result.tokens, logits=r.result.logits,
                 paged=r.result.stats.paged_tokens, prefilled=r.result.stats.prefilled_tokens,
                 lookup_hit=r.result.stats.lookup_hit_tokens, restarts=r.result.stats.restarts,
                 problems=list(r.result.stats.problems)) for r in records]


def play(tp: TPGroup, tenant: str, client, session: AgentSession, **options) -> list[dict]:
    runner = Runner(TINY, engine(tenant), tp, store=client)
    try:
        return summary(play_session(runner, session, SessionOptions(**options)))
    finally:
        runner.close()


def tp2_scenarios(tp: TPGroup, address: str, address_b: str, stop_request, stopped,
                  session: AgentSession) -> dict:
    client = KVStoreClient(address, timeout=60.0)
    out: dict = {}
    try:   # a namespace computed differently per rank is refused at construction
        Runner(TINY, engine(f"rank-{tp.rank}"), tp, store=client)
        out["mismatch_error"] = None
    except ValueError as e:
        out["mismatch_error"] = str(e)
    out["recompute"] = play(tp, "base", None, session, page_back=False, store=False)
    out["page_back"] = play(tp, "a", client, session)

    def delete_one_block(rec: TurnRecord) -> None:
        if rec.turn == 3 and tp.is_first:
            keys = BlockKeyer(runner_namespace(engine("b"))).keys(rec.prompt)
            assert client.delete([keys[5]]) == 1
        tp.barrier()

    out["deleted"] = play(tp, "b", client, session, after_turn=delete_one_block)

    faulty = FaultyStore(client)

    def hide_on_rank1(rec: TurnRecord) -> None:
        if rec.turn == 3 and tp.rank == 1:
            keys = BlockKeyer(runner_namespace(engine("c"))).keys(rec.prompt)
            faulty.arm("missing", key=keys[4], after_gets=1)     # layers 1-3 (layer 0 loads fine)
        if rec.turn == 4:
            faulty.disarm()

    out["rank1_missing"] = play(tp, "c", faulty, session, after_turn=hide_on_rank1)

    def lookup_miss_on_rank1(rec: TurnRecord) -> None:
        if rec.turn == 3 and tp.rank == 1:
            keys = BlockKeyer(runner_namespace(engine("e"))).keys(rec.prompt)
            faulty.arm("missing", key=keys[6], in_lookup=True)
        if rec.turn == 4:
            faulty.disarm()

    out["rank1_lookup_miss"] = play(tp, "e", faulty, session, after_turn=lookup_miss_on_rank1)
    out["from_tp1"] = play(tp, "x", client, session)

    client_b = KVStoreClient(address_b, timeout=60.0)

    def stop_daemon(rec: TurnRecord) -> None:
        if rec.turn == 3:
            if tp.is_first:
                stop_request.set()
            assert stopped.wait(30), "the test did not stop the daemon"
            tp.barrier()

    out["daemon_stopped"] = play(tp, "d", client_b, session, after_turn=stop_daemon)
    client.close()
    client_b.close()
    return out
