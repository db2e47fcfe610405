"""``kvstore agent-demo``: a TP=2 runner plays a multi-turn agent session against a daemon.

Start a daemon, then the demo::

    kvstore serve &                                   # or: kvstore serve --config node.toml
    kvstore agent-demo --target unix:kvstore-data/kvstore.sock

Two TP ranks (processes, gloo on CPU) serve a seeded Llama-style model. The session is
a system prompt, then turns that each append a tool observation and generate a short
answer (:mod:`engine_adapter.reference.session`). Every turn is run twice in the same process:
first the recompute baseline (no store: the whole prompt is prefilled), then with the
store (the prefix is paged back, only the suffix is prefilled, new blocks are stored).
Rank 0 prints, per turn, the tokens paged back vs prefilled, both TTFTs (time to first
token), and whether both runs chose the same tokens.

The command line (arguments, ``register``) is :mod:`kvstore.tools.agent_demo_cmd`; this module
is the demo itself. It is imported by the CLI at start, so torch is imported only when the
demo runs.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_SIZES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)
    "tiny": (128, 256, 4, 4, 2, 32, 512),
    "small": (512, 1536, 8, 8, 4, 64, 2048),
}


@dataclass(frozen=True)
class DemoOptions:
    """Everything a TP rank of the demo needs (picklable)."""

    target: str
    model: str
    checkpoint: str | None
    seed: int
    dtype: str
    block_tokens: int
    tenant: str
    turns: int
    system_tokens: int
    observation_tokens: int
    answer_tokens: int
    tool_wait_s: float
    store_timeout_s: float
    lookup_timeout_s: float = 0.05


def _model_config(opts: DemoOptions):
    from engine_adapter.reference.config import ModelConfig

    if opts.checkpoint:
        return ModelConfig.from_checkpoint(opts.checkpoint)
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = MODEL_SIZES[opts.model]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _row(rec) -> dict:
    import numpy as np

    r, b = rec.result, rec.baseline
    return dict(turn=rec.turn, prompt=rec.prompt_tokens, paged=r.stats.paged_tokens,
                prefilled=r.stats.prefilled_tokens, ttft_store_ms=r.ttft_s * 1e3, ttft_recompute_ms=b.ttft_s * 1e3,
                same_tokens=r.tokens == b.tokens, max_logit_diff=float(np.abs(r.logits - b.logits).max()),
                problems=list(r.stats.problems))


HEADER = (f"{'turn':>4} {'prompt':>7} {'paged back':>10} {'prefilled':>9} {'TTFT store':>11} "
          f"{'TTFT recompute':>15} {'speedup':>8}  same tokens (max |dlogit|)")


def speedup(rows: list[dict]) -> float | None:
    """Recompute TTFT over store TTFT, summed over the ``rows`` that paged tokens back; None
    when none did (a turn that paged nothing back prefilled the whole prompt both times:
    any difference is noise, not the store's)."""
    paged = [r for r in rows if r["paged"] > 0]
    if not paged:
        return None
    return sum(r["ttft_recompute_ms"] for r in paged) / max(sum(r["ttft_store_ms"] for r in paged), 1e-9)


def format_row(row: dict) -> str:
    """One turn's line under :data:`HEADER`; the speedup is ``-`` for a turn that paged nothing back."""
    ratio = speedup([row])
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    line = (f"{row['turn']:>4} {row['prompt']:>7} {row['paged']:>10} {row['prefilled']:>9} "
            f"{row['ttft_store_ms']:>9.1f}ms {row['ttft_recompute_ms']:>13.1f}ms {shown:>8}  "
            f"{'yes' if row['same_tokens'] else 'NO'} ({row['max_logit_diff']:.1e})")
    if row["problems"]:
        line += "  [" + "; ".join(row["problems"]) + "]"
    return line


def demo_rank(tp, opts: DemoOptions) -> list[dict]:
    """One TP rank of the demo; rank 0 prints. Returns the per-turn rows."""
    import time

    from kvstore.client.client import KVStoreClient
    from kvstore.common.errors import KVStoreError

    from engine_adapter.reference.config import EngineConfig
    from engine_adapter.reference.runner import Runner, make_weights
    from engine_adapter.reference.session import AgentSession, SessionOptions, play_session

    model = _model_config(opts)
    engine = EngineConfig(
        model_id=(opts.checkpoint or f"seeded-llama/{model.fingerprint()}/seed={opts.seed}"),
        dtype=opts.dtype, block_tokens=opts.block_tokens, tenant=opts.tenant,
        num_cache_blocks=-(-(opts.system_tokens + opts.turns * (opts.observation_tokens + opts.answer_tokens))
                           // opts.block_tokens) + 8,
        store_timeout_s=opts.store_timeout_s, load_timeout_s=max(opts.store_timeout_s, 1.0),
        lookup_timeout_s=opts.lookup_timeout_s)
    client = KVStoreClient(opts.target, timeout=opts.store_timeout_s)
    runner = Runner(model, engine, tp, store=client, weights=make_weights(model, opts.checkpoint, opts.seed))
    session = AgentSession(turns=opts.turns, system_tokens=opts.system_tokens,
                           observation_tokens=opts.observation_tokens, answer_tokens=opts.answer_tokens,
                           seed=opts.seed)
    runner.generate([1, 2, 3], 2, page_back=False, store=False)      # warm up allocator and kernels
    trajectory = f"agent-demo-{opts.tenant}"
    hints = {"on": tp.is_first}

    def after_turn(rec) -> None:
        if tp.is_first:
            print(format_row(_row(rec)), flush=True)
        if rec.turn == session.turns or opts.tool_wait_s <= 0:
            return
        if hints["on"]:   # tell the daemon the agent waits on a tool (prefetch hint)
            try:
                client.tool_call_start(trajectory, "tool", runner.adapter.keyer.keys(rec.prompt))
            except KVStoreError as e:
                print(f"(tool-call hints off: {e})", flush=True)
                hints["on"] = False
        time.sleep(opts.tool_wait_s)
        if hints["on"]:
            try:
                client.resume(trajectory)
            except KVStoreError:
                hints["on"] = False

    if tp.is_first:
        print(f"model {engine.model_id} ({model.num_layers} layers, {model.num_kv_heads} KV heads, "
              f"{engine.dtype}), TP={tp.world_size}, block_tokens={engine.block_tokens}, daemon {opts.target}")
        print(HEADER, flush=True)
    try:
        records = play_session(runner, session, SessionOptions(baseline=True, after_turn=after_turn))
    finally:
        runner.close()
        client.close()
    return [_row(r) for r in records]


def run_demo(opts: DemoOptions, tp_size: int) -> int:
    """Play the demo on ``tp_size`` TP ranks (processes); rank 0 prints each turn and the totals.

    Returns the exit code: 0 when the greedy tokens were identical with and without the
    store in every turn, 1 when they differed or no daemon answers at ``opts.target``, 2
    when ``tp_size`` does not divide the seeded model's query and KV heads.
    """
    from kvstore.client.client import KVStoreClient
    from kvstore.common.errors import KVStoreError, StoreUnavailable

    from engine_adapter.reference.tp import launch

    if opts.checkpoint is None:
        _, _, _, heads, kv_heads, _, _ = MODEL_SIZES[opts.model]
        if heads % tp_size or kv_heads % tp_size:
            print(f"--tp {tp_size} must divide the {opts.model} model's {heads} query and {kv_heads} KV heads")
            return 2
    with KVStoreClient(opts.target) as probe:
        try:
            probe.stats(timeout=5.0)
        except StoreUnavailable as e:
            print(f"no kvstore daemon answers at {opts.target} ({e}); start one with `kvstore serve`")
            return 1
        except KVStoreError as e:       # it answers, but refuses (e.g. UNAUTHENTICATED)
            print(f"the kvstore daemon at {opts.target} refused the demo: {e}")
            return 1
    rows = launch(demo_rank, tp_size, opts)[0]
    paged = sum(r["paged"] for r in rows)
    prefilled = sum(r["prefilled"] for r in rows)
    t_store = sum(r["ttft_store_ms"] for r in rows)
    t_base = sum(r["ttft_recompute_ms"] for r in rows)
    same = all(r["same_tokens"] for r in rows)
    ratio = speedup(rows)
    paged_turns = sum(1 for r in rows if r["paged"] > 0)
    shown = ("no turn paged back: no speedup" if ratio is None
             else f"{ratio:.2f}x over the {paged_turns} turns that paged back")
    print(f"total: {paged} tokens paged back, {prefilled} prefilled; TTFT {t_store:.1f}ms with the store vs "
          f"{t_base:.1f}ms recomputing ({shown}); "
          f"greedy tokens {'identical' if same else 'DIFFERENT'} in every turn")
    return 0 if same else 1
