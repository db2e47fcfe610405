"""``kvstore gen-agent-trace OUT``: the command line of the agent-trace generator
(:mod:`kvstore.tools.agent_trace`).

Refused with exit status 2 before anything is written: options whose expected request
count (:func:`~kvstore.tools.agent_trace.expected_requests`) is over
:data:`~kvstore.tools.agent_trace.MAX_REQUESTS`, non-finite numbers, a bad ``--tools``
file, an output (``OUT`` or its events file) that cannot be written (a missing folder is
not created), a run that reaches a size limit while generating, and a duration in which no
request starts (an empty trace, which ``replay`` and ``simulate`` refuse).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvstore.tools.agent_trace import (
    DEFAULT_TOOLS,
    MAX_REQUESTS,
    MAX_SYSTEM_TOKENS,
    AgentWorkload,
    ChatTraffic,
    Tool,
    TraceTooLarge,
    events_path,
    expected_requests,
    generate,
    write_files,
)
from kvstore.tools.cliargs import (
    non_negative_float,
    output_error,
    non_empty_path,
    positive_float,
    positive_int,
    probability_below_one,
)

PROG = "kvstore gen-agent-trace"


def _load_tools(file: str) -> tuple[Tool, ...]:
    """The tools of a ``--tools`` JSON file. Raises ValueError naming the file."""
    try:
        data = json.loads(pathlib.Path(file).read_text())
        if not isinstance(data, list) or not data:
            raise ValueError("expected a non-empty JSON list of objects with the fields of Tool")
        return tuple(Tool(**d) for d in data)
    except (OSError, ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"bad --tools file {file}: {e}") from None


def _system_tokens(text: str) -> int:
    value = positive_int(text)
    if value > MAX_SYSTEM_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SYSTEM_TOKENS}, got {value}")
    return value


def cmd_gen_agent_trace(args: argparse.Namespace) -> int:
    """Generate and write the trace; returns 0, or 2 with a one-line error on stderr."""
    try:
        tools = _load_tools(args.tools) if args.tools else DEFAULT_TOOLS
        chat = ChatTraffic(sessions_per_s=args.chat_rate) if args.chat_rate > 0 else None
        w = AgentWorkload(agents=args.agents, duration_s=args.duration, seed=args.seed,
                          mean_turns=args.mean_turns, system_tokens=args.system_tokens, tools=tools,
                          abandon_prob=args.abandon, chat=chat)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    expected = expected_requests(w)
    if expected > MAX_REQUESTS:
        print(f"{PROG}: --duration {args.duration:g} s with {args.agents} agents and {args.chat_rate:g} chat "
              f"conversations/s makes about {expected:.3g} requests; at most {MAX_REQUESTS} (give a shorter "
              f"--duration, fewer --agents or a lower --chat-rate)", file=sys.stderr)
        return 2
    for out in (args.out, events_path(args.out)):     # before the work; a missing folder is not made
        why = output_error(out)
        if why:
            print(f"{PROG}: cannot write {out}: {why}", file=sys.stderr)
            return 2
    try:
        requests, events = generate(w)
    except TraceTooLarge as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if not requests:
        print(f"{PROG}: no request starts within --duration {args.duration:g} s (each agent starts after a "
              f"pause of {w.pause_mean_s:g} s on average): give a longer --duration", file=sys.stderr)
        return 2
    try:
        trace, ev, n_req, n_ev = write_files(requests, events, args.out)
    except OSError as e:
        print(f"{PROG}: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {n_req} requests to {trace} and {n_ev} tool-call and session events to {ev}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gen-agent-trace", help="write a synthetic agent trace with tool-call and session events",
                       description="Generate a Mooncake-format trace of N concurrent ReAct agents plus competing "
                                   "chat traffic, and a .events.jsonl file of ToolCallStart/Resume/session-end "
                                   "hints (seeded). Distributions and their sources: kvstore/tools/agent_trace.py. "
                                   f"At most {MAX_REQUESTS} requests per trace.")
    p.add_argument("out", type=non_empty_path, help="trace file to write, e.g. agents.jsonl (events go to "
                                          "agents.events.jsonl; the folder must exist)")
    p.add_argument("--agents", type=positive_int, default=32, help="concurrent agents (default 32)")
    p.add_argument("--duration", type=positive_float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--mean-turns", type=positive_float, default=12.0, help="mean LLM calls per episode (default 12)")
    p.add_argument("--system-tokens", type=_system_tokens, default=2048,
                   help=f"shared system prompt tokens (default 2048, at most {MAX_SYSTEM_TOKENS})")
    p.add_argument("--abandon", type=probability_below_one, default=0.03,
                   help="probability a trajectory is abandoned during a tool call, in [0, 1) (default 0.03)")
    p.add_argument("--chat-rate", type=non_negative_float, default=0.1,
                   help="competing chat conversations per second (default 0.1; 0: none)")
    p.add_argument("--tools", type=non_empty_path,
                   help="JSON file: list of tools (fields of kvstore.tools.agent_trace.Tool)")
    p.set_defaults(func=cmd_gen_agent_trace)
