"""``kvstore agent-demo``: its arguments; the demo itself is :mod:`engine_adapter.reference.demo`."""

from __future__ import annotations

import argparse
import uuid

from engine_adapter.reference.demo import MODEL_SIZES, DemoOptions, run_demo
from kvstore.tools.cliargs import (MAX_WAIT_S, address, at_most, non_empty_path, non_negative_float, positive_float,
                                   positive_int)


def cmd_agent_demo(args: argparse.Namespace) -> int:
    """Run the demo with the parsed arguments; returns :func:`run_demo`'s exit code."""
    opts = DemoOptions(
        target=args.target, model=args.model, checkpoint=args.checkpoint, seed=args.seed, dtype=args.dtype,
        block_tokens=args.block_tokens, tenant=args.tenant or f"demo-{uuid.uuid4().hex[:8]}", turns=args.turns,
        system_tokens=args.system_tokens, observation_tokens=args.observation_tokens,
        answer_tokens=args.answer_tokens, tool_wait_s=args.tool_wait_s, store_timeout_s=args.store_timeout_s,
        lookup_timeout_s=args.lookup_timeout_s)
    return run_demo(opts, args.tp)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``agent-demo`` to the ``kvstore`` CLI."""
    p = subparsers.add_parser(
        "agent-demo", help="play a multi-turn agent session on a TP=2 runner that pages prefixes back",
        description="Start a TP runner (one process per rank) against a running daemon and play a "
                    "multi-turn agent session; per turn, print tokens paged back vs prefilled and the "
                    "TTFT with the store vs a recompute baseline measured in the same run.")
    p.add_argument("--target", type=address, default="unix:kvstore-data/kvstore.sock",
                   help="daemon address (default: the default config's socket)")
    p.add_argument("--tp", type=positive_int, default=2, help="TP size: ranks (processes) (default 2)")
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="seeded model size")
    p.add_argument("--checkpoint", type=non_empty_path, default=None,
                   help="Hugging Face Llama checkpoint folder (safetensors)")
    p.add_argument("--seed", type=int, default=0, help="weights and session seed")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--block-tokens", type=positive_int, default=16, help="tokens per block (default 16)")
    p.add_argument("--tenant", default="", help="namespace tenant (default: fresh per run)")
    p.add_argument("--turns", type=positive_int, default=6)
    p.add_argument("--system-tokens", type=positive_int, default=2048, help="system prompt tokens")
    p.add_argument("--observation-tokens", type=positive_int, default=256, help="tool observation tokens per turn")
    p.add_argument("--answer-tokens", type=positive_int, default=16, help="tokens generated per turn")
    p.add_argument("--tool-wait-s", type=at_most(non_negative_float, MAX_WAIT_S), default=0.0, help="simulated tool call between turns, seconds")
    p.add_argument("--store-timeout-s", type=at_most(positive_float, MAX_WAIT_S), default=10.0, help="deadline of each store call")
    p.add_argument("--lookup-timeout-s", type=at_most(positive_float, MAX_WAIT_S), default=0.05,
                   help="deadline of the lookup before each prefill, seconds (default 0.05: a slow store "
                        "costs a turn at most this, then a recompute)")
    p.set_defaults(func=cmd_agent_demo)
