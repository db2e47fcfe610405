"""``kvstore gen-agent-trace``: a synthetic agent workload with tool-call and session events.

Writes two files:

- ``OUT`` (Mooncake format, see :mod:`kvstore.tools.trace`): one line per LLM call, with
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per
  512-token block; equal ids = identical prefixes, the last block possibly partial);
- ``OUT`` with ``.events.jsonl`` in place of ``.jsonl``: the hints a worker would send
  (tool-call starts, resumes, session ends; :mod:`kvstore.tools.agent_events`).

**Agents.** ``agents`` agents run concurrently and back to back; each runs episodes
(trajectories) of the ReAct loop (Yao et al., ICLR'23): the prompt is a system prompt
shared by all agents, the task, then per turn the model's message (thought + action)
and the tool's observation. Each LLM call takes a prefill (uncached tokens /
``prefill_tps``) and a decode (output tokens x ``tpot_s``); the tool call starts when
decoding ends and the next call arrives when the tool returns. The last turn answers
without a tool (session end: *finished*). During a tool call a trajectory is
*abandoned* with probability ``abandon_prob`` (the user leaves, the framework cuts the
branch): it never resumes, and with probability ``abandon_hint_prob`` the framework says
so (session end: *abandoned*) at a time uniform within the call. The agent starts its
next episode after an exponential pause.

**Chat traffic** (``chat``, :class:`ChatTraffic`) competes for the same tiers:
conversations arrive as a Poisson process; each turn continues with probability
``continue_prob`` after a human gap; no hints are sent for them.

Distributions (log-normals by median and sigma of the natural log; all seeded):

=====================  ==========================================  =======================
quantity               default                                     source
=====================  ==========================================  =======================
system prompt          2048 tokens, shared by all agents           assumption
task                   300 tokens, sigma 0.8                       assumption
turns / episode        1 + geometric, mean 12, at most 60          MORI (arXiv 2606.00866):
                                                                   tens of calls per session
model message          120 tokens, sigma 0.6                       assumption
tool durations         below; sigma >= 1.5 (sub-second to minutes) see the tools
human wait             123 s, sigma 1.04                           Mooncake conversation
                                                                   trace: gap between a
                                                                   conversation's turns
chat first prompt      5956 tokens, sigma 1.69                     Mooncake conversation
chat turn adds         481 tokens, sigma 0.83                      trace (first requests,
chat continues         0.37 per turn, gap 123 s, sigma 1.04        continuations, gaps)
chat arrivals          0.1 conversations / s                       assumption (scaled)
=====================  ==========================================  =======================

Tools (duration median s / sigma; observation median tokens / sigma; weight):

- ``read``    0.3 s / 1.5;   800 / 1.0; 0.28  local file read, grep, list (most agent tool
  calls take under a second: SyFI Trace Atlas, UW, Claude Code and Codex traces)
- ``search``  1.2 s / 1.5;   500 / 0.7; 0.20  web search API round trip
- ``bash``    3.0 s / 1.8;   400 / 1.2; 0.25  shell and code execution (a Claude Code Bash
  call costs ~3.4 s of overhead alone, measured with its OpenTelemetry spans)
- ``browse``  5.0 s / 1.5;  1500 / 0.8; 0.10  fetch and extract a page
- ``tests``  40.0 s / 1.5;   900 / 0.8; 0.12  test suite or build (tens of seconds to
  minutes: SWE-bench agents, Continuum arXiv 2511.02230)
- ``human`` 123.0 s / 1.04;   80 / 0.8; 0.05  a question to the user (the human wait above)

These are assumptions within the ranges those sources report, not a fit to one measured
agent trace: replace them (``--tools FILE``, a JSON list of :class:`Tool` fields) when
one is available.

**Size.** A trace holds at most :data:`MAX_REQUESTS` LLM calls and :data:`MAX_BLOCKS` block
ids in all (:func:`generate` raises :class:`TraceTooLarge` past either, so memory stays
bounded); :func:`expected_requests` estimates the count up front. The command line is
:mod:`kvstore.tools.agent_trace_cmd`.
"""

