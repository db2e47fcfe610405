"""The synthetic ReAct agent workload."""

from __future__ import annotations

import collections
import json
import math
import statistics

import pytest

from kvstore.agent_trace import (AgentWorkload, Tool, events_path, generate, read_tool_events, write)
from kvstore.trace import TraceError, read_mooncake_trace


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
    trace, ev, n_req, n_ev = write(small(), out)
    assert ev == events_path(out) == tmp_path / "agents.events.jsonl"
    reqs = read_mooncake_trace(trace)                 # valid Mooncake format (id counts checked)
    events = read_tool_events(ev)
    assert len(reqs) == n_req and len(events) == n_ev
    by_time = collections.defaultdict(list)
    for r in reqs:
        by_time[r.timestamp_ms].append(r)
        assert r.hash_ids[:4] == [0, 1, 2, 3]          # the shared 2048-token system prompt
    starts = {}
    for e in events:
        if e.kind == "tool_call_start":
            assert e.trajectory not in starts
            starts[e.trajectory] = e
        else:
            s = starts.pop(e.trajectory)
            assert e.time_s > s.time_s
            # the resumed request arrives at the resume time and extends the stored prefix
            nxt = [r for r in by_time[round(e.time_s * 1000)] if r.hash_ids[:len(s.hash_ids)] == list(s.hash_ids)]
            assert nxt, f"no request continues {e.trajectory} at {e.time_s}"


def test_tool_durations_follow_their_distributions():
    tools = (Tool("fast", 1.0, 0.3, 100, 0.1, 1.0), Tool("slow", 10.0, 0.3, 100, 0.1, 1.0))
    _, events = generate(small(agents=16, duration_s=3000.0, tools=tools, mean_turns=20))
    start = {}
    durations = collections.defaultdict(list)
    for e in events:
        if e.kind == "tool_call_start":
            start[e.trajectory] = e
        else:
            s = start.pop(e.trajectory)
            durations[s.tool].append(e.time_s - s.time_s)
    assert statistics.median(durations["fast"]) == pytest.approx(1.0, rel=0.1)
    assert statistics.median(durations["slow"]) == pytest.approx(10.0, rel=0.1)
    sigma = statistics.pstdev(math.log(d) for d in durations["slow"])
    assert sigma == pytest.approx(0.3, rel=0.15)


def test_bad_events_line_is_reported(tmp_path):
    p = tmp_path / "x.events.jsonl"
    p.write_text(json.dumps({"time": 1, "event": "start", "trajectory": "a"}) + "\n")
    with pytest.raises(TraceError, match="x.events.jsonl:1"):
        read_tool_events(p)


def test_bad_parameters():
    with pytest.raises(ValueError):
        AgentWorkload(agents=0)
