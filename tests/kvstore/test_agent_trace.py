"""The synthetic agent workload: agents with heavy-tailed tools, session ends, chat traffic."""

from __future__ import annotations

import collections
import json
import math
import statistics

import pytest

from kvstore.tools.agent_trace import (
    DEFAULT_TOOLS,
    AgentWorkload,
    ChatTraffic,
    Tool,
    events_path,
    generate,
    read_tool_events,
    write,
)
from kvstore.tools.trace import TraceError, read_mooncake_trace


def small(**kw) -> AgentWorkload:
    base = dict(agents=4, duration_s=300.0, seed=3)
    base.update(kw)
    return AgentWorkload(**base)


def test_same_seed_same_trace_other_seed_other_trace():
    a = generate(small())
    assert generate(small()) == a
    assert generate(small(seed=4)) != a


def test_trace_and_events_are_consistent(tmp_path):
    out = tmp_path / "agents.jsonl"
    trace, ev, n_req, n_ev = write(small(agents=6, duration_s=600.0, abandon_prob=0.1), out)
    assert ev == events_path(out) == tmp_path / "agents.events.jsonl"
    reqs = read_mooncake_trace(trace)                 # valid Mooncake format (id counts checked)
    events = read_tool_events(ev)
    assert len(reqs) == n_req and len(events) == n_ev
    by_time = collections.defaultdict(list)
    chat = 0
    for r in reqs:
        by_time[r.timestamp_ms].append(r)
        if r.hash_ids[0] == 4:                         # the chat system block
            chat += 1
        else:
            assert r.hash_ids[:4] == [0, 1, 2, 3]      # the agents' shared 2048-token system prompt
    assert chat > 0
    starts, ended = {}, collections.Counter()
    for e in events:
        assert not e.trajectory.startswith("chat")    # chat sends no hints
        if e.kind == "tool_call_start":
            assert e.trajectory not in starts
            starts[e.trajectory] = e
        elif e.kind == "resume":
            s = starts.pop(e.trajectory)
            assert e.time_s > s.time_s
            # the resumed request arrives at the resume time and extends the stored prefix
            nxt = [r for r in by_time[round(e.time_s * 1000)] if r.hash_ids[:len(s.hash_ids)] == list(s.hash_ids)]
            assert nxt, f"no request continues {e.trajectory} at {e.time_s}"
        else:
            ended[e.state] += 1
            if e.state == "abandoned":                 # during a tool call, never resumed
                s = starts.pop(e.trajectory)
                assert e.time_s >= s.time_s and e.hash_ids == s.hash_ids
            assert not any(x.trajectory == e.trajectory and x.time_s > e.time_s for x in events)
    assert ended["finished"] > 0 and ended["abandoned"] > 0


def test_tool_durations_follow_their_distributions():
    tools = (Tool("fast", 1.0, 0.3, 100, 0.1, 1.0), Tool("slow", 10.0, 0.3, 100, 0.1, 1.0))
    _, events = generate(small(agents=16, duration_s=3000.0, tools=tools, mean_turns=20, chat=None,
                               abandon_prob=0.0))
    start = {}
    durations = collections.defaultdict(list)
    for e in events:
        if e.kind == "tool_call_start":
            start[e.trajectory] = e
        elif e.kind == "resume":
            s = start.pop(e.trajectory)
            durations[s.tool].append(e.time_s - s.time_s)
    assert statistics.median(durations["fast"]) == pytest.approx(1.0, rel=0.1)
    assert statistics.median(durations["slow"]) == pytest.approx(10.0, rel=0.1)
    sigma = statistics.pstdev(math.log(d) for d in durations["slow"])
    assert sigma == pytest.approx(0.3, rel=0.15)


def test_default_tools_are_heavy_tailed_from_sub_second_to_minutes():
    spread = [t for t in DEFAULT_TOOLS if t.name != "human"]
    assert all(t.duration_sigma >= 1.5 for t in spread)
    assert min(t.duration_median_s for t in spread) < 1.0 and max(t.duration_median_s for t in spread) >= 30.0


def test_chat_conversations_continue_with_the_configured_probability():
    reqs, events = generate(small(agents=1, duration_s=4000.0, chat=ChatTraffic(sessions_per_s=0.5)))
    chats = [r for r in reqs if r["hash_ids"][0] == 4]
    first = {tuple(r["hash_ids"][:2]) for r in chats}            # one first block per conversation
    assert len(chats) / len(first) == pytest.approx(1 / (1 - 0.37), rel=0.12)


def test_bad_events_line_is_reported(tmp_path):
    p = tmp_path / "x.events.jsonl"
    p.write_text(json.dumps({"time": 1, "event": "start", "trajectory": "a"}) + "\n")
    with pytest.raises(TraceError, match="x.events.jsonl:1"):
        read_tool_events(p)
    p.write_text(json.dumps({"time": 1, "event": "session_end", "trajectory": "a", "state": "gone",
                             "hash_ids": []}) + "\n")
    with pytest.raises(TraceError, match="state"):
        read_tool_events(p)


@pytest.mark.parametrize("bad", [dict(agents=0), dict(abandon_prob=1.0), dict(chat=None, abandon_hint_prob=2.0)])
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        AgentWorkload(**bad)