from __future__ import annotations

import heapq
import json
import math
import pathlib
import random
from dataclasses import dataclass, field

from kvstore.tools.agent_events import EVENT_KINDS, ToolEvent, events_path, read_tool_events
from kvstore.tools.trace import TRACE_BLOCK_TOKENS

__all__ = ["AgentWorkload", "ChatTraffic", "Tool", "ToolEvent", "DEFAULT_TOOLS", "EVENT_KINDS", "MAX_BLOCKS",
           "MAX_REQUESTS", "MAX_SYSTEM_TOKENS", "TraceTooLarge", "events_path", "expected_requests", "generate",
           "read_tool_events", "write", "write_files"]

MAX_REQUESTS = 1_000_000
"""Most LLM calls one generated trace holds (about 1 KiB of memory each while generating,
a few hundred bytes each on disk)."""

MAX_SYSTEM_TOKENS = 1 << 20
"""Longest shared system prompt (tokens): more than any model's context window."""

MAX_BLOCKS = 50_000_000
"""Most block ids one generated trace holds, summed over its requests' ``hash_ids`` (8 to
36 bytes of memory each while generating)."""


class TraceTooLarge(ValueError):
    """A workload would make more than :data:`MAX_REQUESTS` requests or :data:`MAX_BLOCKS`
    block ids; the message says which and by which options."""


MAX_TOOL_DURATION_S, MAX_SIGMA = 7 * 86400.0, 5.0   # a tool's median duration (a week), a log-normal's sigma


def _finite(name: str, value: float, low: float, *, open_low: bool = False, high: float = math.inf) -> None:
    """Raise ValueError unless ``value`` is a finite number >= ``low`` (> with ``open_low``), <= ``high``."""
    if not (low < value if open_low else low <= value) or not math.isfinite(value) or value > high:
        raise ValueError(f"{name} must be a finite number {'>' if open_low else '>='} {low:g}"
                         f"{f' and <= {high:g}' if high < math.inf else ''}, got {value}")


@dataclass(frozen=True)
class Tool:
    """A tool with log-normal duration (seconds) and observation size (tokens)."""

    name: str
    duration_median_s: float
    duration_sigma: float
    observation_median_tokens: float
    observation_sigma: float
    weight: float

    def __post_init__(self) -> None:
        for name in ("duration_median_s", "observation_median_tokens", "weight"):
            _finite(f"tool {self.name!r}: {name}", getattr(self, name), 0, open_low=True,
                    high=MAX_TOOL_DURATION_S if name == "duration_median_s" else math.inf)
        for name in ("duration_sigma", "observation_sigma"):
            _finite(f"tool {self.name!r}: {name}", getattr(self, name), 0, high=MAX_SIGMA)


DEFAULT_TOOLS: tuple[Tool, ...] = (
    Tool("read", 0.3, 1.5, 800, 1.0, 0.28),
    Tool("search", 1.2, 1.5, 500, 0.7, 0.20),
    Tool("bash", 3.0, 1.8, 400, 1.2, 0.25),
    Tool("browse", 5.0, 1.5, 1500, 0.8, 0.10),
    Tool("tests", 40.0, 1.5, 900, 0.8, 0.12),
    Tool("human", 123.0, 1.04, 80, 0.8, 0.05),
)


@dataclass(frozen=True)
class ChatTraffic:
    """Competing chat conversations (tokens, seconds), fitted to the Mooncake
    conversation trace except the rate."""

    sessions_per_s: float = 0.1
    first_median_tokens: float = 5956.0
    first_sigma: float = 1.69
    max_tokens: int = 65536
    added_median_tokens: float = 481.0
    added_sigma: float = 0.83
    continue_prob: float = 0.37
    gap_median_s: float = 123.0
    gap_sigma: float = 1.04
    output_median_tokens: float = 350.0

    def __post_init__(self) -> None:
        if not 0 <= self.sessions_per_s < math.inf or not 0 <= self.continue_prob < 1:
            raise ValueError(f"chat: sessions_per_s must be a finite number >= 0 (got {self.sessions_per_s}) and "
                             f"continue_prob in [0, 1) (got {self.continue_prob})")


