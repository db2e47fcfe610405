"""Hostile agent hints: every path checks names, times and keys alike, and nothing crashes.

A hint reaches the daemon by the gRPC fields (``SessionHint``, ``ToolCallStart``,
``Resume``), by a vLLM ``kv_hints`` envelope inside ``SessionHint``, or from an engine
request through the plug-in (``engine_adapter.agent_hints``). The same limits
(:mod:`kvstore.common.hint_limits`) hold on each: a refused hint is INVALID_ARGUMENT (never
INTERNAL) and changes nothing, the client refuses it before sending, the plug-in drops it
with a HintError (never another exception), and the trust a hint is judged by is its
caller's tenant, never something read from the session id it chose.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from support.daemon import daemon_config
from kvstore.common.errors import InvalidRequest
from kvstore.common.hint_limits import MAX_HINT_KEYS, MAX_NAME_CHARS, check_depth
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.agent.sessions import SessionHint, SessionState, source_of
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from engine_adapter.agent_hints import HintError, envelope_of, parse_kvstore_params
from rel_support import key

INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}


@pytest.fixture
def node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme=None, extra={"prefetch": {"enabled": True}}))
    ch = grpc.insecure_channel(d.address)
    yield d, pb_grpc.KVStoreStub(ch)
    ch.close()
    d.stop(0)


def code(call, request) -> grpc.StatusCode:
    try:
        call(request, timeout=20)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def envelope(payload: dict, action_type: str = "kvstore.session", action_id: str = "a1") -> str:
    return json.dumps({"protocol_version": "0.1", "actions": [
        {"action_id": action_id, "action_type": action_type, "action_version": "1.0", "payload": payload}]})


BAD_IDS = ["", "x" * (MAX_NAME_CHARS + 1), "evil\0alice"]


def test_bad_names_and_too_many_keys_are_invalid_argument_and_change_nothing(node):
    d, stub = node
    table = d.service.hints.sessions
    now = time.time()
    for sid in BAD_IDS:
        assert code(stub.SessionHint, pb.SessionHintRequest(session_id=sid, time=now, keys=[key(1)])) == INVALID
        assert code(stub.ToolCallStart, pb.ToolCallStartRequest(trajectory_id=sid, tool="t", start_time=now)) == INVALID
        assert code(stub.Resume, pb.ResumeRequest(trajectory_id=sid, time=now)) == INVALID
    assert code(stub.ToolCallStart, pb.ToolCallStartRequest(trajectory_id="t", tool="x\0y", start_time=now)) == INVALID
    many = [key(i) for i in range(MAX_HINT_KEYS + 1)]
    assert code(stub.SessionHint, pb.SessionHintRequest(session_id="s", time=now, keys=many)) == INVALID
    assert code(stub.ToolCallStart, pb.ToolCallStartRequest(trajectory_id="t", tool="x", start_time=now,
                                                            keys=many)) == INVALID
    assert table.stats.hints == 0 and len(d.service.hints.waits) == 0


@pytest.mark.parametrize("payload", [
    {"session_id": "\ud800", "state": "continues"},                       # a lone surrogate
    {"session_id": "a\0b", "state": "continues"},
    {"session_id": "s", "state": "continues", "expected_back_s": int("9" * 400)},
    {"session_id": "s", "state": "continues", "expected_back_s": 1e6},    # over a day
    {"session_id": "s", "state": "continues", "ttl_s": -1},
    {"session_id": "s", "state": [[["continues"]]]},
    {"session_id": ["s"], "state": "continues"},
], ids=["surrogate", "nul", "400-digits", "over-a-day", "negative-ttl", "state-list", "id-list"])
def test_a_malformed_kv_hints_payload_is_invalid_argument_not_internal(node, payload):
    d, stub = node
    req = pb.SessionHintRequest(session_id="ignored", time=time.time(), keys=[key(1)],
                                kv_hints_json=envelope(payload))
    assert code(stub.SessionHint, req) == INVALID
    assert d.service.hints.sessions.stats.hints == 0


def test_a_skipped_actions_id_comes_back_whatever_it_holds(node):
    _, stub = node
    req = pb.SessionHintRequest(session_id="x", time=time.time(), keys=[key(1)],
                                kv_hints_json=envelope({}, action_type="other.vendor", action_id="id-\ud800" + "z" * 500))
    reply = stub.SessionHint(req, timeout=20)
    assert len(reply.skipped_actions) == 1
    assert reply.skipped_actions[0].startswith("id-") and len(reply.skipped_actions[0]) <= 128


def test_the_client_refuses_what_the_daemon_would_before_sending(node):
    d, _ = node
    with KVStoreClient(d.address) as c:
        for sid in BAD_IDS + ["\udcff"]:
            with pytest.raises(InvalidRequest):
                c.session_hint(sid, "continues", [key(1)])
            with pytest.raises(InvalidRequest):
                c.tool_call_start(sid, "tool", [key(1)])
            with pytest.raises(InvalidRequest):
                c.resume(sid)
        for bad in (float("nan"), -1.0, 1e9, int("9" * 400)):
            with pytest.raises(InvalidRequest, match="expected_back_s"):
                c.session_hint("s", "continues", [key(1)], expected_back_s=bad)
        with pytest.raises(InvalidRequest, match="per request|per hint"):
            c.session_hint("s", "continues", [key(i) for i in range(MAX_HINT_KEYS + 1)])
        assert c.session_hint("s", "continues", [key(1)], expected_back_s=5.0) > time.time()
    assert d.service.hints.sessions.stats.hints == 1


def test_a_hints_trust_source_is_its_callers_tenant(tmp_path):
    cfg = daemon_config(tmp_path, host="8MiB", nvme=None, extra={"prefetch": {"enabled": True},
                                                                 "server": {"tenants": dict(TOKENS)}})
    d = start_server(cfg)
    try:
        table = d.service.hints.sessions
        with KVStoreClient(d.address, auth_token=TOKENS["alice"]) as a, \
                KVStoreClient(d.address, auth_token=TOKENS["bob"]) as b:
            a.session_hint("s1", "continues", [key(1)], expected_back_s=5.0)
            b.session_hint("s1", "continues", [key(2)], expected_back_s=5.0)
            b.session_hint("", "continues", [key(3)], kv_hints=json.loads(envelope(
                {"session_id": "s2", "state": "continues", "expected_back_s": 5.0})))
            sessions = [table.get("alice\0s1"), table.get("bob\0s1"), table.get("bob\0s2")]
            assert [s.pending.source for s in sessions] == ["alice", "bob", "bob"]
            with pytest.raises(InvalidRequest):                   # a chosen id never picks the source
                b.session_hint("alice\0s2", "continues", [key(3)])
    finally:
        d.stop(0)


def test_the_source_is_never_read_from_the_session_id():
    assert source_of(SessionHint("tenant\0id", SessionState.CONTINUES)) == ""
    assert source_of(SessionHint("tenant\0id", SessionState.CONTINUES, source="t")) == "t"


@pytest.mark.parametrize("params", [
    {"kvstore": {"session_id": "\ud800"}},
    {"kvstore": {"session_id": "a\0b"}},
    {"kvstore": {"session_id": "s", "expected_back_s": int("9" * 400)}},
    {"kvstore": {"session_id": "s", "state": [[[[["x"]]]]]}},
    {"kvstore": {"session_id": "s", "tool": {"a": 1}}},
], ids=["surrogate", "nul", "400-digits", "state-list", "tool-object"])
def test_the_plugin_drops_a_malformed_hint_with_a_hint_error(params):
    with pytest.raises(HintError):
        parse_kvstore_params(params)


def test_the_plugin_stops_reading_an_envelope_too_deep_or_too_large():
    deep: list = []
    for _ in range(100_000):                     # repr() or json.dumps of it recurse too deeply
        deep = [deep]
    with pytest.raises(HintError, match="nested deeper"):
        envelope_of({"actions": deep})

    class Endless(list):
        """A list that would take forever to read whole: the budget ends the read."""

        def __iter__(self):
            while True:
                yield "x" * 100

    with pytest.raises(HintError, match="larger than"):
        envelope_of({"actions": Endless()})
    with pytest.raises(HintError, match="not a string"):
        envelope_of({"actions": [], 1: "x"})
    ok = envelope_of({"protocol_version": "0.1", "actions": [{"action_type": "agent_hint", "payload": {}}]})
    assert ok["actions"][0]["action_type"] == "agent_hint"


@pytest.mark.parametrize("env, why", [
    ({"protocol_version": "0.1", "actions": [{"action_type": ["agent_hint"], "action_version": "1.0",
                                               "payload": {}}]}, "action_type"),
    ({"protocol_version": "0.1", "actions": [{"action_type": "agent_hint", "action_version": "1.0", "payload": {
        "session_id": "s", "context_management": {"edits": [{"type": "evict", "block_start": 0, "block_end": 1}] * 65}}}]},
     "edits"),
    ({"protocol_version": "0.1", "actions": [{"action_type": "kvstore.session", "action_version": "1.0",
                                               "payload": {"session_id": f"s{i}", "state": "continues"}}
                                              for i in range(5)]}, "session actions"),
    ({"protocol_version": "0.1", "actions": [{"action_type": "x"}] * 65}, "actions"),
    ({"protocol_version": "0.1", "actions": [], "pad": "x" * 65536}, "characters"),
    ({"protocol_version": "0.1", "actions": [], "deep": json.loads("[" * 40 + "]" * 40)}, "nested"),
], ids=["type-list", "65-edits", "5-session-actions", "65-actions", "64KiB", "depth-40"])
def test_the_daemon_bounds_the_work_of_one_envelope(node, env, why):
    d, stub = node
    req = pb.SessionHintRequest(session_id="x", time=time.time(), keys=[key(i) for i in range(8)],
                                kv_hints_json=json.dumps(env))
    with pytest.raises(grpc.RpcError) as e:
        stub.SessionHint(req, timeout=20)
    assert e.value.code() == INVALID and why in e.value.details()
    assert d.service.hints.sessions.stats.hints == 0


def test_the_plugin_counts_an_integers_digits_and_survives_an_unreadable_struct():
    with pytest.raises(HintError, match="larger than"):
        envelope_of({"actions": [10 ** 3000] * 30})          # 90,000 digits: refused before json.dumps

    class Struct:
        __struct_fields__ = ("actions",)

        @property
        def actions(self):
            raise RuntimeError("field not readable")

    with pytest.raises(HintError, match="could not be read"):
        envelope_of(Struct())


@pytest.mark.parametrize("env, ok", [
    ({"actions": [{"action_type": "x"}] * 64}, True),
    ({"actions": [{"action_type": "x"}] * 65}, False),
    ({"actions": [{"action_type": "kvstore.session", "payload": {}}] * 5}, False),
    ({"actions": [{"action_type": "agent_hint", "payload": {"context_management": {"edits": [{}] * 65}}}]}, False),
    ({"actions": [], "deep": json.loads("[" * 31 + "]" * 31)}, True),          # 32 levels with the envelope
    ({"actions": [], "deep": json.loads("[" * 32 + "]" * 32)}, False),
    ({"actions": [], "deep": json.loads("[" * 31 + "1" + "]" * 31)}, True),    # a number inside the 32nd
], ids=["64-actions", "65-actions", "5-session-actions", "65-edits", "depth-32", "depth-33", "depth-32-scalar"])
def test_the_plugin_forwards_an_envelope_within_the_daemons_bounds_only(env, ok):
    env = {"protocol_version": "0.1", **env}
    daemon_refuses = False
    try:
        check_depth(env, "kv_hints")
    except InvalidRequest:
        daemon_refuses = True
    if ok:
        assert envelope_of(env) == env and not daemon_refuses
    else:
        with pytest.raises(HintError):
            envelope_of(env)


def test_hints_stuck_in_the_daemon_never_hold_the_threads_of_lookup(tmp_path):
    """With ``workers = 4`` the daemon has one thread for unary calls. Hint calls run on
    threads of their own: three SessionHints stuck in the session table (a slow hint)
    leave another client's Lookup answered at once."""
    import threading
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme=None,
                                   extra={"prefetch": {"enabled": True}, "server": {"workers": 4}}))
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KVStoreStub(ch)
    gate, entered = threading.Event(), threading.Semaphore(0)
    handlers = d.service.hint_handlers
    apply = handlers._sessions

    def slow(hint):
        entered.release()
        gate.wait(60)
        return apply(hint)

    handlers._sessions = slow
    codes: list = []
    threads = [threading.Thread(target=lambda i=i: codes.append(code(stub.SessionHint, pb.SessionHintRequest(
        session_id=f"s{i}", time=time.time(), keys=[key(i)])))) for i in range(3)]
    try:
        for t in threads:
            t.start()
        assert entered.acquire(timeout=30)                # a hint is stuck (on the old code: the unary thread)
        reply = stub.Lookup(pb.LookupRequest(keys=[key(1)]), timeout=30)
        assert reply.hit_blocks == 0
    finally:
        gate.set()
        for t in threads:
            t.join(60)
        ch.close()
        d.stop(0)
    assert codes == [grpc.StatusCode.OK] * 3
