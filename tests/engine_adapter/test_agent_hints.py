"""Agent hints on the engine side: the kv_transfer_params contract, the trajectory table, the
hint queue, and the vLLM scheduler half handing both to the daemon (fakes only; the real
daemon is in test_trajectory_pageback.py, the real vLLM server in
tests/integrations/test_vllm_hints.py)."""

from __future__ import annotations

import logging
import math
import threading
import time
from types import SimpleNamespace

import pytest

from kvstore.common.errors import FeatureDisabled, InvalidRequest, StoreUnavailable
from kvstore.common.types import LookupResult

from engine_adapter import store_io
from engine_adapter.agent_hints import AgentHint, HintError, envelope_of, envelope_session, parse_kvstore_params
from engine_adapter.breaker import BreakerSettings
from engine_adapter.engine_keys import engine_namespace
from engine_adapter.hint_sender import HintSender
from engine_adapter.trajectories import AgentTracker, TrajectoryTable
from engine_adapter.vllm.scheduler import SchedulerPlanner
from engine_adapter.vllm.settings import ConnectorSettings

BS = 4
ARRIVAL = time.time()         # the fake requests' arrival time (unix seconds)


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


# ------------------------------------------------------------------ the JSON contract

def test_the_documented_hint_parses_with_its_defaults():
    h = parse_kvstore_params({"kvstore": {"session_id": "agent-7", "state": "tool_call", "tool": "web_search",
                                          "expected_back_s": 3.5, "ttl_s": 300}, "do_remote_prefill": False})
    assert h == AgentHint("agent-7", "tool_call", "web_search", 3.5, 300.0)
    assert parse_kvstore_params({"kvstore": {"session_id": "s", "tool": "grep"}}).state == "tool_call"
    assert parse_kvstore_params({"kvstore": {"session_id": "s"}}) == AgentHint("s", "continues")
    assert parse_kvstore_params({"kvstore": {"session_id": "s", "state": "finished", "tool": "x"}}).tool == ""
    assert parse_kvstore_params({"kvstore": {"session_id": "s", "future_field": 1}}).state == "continues"
    assert parse_kvstore_params(None) is None
    assert parse_kvstore_params({"do_remote_prefill": True}) is None     # another connector's params


@pytest.mark.parametrize("params", [
    "agent-7",
    {"kvstore": "agent-7"},
    {"kvstore": {}},
    {"kvstore": {"session_id": ""}},
    {"kvstore": {"session_id": 7}},
    {"kvstore": {"session_id": "s" * 1025}},
    {"kvstore": {"session_id": "s", "state": "paused"}},
    {"kvstore": {"session_id": "s", "tool": ["web"]}},
    {"kvstore": {"session_id": "s", "expected_back_s": -1}},
    {"kvstore": {"session_id": "s", "expected_back_s": "3"}},
    {"kvstore": {"session_id": "s", "expected_back_s": True}},
    {"kvstore": {"session_id": "s", "ttl_s": math.inf}},
    {"kvstore": {"session_id": "s", "ttl_s": math.nan}},
    {"kvstore": {"session_id": "s", "ttl_s": 1e9}},
])
def test_a_malformed_hint_is_a_hint_error(params):
    with pytest.raises(HintError):
        parse_kvstore_params(params)


class Struct:
    """Stands in for a msgspec Struct (vLLM's KvHintsEnvelope / KvHintAction)."""

    def __init__(self, **fields):
        self.__struct_fields__ = tuple(fields)
        for name, value in fields.items():
            setattr(self, name, value)


def test_a_kv_hints_envelope_is_forwarded_as_json_with_its_session():
    action = Struct(action_id="a1", action_type="agent_hint", action_version="1.0",
                    payload={"session_id": "s9", "cache_control": {"ttl": 60}})
    env = envelope_of(Struct(protocol_version="0.1", message_id="m", actions=[action]))
    assert env == {"protocol_version": "0.1", "message_id": "m",
                   "actions": [{"action_id": "a1", "action_type": "agent_hint", "action_version": "1.0",
                                "payload": {"session_id": "s9", "cache_control": {"ttl": 60}}}]}
    assert envelope_session(env) == "s9"
    assert envelope_session({"actions": [{"action_type": "other", "payload": {"session_id": "x"}}]}) == ""
    assert envelope_of(None) is None
    for bad in ({"protocol_version": "0.1"}, [1], {"actions": [{"payload": {"x": math.nan}}]},
                {"actions": ["x" * 70000]}):
        with pytest.raises(HintError):
            envelope_of(bad)