@dataclass(frozen=True)
class AgentWorkload:
    """Parameters of :func:`generate` (tokens, seconds, probabilities)."""

    agents: int = 32
    duration_s: float = 1800.0
    seed: int = 0
    system_tokens: int = 2048
    task_median_tokens: float = 300.0
    task_sigma: float = 0.8
    mean_turns: float = 12.0
    max_turns: int = 60
    message_median_tokens: float = 120.0
    message_sigma: float = 0.6
    pause_mean_s: float = 5.0
    abandon_prob: float = 0.03
    abandon_hint_prob: float = 1.0
    prefill_tps: float = 8000.0      # uncached prompt tokens per second
    tpot_s: float = 0.03             # seconds per output token
    block_tokens: int = TRACE_BLOCK_TOKENS
    tools: tuple[Tool, ...] = DEFAULT_TOOLS
    chat: ChatTraffic | None = field(default_factory=ChatTraffic)

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError(f"agents must be >= 1, got {self.agents}")
        _finite("duration_s", self.duration_s, 0, open_low=True)
        for name in ("pause_mean_s", "prefill_tps", "message_median_tokens", "task_median_tokens"):
            _finite(name, getattr(self, name), 0, open_low=True)
        for name in ("tpot_s", "message_sigma", "task_sigma"):
            _finite(name, getattr(self, name), 0)
        if not 0 < self.system_tokens <= MAX_SYSTEM_TOKENS:
            raise ValueError(f"system_tokens must be in [1, {MAX_SYSTEM_TOKENS}], got {self.system_tokens}")
        if not 1 <= self.mean_turns < math.inf or self.max_turns < 1:
            raise ValueError(f"mean_turns (a finite number) and max_turns must be >= 1, got {self.mean_turns} "
                             f"and {self.max_turns}")
        if not self.tools or any(t.weight <= 0 or t.duration_median_s <= 0 for t in self.tools):
            raise ValueError("tools need positive weights and durations")
        if not 0 <= self.abandon_prob < 1 or not 0 <= self.abandon_hint_prob <= 1:
            raise ValueError("abandon_prob must be in [0, 1) and abandon_hint_prob in [0, 1]")


@dataclass
class _Session:
    """An agent trajectory or a chat conversation in progress."""

    sid: str
    tokens: int                    # prompt tokens so far
    full_ids: list[int]            # ids of its full blocks
    turns: int = 0                 # LLM calls left (agents) / made (chat)
    cached: int = 0                # tokens stored after the previous call
    agent: int = -1                # agent index, -1 for chat


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


