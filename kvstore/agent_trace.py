"""``kvstore gen-agent-trace``: a synthetic ReAct agent workload with tool-call events.

Writes two files:

- ``OUT`` (Mooncake format, see :mod:`kvstore.trace`): one line per LLM call, with
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per
  512-token block; equal ids = identical prefixes, the last block possibly partial).
- ``OUT`` with ``.events.jsonl`` in place of ``.jsonl``: the tool-call hints a worker
  would send, in time order::

      {"time": 12.345, "event": "tool_call_start", "trajectory": "a3-e1", "tool": "search",
       "hash_ids": [0, 1, 2, 17, 18]}
      {"time": 13.101, "event": "resume", "trajectory": "a3-e1"}

  ``time`` in seconds from the trace start; ``hash_ids`` are the trajectory's stored
  full blocks (the next call's prompt starts with them); a ``resume`` is at the same
  time as the trajectory's next request.

The workload: ``agents`` agents run concurrently and back to back; each runs episodes
(trajectories) of the ReAct loop (Yao et al., "ReAct: Synergizing reasoning and acting
in language models", ICLR'23): the prompt is a system prompt shared by all agents,
the task, then per turn the model's message (thought + action) and the tool's
observation. Each LLM call takes a prefill (uncached tokens / ``prefill_tps``) and a
decode (``output tokens * tpot_s``); the tool call starts when decoding ends, and the
next call arrives when the tool returns. The last turn of an episode answers without
a tool; the agent starts its next episode after an exponential pause.

Distributions (all seeded by ``seed``; log-normals are given by median and sigma of the
natural log):

=================  =========================================================  ==========
quantity           distribution                                               default
=================  =========================================================  ==========
system prompt      fixed, shared by all agents                                 2048 tok
task               log-normal                                                 300 tok, 0.8
turns / episode    1 + geometric, mean ``mean_turns``, capped at ``max_turns``  8, 30
model message      log-normal                                                 120 tok, 0.6
tool choice        categorical over the tools' weights                        see below
pause between      exponential                                                mean 5 s
episodes
=================  =========================================================  ==========

Tools (duration median s / sigma; observation median tokens / sigma; weight):

- ``search``  0.8 s / 0.4;  400 tok / 0.5;  0.35   (web search API round trip)
- ``browse``  2.5 s / 0.5; 1200 tok / 0.6;  0.25   (fetch and extract a page)
- ``python``  4.0 s / 0.9;  250 tok / 1.0;  0.25   (sandboxed code execution)
- ``tests``  20.0 s / 0.7;  600 tok / 0.7;  0.10   (run a test suite / build)
- ``human``  30.0 s / 1.0;   60 tok / 0.8;  0.05   (ask the user; human think time)

Where they come from: these are assumptions chosen to span the range the project's
design note gives ("tool calls take from 100 ms to minutes", README.md, "Agent-aware placement") with
distinct, overlapping per-tool latencies; log-normal shapes follow the usual model of
service and human think times (Limpert et al., BioScience 2001). They are not fitted
to a measured agent trace: replace them with measured values (``--tools FILE``, a
JSON list of objects with the fields of :class:`Tool`) when one is available.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import pathlib
import random
import sys
from dataclasses import dataclass, field

from .cliargs import positive_float, positive_int
from .trace import TRACE_BLOCK_TOKENS, TraceError


@dataclass(frozen=True)
class Tool:
    """A tool with log-normal duration (seconds) and observation size (tokens)."""

    name: str
    duration_median_s: float
    duration_sigma: float
    observation_median_tokens: float
    observation_sigma: float
    weight: float


DEFAULT_TOOLS: tuple[Tool, ...] = (
    Tool("search", 0.8, 0.4, 400, 0.5, 0.35),
    Tool("browse", 2.5, 0.5, 1200, 0.6, 0.25),
    Tool("python", 4.0, 0.9, 250, 1.0, 0.25),
    Tool("tests", 20.0, 0.7, 600, 0.7, 0.10),
    Tool("human", 30.0, 1.0, 60, 0.8, 0.05),
)


@dataclass(frozen=True)
class AgentWorkload:
    """Parameters of :func:`generate` (tokens, seconds)."""

    agents: int = 32
    duration_s: float = 1800.0
    seed: int = 0
    system_tokens: int = 2048
    task_median_tokens: float = 300.0
    task_sigma: float = 0.8
    mean_turns: float = 8.0
    max_turns: int = 30
    message_median_tokens: float = 120.0
    message_sigma: float = 0.6
    pause_mean_s: float = 5.0
    prefill_tps: float = 8000.0      # uncached prompt tokens per second
    tpot_s: float = 0.03             # seconds per output token
    block_tokens: int = TRACE_BLOCK_TOKENS
    tools: tuple[Tool, ...] = DEFAULT_TOOLS

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError(f"agents must be >= 1, got {self.agents}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.mean_turns < 1 or self.max_turns < 1:
            raise ValueError("mean_turns and max_turns must be >= 1")
        if not self.tools or any(t.weight <= 0 or t.duration_median_s <= 0 for t in self.tools):
            raise ValueError("tools need positive weights and durations")


@dataclass(frozen=True)
class ToolEvent:
    """A tool-call hint: ``kind`` is ``"tool_call_start"`` or ``"resume"``; ``time_s`` in
    seconds from the trace start; ``hash_ids`` only for a start."""

    time_s: float
    kind: str
    trajectory: str
    tool: str = ""
    hash_ids: tuple[int, ...] = ()

    def to_json(self) -> str:
        d: dict = {"time": round(self.time_s, 6), "event": self.kind, "trajectory": self.trajectory}
        if self.kind == "tool_call_start":
            d["tool"] = self.tool
            d["hash_ids"] = list(self.hash_ids)
        return json.dumps(d)


EVENT_KINDS = ("tool_call_start", "resume")


def events_path(trace_path: str | pathlib.Path) -> pathlib.Path:
    """The events file that goes with a trace: ``x.jsonl`` -> ``x.events.jsonl``."""
    p = pathlib.Path(trace_path)
    stem = p.name[:-len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".events.jsonl")


def read_tool_events(path: str | pathlib.Path) -> list[ToolEvent]:
    """Read an events file, sorted by time (stable). Raises TraceError naming the line."""
    out: list[ToolEvent] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read events {str(path)!r}: {e.strerror or e}") from None
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise TraceError(f"{where}: expected a JSON object")
            kind, traj, t = d.get("event"), d.get("trajectory"), d.get("time")
            if kind not in EVENT_KINDS:
                raise TraceError(f"{where}: event must be one of {EVENT_KINDS}, got {kind!r}")
            if not isinstance(traj, str) or not traj:
                raise TraceError(f"{where}: trajectory must be a non-empty string")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise TraceError(f"{where}: time must be a number >= 0, got {t!r}")
            ids: tuple[int, ...] = ()
            tool = ""
            if kind == "tool_call_start":
                tool = d.get("tool")
                raw = d.get("hash_ids")
                if not isinstance(tool, str) or not tool:
                    raise TraceError(f"{where}: tool must be a non-empty string")
                if not isinstance(raw, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in raw):
                    raise TraceError(f"{where}: hash_ids must be a list of integers")
                ids = tuple(raw)
            out.append(ToolEvent(float(t), kind, traj, tool, ids))
    out.sort(key=lambda e: e.time_s)
    return out


# --------------------------------------------------------------------------- generator


@dataclass
class _Agent:
    idx: int
    episode: int = 0
    trajectory: str = ""
    tokens: int = 0                # prompt tokens so far in this trajectory
    full_ids: list[int] = field(default_factory=list)
    turn: int = 0
    turns: int = 0


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def generate(w: AgentWorkload) -> tuple[list[dict], list[ToolEvent]]:
    """Simulate the agents; returns (Mooncake request dicts sorted by time, events).

    Deterministic for a given ``w`` (one ``random.Random(w.seed)``; agents interleave by
    a time-ordered event queue, ties broken by agent index).
    """
    rng = random.Random(w.seed)
    bt = w.block_tokens
    next_id = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    shared_ids = [new_id() for _ in range(w.system_tokens // bt)]
    weights = [t.weight for t in w.tools]
    p_stop = 1.0 / max(w.mean_turns, 1.0)
    requests: list[dict] = []
    events: list[ToolEvent] = []
    queue: list[tuple[float, int]] = []
    agents = [_Agent(i) for i in range(w.agents)]

    def start_episode(a: _Agent) -> None:
        a.episode += 1
        a.trajectory = f"a{a.idx}-e{a.episode}"
        a.tokens = w.system_tokens + max(1, int(_lognormal(rng, w.task_median_tokens, w.task_sigma)))
        a.full_ids = list(shared_ids)
        a.turn = 0
        turns = 1
        while turns < w.max_turns and rng.random() > p_stop:
            turns += 1
        a.turns = turns

    for a in agents:   # staggered starts over the first pause
        start_episode(a)
        heapq.heappush(queue, (rng.expovariate(1.0 / w.pause_mean_s), a.idx))

    cached_by_traj: dict[str, int] = {}
    while queue:
        t, idx = heapq.heappop(queue)
        if t > w.duration_s:
            continue
        a = agents[idx]
        # the prompt: full blocks keep their ids, new full blocks and the partial tail get new ones
        n_full = a.tokens // bt
        while len(a.full_ids) < n_full:
            a.full_ids.append(new_id())
        ids = a.full_ids[:n_full] + ([new_id()] if a.tokens % bt else [])
        out_tokens = max(1, int(_lognormal(rng, w.message_median_tokens, w.message_sigma)))
        ts_ms = int(round(t * 1000))
        requests.append({"timestamp": ts_ms, "input_length": a.tokens, "output_length": out_tokens,
                         "hash_ids": ids})
        cached = cached_by_traj.get(a.trajectory, 0)
        busy = max(a.tokens - cached, 0) / w.prefill_tps + out_tokens * w.tpot_s
        end = ts_ms / 1000.0 + busy
        a.turn += 1
        if a.turn >= a.turns:               # final answer: no tool call
            cached_by_traj.pop(a.trajectory, None)
            start_episode(a)
            heapq.heappush(queue, (end + rng.expovariate(1.0 / w.pause_mean_s), idx))
            continue
        tool = rng.choices(w.tools, weights)[0]
        duration = _lognormal(rng, tool.duration_median_s, tool.duration_sigma)
        obs = max(1, int(_lognormal(rng, tool.observation_median_tokens, tool.observation_sigma)))
        stored = a.full_ids[:n_full]
        events.append(ToolEvent(end, "tool_call_start", a.trajectory, tool.name, tuple(stored)))
        resume_ms = int(math.ceil((end + duration) * 1000))
        events.append(ToolEvent(resume_ms / 1000.0, "resume", a.trajectory))
        cached_by_traj[a.trajectory] = n_full * bt
        a.tokens += out_tokens + obs
        heapq.heappush(queue, (resume_ms / 1000.0, idx))

    requests.sort(key=lambda r: r["timestamp"])
    # drop events of resumes whose request fell beyond the duration (not in the trace)
    last_ms = requests[-1]["timestamp"] if requests else 0
    events = [e for e in events if e.time_s * 1000.0 <= last_ms or e.kind == "tool_call_start"]
    events.sort(key=lambda e: e.time_s)
    return requests, events


def write(w: AgentWorkload, out: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int, int]:
    """Generate and write the trace and its events. Returns (trace, events, #requests, #events)."""
    requests, events = generate(w)
    out = pathlib.Path(out)
    ev = events_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    with open(ev, "w", encoding="utf-8") as f:
        for e in events:
            f.write(e.to_json() + "\n")
    return out, ev, len(requests), len(events)


def _load_tools(path: str) -> tuple[Tool, ...]:
    try:
        data = json.loads(pathlib.Path(path).read_text())
        return tuple(Tool(**d) for d in data)
    except (OSError, ValueError, TypeError) as e:
        raise SystemExit(f"kvstore gen-agent-trace: bad --tools file {path}: {e}")


def cmd_gen_agent_trace(args: argparse.Namespace) -> int:
    tools = _load_tools(args.tools) if args.tools else DEFAULT_TOOLS
    try:
        w = AgentWorkload(agents=args.agents, duration_s=args.duration, seed=args.seed,
                          mean_turns=args.mean_turns, system_tokens=args.system_tokens, tools=tools)
    except ValueError as e:
        print(f"kvstore gen-agent-trace: {e}", file=sys.stderr)
        return 2
    trace, ev, n_req, n_ev = write(w, args.out)
    print(f"wrote {n_req} requests to {trace} and {n_ev} tool-call events to {ev}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gen-agent-trace", help="write a synthetic ReAct agent trace with tool-call events",
                       description="Generate a Mooncake-format trace of N concurrent ReAct agents plus "
                                   "a .events.jsonl file of ToolCallStart/Resume hints (seeded).")
    p.add_argument("out", help="trace file to write, e.g. agents.jsonl (events go to agents.events.jsonl)")
    p.add_argument("--agents", type=positive_int, default=32, help="concurrent agents (default 32)")
    p.add_argument("--duration", type=positive_float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--mean-turns", type=positive_float, default=8.0, help="mean LLM calls per episode (default 8)")
    p.add_argument("--system-tokens", type=positive_int, default=2048, help="shared system prompt tokens (default 2048)")
    p.add_argument("--tools", help="JSON file: list of tools (fields of kvstore.agent_trace.Tool)")
    p.set_defaults(func=cmd_gen_agent_trace)