# ------------------------------------------------------------------ the trajectory table

def test_the_longest_covered_trajectory_resumes_once():
    t = TrajectoryTable(8, ttl_s=100)
    t.add("short", [k(1), k(2)], 0.0)
    t.add("long", [k(1), k(2), k(3)], 0.0)
    assert t.match([k(1), k(2), k(3), k(4)], 1.0) == "long"
    assert t.match([k(1), k(2), k(3), k(4)], 1.0) == "short"      # the fork's other branch
    assert t.match([k(1), k(2), k(3), k(4)], 1.0) is None         # each resumes once
    t.add("x", [k(5), k(6)], 0.0)
    assert t.match([k(6)], 1.0) is None                            # same key, another position
    assert t.match([k(5)], 1.0) is None                            # does not cover its blocks
    assert len(t) == 1


def test_the_table_is_bounded_and_expires():
    t = TrajectoryTable(3, ttl_s=10)
    for i in range(5):
        t.add(f"t{i}", [k(i)], float(i))
    assert len(t) == 3 and "t0" not in t and "t1" not in t and t.dropped == 2
    assert t.match([k(2)], 11.5) == "t2"                           # 9.5 s old: still waiting
    t2 = TrajectoryTable(3, ttl_s=10)
    t2.add("a", [k(1)], 0.0)
    t2.add("b", [k(2)], 5.0)
    assert t2.match([k(2)], 12.0) == "b"                           # 7 s old: still waiting
    assert t2.match([k(1)], 12.0) is None and t2.dropped == 1      # 12 s old: expired
    t2.add("c", [k(3)], 20.0)
    t2.add("d", [k(3)], 21.0)                                      # ended on the same block: replaces
    assert "c" not in t2 and t2.match([k(3)], 22.0) == "d"


def test_the_table_finds_what_a_scan_of_every_entry_finds():
    import random

    rng = random.Random(5)
    t = TrajectoryTable(50, ttl_s=1e9)
    ref: dict[str, list[bytes]] = {}                                   # what is waiting, by brute force
    chains = [[k(1000 * c + i) for i in range(40)] for c in range(6)]  # six conversations' blocks
    for step in range(1000):
        chain = rng.choice(chains)
        keys = chain[:rng.randint(1, 40)]
        if rng.random() < 0.5:
            tid = f"t{rng.randint(0, 80)}"
            t.add(tid, keys, float(step))
            ref.pop(tid, None)
            for other in [o for o, ks in ref.items() if ks[-1] == keys[-1]]:
                del ref[other]
            ref[tid] = keys
            while len(ref) > 50:
                del ref[next(iter(ref))]
        else:
            covered = [o for o, ks in ref.items() if keys[:len(ks)] == ks]
            want = max(covered, key=lambda o: len(ref[o])) if covered else None
            assert t.match(keys, float(step)) == want
            if want is not None:
                del ref[want]
        assert len(t) == len(ref)


# ------------------------------------------------------------------ the hint queue