class _Generator:
    def __init__(self, w: AgentWorkload):
        self.w = w
        self.rng = random.Random(w.seed)
        self.next_id = 0
        self.blocks = 0                # block ids in self.requests (<= MAX_BLOCKS)
        self.requests: list[dict] = []
        self.events: list[ToolEvent] = []
        self.queue: list[tuple[float, int, str]] = []   # (time, seq, session id)
        self.sessions: dict[str, _Session] = {}
        self.seq = 0
        self.episodes = [0] * w.agents
        self.shared = self.new_ids(w.system_tokens // w.block_tokens)
        self.chat_shared = self.new_ids(1)
        self.chats = 0

    def new_ids(self, n: int) -> list[int]:
        self.next_id += n
        return list(range(self.next_id - n, self.next_id))

    def push(self, t: float, sid: str) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, sid))

    def start_episode(self, agent: int, t: float) -> None:
        w, rng = self.w, self.rng
        self.episodes[agent] += 1
        sid = f"a{agent}-e{self.episodes[agent]}"
        turns = 1
        while turns < w.max_turns and rng.random() > 1.0 / w.mean_turns:
            turns += 1
        tokens = w.system_tokens + max(1, int(_lognormal(rng, w.task_median_tokens, w.task_sigma)))
        self.sessions[sid] = _Session(sid, tokens, list(self.shared), turns, agent=agent)
        self.push(t, sid)

    def start_chat(self, t: float) -> None:
        c = self.w.chat
        self.chats += 1
        sid = f"chat{self.chats}"
        tokens = min(c.max_tokens, max(self.w.block_tokens, int(_lognormal(self.rng, c.first_median_tokens,
                                                                           c.first_sigma))))
        self.sessions[sid] = _Session(sid, tokens, list(self.chat_shared))
        self.push(t, sid)
        self.push(t + self.rng.expovariate(c.sessions_per_s), "chat-arrival")

    def request(self, s: _Session, t: float, out_tokens: int) -> tuple[float, list[int]]:
        """Emit one LLM call; returns (time its decode ends, its stored full-block ids)."""
        bt = self.w.block_tokens
        n_full = s.tokens // bt
        if len(self.requests) >= MAX_REQUESTS:
            raise TraceTooLarge(f"the workload makes more than {MAX_REQUESTS} requests by t={t:.0f} s: give a "
                                f"shorter duration, fewer agents or less chat traffic")
        self.blocks += n_full + (1 if s.tokens % bt else 0)
        if self.blocks > MAX_BLOCKS:
            raise TraceTooLarge(f"the workload's prompts hold more than {MAX_BLOCKS} blocks in all by t={t:.0f} s "
                                f"(a prompt of {s.tokens} tokens): give a shorter duration, fewer agents or "
                                f"smaller tool observations")
        while len(s.full_ids) < n_full:
            s.full_ids.extend(self.new_ids(1))
        ids = s.full_ids[:n_full] + (self.new_ids(1) if s.tokens % bt else [])
        ts_ms = int(round(t * 1000))
        self.requests.append({"timestamp": ts_ms, "input_length": s.tokens, "output_length": out_tokens,
                              "hash_ids": ids})
        busy = max(s.tokens - s.cached, 0) / self.w.prefill_tps + out_tokens * self.w.tpot_s
        s.cached = n_full * bt
        return ts_ms / 1000.0 + busy, s.full_ids[:n_full]

    def agent_turn(self, s: _Session, t: float) -> None:
        w, rng = self.w, self.rng
        out = max(1, int(_lognormal(rng, w.message_median_tokens, w.message_sigma)))
        end, stored = self.request(s, t, out)
        s.turns -= 1
        if s.turns <= 0:                              # final answer: no tool call
            self.events.append(ToolEvent(end, "session_end", s.sid, hash_ids=tuple(stored), state="finished"))
            del self.sessions[s.sid]
            self.start_episode(s.agent, end + rng.expovariate(1.0 / w.pause_mean_s))
            return
        tool = rng.choices(w.tools, [x.weight for x in w.tools])[0]
        duration = _lognormal(rng, tool.duration_median_s, tool.duration_sigma)
        obs = max(1, int(_lognormal(rng, tool.observation_median_tokens, tool.observation_sigma)))
        self.events.append(ToolEvent(end, "tool_call_start", s.sid, tool.name, tuple(stored)))
        if rng.random() < w.abandon_prob:             # never comes back
            quit_at = end + rng.random() * duration
            if rng.random() < w.abandon_hint_prob:
                self.events.append(ToolEvent(quit_at, "session_end", s.sid, hash_ids=tuple(stored),
                                             state="abandoned"))
            del self.sessions[s.sid]
            self.start_episode(s.agent, quit_at + rng.expovariate(1.0 / w.pause_mean_s))
            return
        resume = math.ceil((end + duration) * 1000) / 1000.0
        self.events.append(ToolEvent(resume, "resume", s.sid))
        s.tokens += out + obs
        self.push(resume, s.sid)

    def chat_turn(self, s: _Session, t: float) -> None:
        c, rng = self.w.chat, self.rng
        out = max(1, int(_lognormal(rng, c.output_median_tokens, 0.8)))
        end, _ = self.request(s, t, out)
        s.turns += 1
        if rng.random() >= c.continue_prob:
            del self.sessions[s.sid]
            return
        s.tokens = min(c.max_tokens, s.tokens + out + max(1, int(_lognormal(rng, c.added_median_tokens,
                                                                            c.added_sigma))))
        self.push(math.ceil((end + _lognormal(rng, c.gap_median_s, c.gap_sigma)) * 1000) / 1000.0, s.sid)

    def run(self) -> tuple[list[dict], list[ToolEvent]]:
        w, rng = self.w, self.rng
        for a in range(w.agents):   # staggered starts over the first pause
            self.start_episode(a, rng.expovariate(1.0 / w.pause_mean_s))
        if w.chat is not None and w.chat.sessions_per_s > 0:
            self.push(rng.expovariate(w.chat.sessions_per_s), "chat-arrival")
        while self.queue:
            t, _, sid = heapq.heappop(self.queue)
            if t > w.duration_s:
                continue
            if sid == "chat-arrival":
                self.start_chat(t)
            elif sid.startswith("chat"):
                self.chat_turn(self.sessions[sid], t)
            else:
                self.agent_turn(self.sessions[sid], t)
        self.requests.sort(key=lambda r: r["timestamp"])
        # drop resumes whose request fell beyond the duration (not in the trace)
        last = self.requests[-1]["timestamp"] / 1000.0 if self.requests else 0.0
        events = [e for e in self.events if e.time_s <= last or e.kind == "tool_call_start"]
        events.sort(key=lambda e: e.time_s)
        return self.requests, events


def generate(w: AgentWorkload) -> tuple[list[dict], list[ToolEvent]]:
    """Simulate the agents and chat traffic; returns (Mooncake request dicts sorted by
    time, events sorted by time). Deterministic for a given ``w`` (one
    ``random.Random(w.seed)``; sessions interleave by a time-ordered queue). Raises
    TraceTooLarge past :data:`MAX_REQUESTS` requests or :data:`MAX_BLOCKS` block ids."""
    return _Generator(w).run()


def expected_requests(w: AgentWorkload) -> float:
    """About how many requests :func:`generate` makes for ``w`` (the mean; one run differs,
    as tool durations are heavy-tailed): each agent makes one call per decode (output
    tokens x ``tpot_s``) plus, on all turns but the last, a mean tool call, plus the pause
    between episodes spread over ``mean_turns`` calls; chat conversations arrive at their
    rate with ``1 / (1 - continue_prob)`` calls each. Prefill time is left out (the estimate
    errs high)."""
    def mean(median: float, sigma: float) -> float:      # of a log-normal; capped before exp overflows
        return median * math.exp(min(sigma * sigma / 2, 700.0))

    weight = sum(t.weight for t in w.tools)
    tool_s = sum(t.weight * mean(t.duration_median_s, t.duration_sigma) for t in w.tools) / weight
    turn_s = (mean(w.message_median_tokens, w.message_sigma) * w.tpot_s + tool_s * (1 - 1 / w.mean_turns)
              + w.pause_mean_s / w.mean_turns)
    rate = w.agents / turn_s if turn_s > 0 else math.inf
    if w.chat is not None:
        rate += w.chat.sessions_per_s / (1 - w.chat.continue_prob)
    return w.duration_s * rate


def write(w: AgentWorkload, out: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int, int]:
    """Generate and write the trace and its events (:func:`write_files`). Returns
    (trace, events, #requests, #events). Raises TraceTooLarge as :func:`generate`, OSError
    as :func:`write_files`."""
    return write_files(*generate(w), out)


def write_files(requests: list[dict], events: list[ToolEvent],
                out: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int, int]:
    """Write ``requests`` to ``out`` and ``events`` next to it (:func:`events_path`).
    Returns (trace, events, #requests, #events). Raises OSError when a file cannot be
    written; a missing folder is not created."""
    out = pathlib.Path(out)
    ev = events_path(out)
    with open(out, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    with open(ev, "w", encoding="utf-8") as f:
        for e in events:
            f.write(e.to_json() + "\n")
    return out, ev, len(requests), len(events)