class FakeClient:
    """Records hint calls; ``gate`` holds them; ``error`` is raised by each."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()     # a call is being made
        self.error: Exception | None = None
        self.lookups = 0
        self.hit = 0

    def tool_call_start(self, tid, tool, keys, start_time=None, timeout=None):
        return self._call("tool_call_start", tid, tool, list(keys), start_time)

    def resume(self, tid, at=None, timeout=None):
        return self._call("resume", tid, at)

    def session_hint(self, sid, state, keys=(), *, expected_back_s=None, ttl_s=None, at=None, kv_hints=None,
                     timeout=None):
        return self._call("session_hint", sid, state, list(keys), expected_back_s, ttl_s, kv_hints)

    def _call(self, *call):
        self.entered.set()
        self.gate.wait(30)
        if self.error is not None:
            raise self.error
        self.calls.append(call)
        return 0.0

    def ping(self, timeout=1.0):
        if isinstance(self.error, StoreUnavailable):
            raise self.error

    def lookup(self, keys, timeout=None):
        self.lookups += 1
        return LookupResult(min(self.hit, len(keys)))

    def check_block_tokens(self, block_tokens):
        pass


class Recorder:
    """A sender that records what it is asked to send."""

    def __init__(self):
        self.calls: list[tuple] = []

    def tool_call_start(self, tid, tool, keys, start_time):
        self.calls.append(("tool_call_start", tid, tool, list(keys), start_time))

    def resume(self, tid, at):
        self.calls.append(("resume", tid, at))

    def session_hint(self, sid, state, keys, at, **kw):
        self.calls.append(("session_hint", sid, state, list(keys), at, kw))


def guarded(client) -> store_io.GuardedStore:
    return store_io.GuardedStore(client, BreakerSettings(backoff_s=30.0, max_backoff_s=60.0))


def test_the_hint_queue_is_bounded_and_never_waits():
    client = FakeClient()
    client.gate.clear()                                            # the daemon does not answer
    sender = HintSender(guarded(client), max_pending=4)
    try:
        assert sender.resume("t0", 1.0)
        assert client.entered.wait(30)                                 # the thread is in that call
        t0 = time.monotonic()
        queued = [sender.resume(f"t{i}", 1.0) for i in range(1, 11)]
        took = time.monotonic() - t0
        assert queued == [True] * 4 + [False] * 6
        assert sender.stats()["dropped_full"] == 6
        client.gate.set()
        assert sender.flush(30)
        assert [c[1] for c in client.calls] == ["t0", "t1", "t2", "t3", "t4"]     # in order
        assert sender.stats()["sent"] == 5
        print(f"\n10 hints queued or dropped against a daemon that does not answer in {took * 1e3:.2f} ms")
    finally:
        client.gate.set()
        sender.close()


def test_hints_are_dropped_while_the_store_is_down_and_sent_after():
    client = FakeClient()
    store = guarded(client)
    sender = HintSender(store, max_pending=16)
    try:
        client.error = StoreUnavailable("gone")
        assert sender.tool_call_start("t", "", [k(1)], 1.0)
        assert sender.flush(30)
        assert store.breaker.is_open                               # a hint opens the breaker like any call
        assert not sender.resume("t", 2.0)                         # dropped at once, no call made
        assert sender.stats()["dropped_store_down"] == 2 and client.calls == []
    finally:
        sender.close()
        store.close()


def test_a_refused_or_disabled_hint_is_logged_once_and_the_kind_rests(caplog):
    clock = [0.0]
    client = FakeClient()
    sender = HintSender(guarded(client), clock=lambda: clock[0])
    try:
        client.error = InvalidRequest("kv_hints_json is not JSON")
        with caplog.at_level(logging.DEBUG, logger="engine_adapter.hints"):
            for _ in range(3):
                sender.session_hint("s", "continues", [], 1.0)
            assert sender.flush(30)
            client.error = FeatureDisabled("tool-call hints are off")
            sender.tool_call_start("t", "", [k(1)], 1.0)
            assert sender.flush(30)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "refused" in warnings[0].getMessage()
        assert sender.stats()["refused"] == 3
        client.error = None
        assert not sender.tool_call_start("t", "", [k(1)], 1.0)    # off at the daemon: not sent for a while
        assert sender.session_hint("s", "continues", [], 1.0)      # other kinds still go
        clock[0] = 61.0
        assert sender.tool_call_start("t", "", [k(1)], 1.0)
        assert sender.flush(30)
        assert [c[0] for c in client.calls] == ["session_hint", "tool_call_start"]
    finally:
        sender.close()


# ------------------------------------------------------------------ the scheduler half

def request(rid: str, tokens, params=None, kv_hints=None, session_id=None):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens), block_hashes=[],
                           lora_request=None, cache_salt=None, mm_features=None, kv_transfer_params=params,
                           kv_hints=kv_hints, arrival_time=ARRIVAL, session_id=session_id)


def step(rid: str, n: int, blocks: int):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(range(blocks)),), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={rid: n}, finished_req_ids=set())


@pytest.fixture
def planner():
    client = FakeClient()
    store = guarded(client)
    ns = engine_namespace(model="m", dtype="float32", block_tokens=BS, num_layers=2, num_kv_heads=2, head_dim=8,
                          scheme="tokens", engine="vllm")
    agent = AgentTracker(HintSender(store), clock=lambda: ARRIVAL + 5.0)
    p = SchedulerPlanner(ns, BS, store, 1.0, agent=agent)
    yield p, client, agent
    agent.close()
    store.close()


def run(p: SchedulerPlanner, req) -> list[bytes]:
    """One request through the planner: arrival, one step computing it all, finish; its saved keys."""
    p.num_new_matched_tokens(req, 0)
    plan = p.build(step(req.request_id, req.num_tokens, req.num_tokens // BS + 1))
    p.finished(req)
    return [key for s in plan.saves for key in s.keys]


def test_a_tool_call_hint_becomes_tool_call_start_then_resume(planner):
    p, client, agent = planner
    hint = {"kvstore": {"session_id": "agent-7", "state": "tool_call", "tool": "web_search"}}
    turn1 = list(range(100, 100 + 3 * BS + 2))
    keys1 = run(p, request("r1", turn1, hint))
    turn2 = turn1 + list(range(500, 500 + 2 * BS))
    keys2 = run(p, request("r2", turn2, {"kvstore": {"session_id": "agent-7", "state": "finished"}}))
    assert agent.sender.flush(30)
    assert client.calls == [("resume", "agent-7", ARRIVAL),             # every named request, on arrival
                            ("tool_call_start", "agent-7", "web_search", keys1, ARRIVAL + 5.0),
                            ("resume", "agent-7", ARRIVAL),              # ... at its arrival time
                            ("session_hint", "agent-7", "finished", keys2, None, None, None)]
    assert agent.stats()["resumed_session"] == 1                        # the one this scheduler saw wait
    assert len(keys1) == 3 and keys2[:3] == keys1
    assert client.lookups == 2                                          # lookups went on as usual


def test_continues_and_envelope_hints_are_session_hints(planner):
    p, client, agent = planner
    run(p, request("r1", range(10, 10 + 2 * BS + 1),
                   {"kvstore": {"session_id": "s", "state": "continues", "expected_back_s": 2.5, "ttl_s": 60}}))
    env = Struct(protocol_version="0.1", message_id="m",
                 actions=[Struct(action_id="a", action_type="agent_hint", action_version="1",
                                 payload={"session_id": "e", "cache_control": {"ttl": 30}})])
    run(p, request("r2", range(50, 50 + 2 * BS + 1), kv_hints=env))
    run(p, request("r3", range(50, 50 + 3 * BS + 1), kv_hints=env))      # the envelope's session is back
    assert agent.sender.flush(30)
    kinds = [(c[0], c[1], c[2]) for c in client.calls]
    assert kinds == [("resume", "s", ARRIVAL), ("session_hint", "s", "continues"), ("resume", "e", ARRIVAL),
                     ("session_hint", "", "continues"), ("resume", "e", ARRIVAL), ("session_hint", "", "continues")]
    assert client.calls[1][4:6] == (2.5, 60.0)
    assert client.calls[3][6]["actions"][0]["payload"]["session_id"] == "e"
    assert agent.stats()["resumed_session"] == 1                         # r3: the envelope's session waited


def test_without_hints_a_request_extending_a_finished_one_resumes_its_trajectory(planner):
    p, client, agent = planner
    system = list(range(1, 1 + 2 * BS))                  # two blocks every agent starts with
    a1 = system + list(range(100, 100 + BS + 1))
    b1 = system + list(range(300, 300 + BS + 1))
    ka, kb = run(p, request("a1", a1)), run(p, request("b1", b1))
    run(p, request("a2", a1 + list(range(200, 200 + BS))))              # agent a's next turn
    run(p, request("c1", list(range(900, 900 + BS + 1))))               # unrelated: a new trajectory
    assert agent.sender.flush(30)
    starts = [c for c in client.calls if c[0] == "tool_call_start"]
    resumes = [c[1] for c in client.calls if c[0] == "resume"]
    ta, tb = starts[0][1], starts[1][1]
    assert ta != tb and ta.startswith("anon-")
    assert resumes == [ta]                                              # a2 resumed a1's trajectory
    assert starts[2][1] == ta and len(starts[2][3]) == 4                # ... which waits again, longer
    assert starts[0][2] == starts[1][2] == agent.class_of(ka)           # one class: the shared prefix
    assert starts[0][2].startswith("class:") and starts[3][2] != starts[0][2]
    assert starts[0][3] == ka and starts[1][3] == kb
    assert agent.stats()["resumed_prefix"] == 1 and agent.stats()["waits"] == 4


def test_the_engines_own_session_id_names_the_trajectory(planner):
    p, client, agent = planner
    keys = run(p, request("r1", range(10, 10 + 2 * BS + 1), session_id="conv-1"))
    run(p, request("r2", range(60, 60 + 2 * BS + 1), session_id="conv-1"))   # another prefix, same session
    assert agent.sender.flush(30)
    assert [c[:2] for c in client.calls] == [("resume", "conv-1"), ("tool_call_start", "conv-1"),
                                             ("resume", "conv-1"), ("tool_call_start", "conv-1")]
    assert client.calls[1][2] == agent.class_of(keys) and client.calls[1][3] == keys
    assert agent.stats()["resumed_session"] == 1


def test_a_named_session_that_waited_unnamed_resumes_both():
    t = AgentTracker(Recorder(), clock=lambda: 50.0)
    first = t.arrived("r1", [k(1), k(2)])
    t.finished(first, [k(1), k(2)])                                     # an anonymous trajectory waits
    (start,) = t.sender.calls
    second = t.arrived("r2", [k(1), k(2), k(3)], {"kvstore": {"session_id": "s", "tool": "ls"}})
    assert t.sender.calls[1:] == [("resume", "s", 50.0), ("resume", start[1], 50.0)]
    t.finished(second, [k(1), k(2), k(3)])
    assert t.sender.calls[3] == ("tool_call_start", "s", "ls", [k(1), k(2), k(3)], 50.0)
    off = AgentTracker(Recorder(), hints=False, trajectories=False)
    info = off.arrived("r", [k(1)], {"kvstore": {"session_id": "s"}}, session_id="v")
    off.finished(info, [k(1)])
    assert off.sender.calls == [] and info.hint is None


def test_a_malformed_hint_is_logged_once_and_never_fails_the_request(planner, caplog):
    p, client, agent = planner
    client.hit = 2
    with caplog.at_level(logging.DEBUG, logger="engine_adapter"):
        got = [p.num_new_matched_tokens(request(f"r{i}", range(7, 7 + 3 * BS + 1),
                                                {"kvstore": {"session_id": "", "state": "sleeping"}}), 0)
               for i in range(3)]
    assert got == [2 * BS] * 3                                          # served as without a hint
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ignored" in warnings[0].getMessage()
    assert agent.stats()["malformed"] == 3


def test_connector_settings_of_hints_are_checked():
    s = ConnectorSettings.from_extra({"target": "unix:/x", "max_trajectories": 10, "trajectory_class_blocks": 0,
                                      "trajectories": False})
    assert (s.max_trajectories, s.trajectory_class_blocks, s.trajectories, s.agent_hints) == (10, 0, False, True)
    for bad in ({"max_trajectories": 0}, {"hint_queue": 1.5}, {"trajectories": "yes"}, {"hint_timeout_s": 0},
                {"trajectory_class_blocks": -1}, {"trajectory_ttl_s": -3}):
        with pytest.raises(ValueError):
            ConnectorSettings.from_extra({"target": "unix:/x", **bad})
