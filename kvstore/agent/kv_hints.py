"""Session hints from an engine's per-request KV hints (vLLM's ``kv_hints`` envelope).

vLLM carries optional, typed, versioned KV hints with each request (RFC
vllm-project/vllm#53421, PR #53423; the same envelope in SGLang #36224 and NVIDIA
Dynamo's router): ::

    {"protocol_version": "0.1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "...", "action_version": "...",
                  "payload": {...}}]}

Each consumer reads the action types it implements and ignores the rest. The session
hints of RFC vllm-project/vllm#52113 (``agent_hint``: ``session_id``,
``cache_control.ttl``, ``context_management.edits`` of type ``evict`` / ``offload`` /
``prefetch``) are the semantics we take. A KV connector (#10) passes the envelope and
the request's block keys through; :func:`session_hints` maps them:

=====================================================  =====================================
action                                                 :class:`~kvstore.agent.sessions.SessionHint`
=====================================================  =====================================
``kvstore.session`` 1.x, payload ``{session_id,        as given (``state`` = continues /
state, expected_back_s?, ttl_s?}``                     finished / abandoned)
``agent_hint`` 1.x, ``cache_control: {ttl}``           continues, ``ttl_s`` = ttl
``agent_hint`` with an ``evict`` edit of the whole     finished (the blocks are let go)
request context
``agent_hint`` with a ``prefetch`` edit                continues, ``expected_back_s`` = 0
``agent_hint`` with an ``offload`` edit                continues (no time: the learned gap)
``agent_hint`` with an ``evict`` edit of blocks        continues without those blocks, which
``[block_start, block_end)``                           are let go (``dropped``)
=====================================================  =====================================

An edit with a block range applies to those blocks only: ``evict`` of a range (the
framework cut them from the session's context) takes them out of the session's prefix
and lets them go as the session's own (``SessionHint.dropped``: where nothing else used
them since the session named them) while the session continues; ``offload`` and
``prefetch`` of a range are checked and change nothing. The hints of an envelope apply in
its action order: a later action for the same session names its blocks again (a cut in an
earlier action is undone by it). Unknown action types and major
versions are skipped (returned, so the caller can log them); a malformed envelope or
payload raises InvalidRequest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from kvstore.common.errors import InvalidRequest
from kvstore.common.hint_limits import MAX_ENVELOPE_ACTIONS, MAX_ENVELOPE_EDITS, MAX_SESSION_ACTIONS, check_name, show
from kvstore.agent.sessions import SessionHint, SessionState

PROTOCOL_VERSIONS = ("0.1",)
SESSION_ACTION = "kvstore.session"
AGENT_HINT_ACTION = "agent_hint"


def _obj(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"kv_hints: {where} must be an object")
    return value


def _major(version: Any, where: str) -> str:
    if not isinstance(version, str) or not version:
        raise InvalidRequest(f"kv_hints: {where}.action_version must be a non-empty string")
    return version.split(".")[0]


def _from_session_action(p: Mapping, keys: tuple[bytes, ...], time: float | None) -> list[SessionHint]:
    sid = check_name(p.get("session_id"), "kv_hints: kvstore.session payload session_id")
    return [SessionHint(sid, p.get("state"), keys, p.get("expected_back_s"), p.get("ttl_s"), time)]


def _from_agent_hint(p: Mapping, keys: tuple[bytes, ...], time: float | None) -> list[SessionHint]:
    sid = check_name(p.get("session_id"), "kv_hints: agent_hint payload session_id")
    ttl = None
    cc = p.get("cache_control")
    if cc is not None:
        ttl = _obj(cc, "agent_hint.cache_control").get("ttl", 300.0)
    edits = _obj(p.get("context_management") or {}, "agent_hint.context_management").get("edits") or []
    if not isinstance(edits, list) or len(edits) > MAX_ENVELOPE_EDITS:
        raise InvalidRequest(f"kv_hints: agent_hint.context_management.edits must be a list of at most "
                             f"{MAX_ENVELOPE_EDITS} edits")
    whole: SessionHint | None = None
    cut: list[tuple[int, int]] = []            # evicted block ranges
    for e in edits:
        e = _obj(e, "agent_hint edit")
        kind = e.get("type")
        if kind not in ("evict", "offload", "prefetch"):
            raise InvalidRequest(f"kv_hints: edit type must be evict, offload or prefetch, got {show(kind)}")
        start, end = e.get("block_start"), e.get("block_end")
        if start is None and end is None:
            if kind == "evict":
                whole = SessionHint(sid, SessionState.FINISHED, keys, time=time)
            elif kind == "prefetch":
                whole = SessionHint(sid, SessionState.CONTINUES, keys, 0.0, ttl, time)
            else:
                whole = SessionHint(sid, SessionState.CONTINUES, keys, None, ttl, time)
            continue
        s = 0 if start is None else start
        t = len(keys) if end is None else end
        if not (type(s) is int and type(t) is int):
            raise InvalidRequest(f"kv_hints: edit block_start and block_end must be integers, got "
                                 f"{show(start)} and {show(end)}")
        if not 0 <= s <= t <= len(keys):
            raise InvalidRequest(f"kv_hints: edit block range [{s}, {t}) outside the request's {len(keys)} blocks")
        if kind == "evict" and t > s:
            cut.append((s, t))
    if whole is None:
        whole = SessionHint(sid, SessionState.CONTINUES, keys, None, ttl, time)
    if cut and whole.state == SessionState.CONTINUES:
        kept, dropped, at = [], [], 0
        for s, t in sorted(cut):                  # the union of the ranges, in one pass over the keys
            if t > at:
                kept.extend(keys[at:max(s, at)])
                dropped.extend(keys[max(s, at):t])
                at = t
        kept.extend(keys[at:])
        if not kept:                              # the whole context: as an evict of it
            return [SessionHint(sid, SessionState.FINISHED, keys, time=time)]
        whole = dataclasses.replace(whole, keys=tuple(kept), dropped=tuple(dropped))
    return [whole]


_ACTIONS = {SESSION_ACTION: _from_session_action, AGENT_HINT_ACTION: _from_agent_hint}


def session_hints(envelope: Mapping | None, keys: Sequence[bytes],
                  time: float | None = None) -> tuple[list[SessionHint], list[str]]:
    """Session hints carried by one request's ``kv_hints`` envelope.

    Args:
        envelope: the decoded envelope (a JSON object), or None.
        keys: the request's full-block keys (32 bytes each) in prefix order.
        time: when the request arrived (seconds; None: the table's now).
    Returns:
        ``(hints, skipped)``: the hints in action order, and the ``action_id`` of each
        action skipped as unknown (type or major version).
    Raises:
        InvalidRequest: a malformed envelope, action or payload, an unsupported
            ``protocol_version``, more than ``MAX_ENVELOPE_ACTIONS`` actions, more than
            ``MAX_SESSION_ACTIONS`` session actions or ``MAX_ENVELOPE_EDITS`` edits
            in one (:mod:`kvstore.common.hint_limits`).
    """
    if envelope is None:
        return [], []
    env = _obj(envelope, "the envelope")
    if env.get("protocol_version") not in PROTOCOL_VERSIONS:
        raise InvalidRequest(f"kv_hints: protocol_version must be one of {PROTOCOL_VERSIONS}, "
                             f"got {show(env.get('protocol_version'))}")
    actions = env.get("actions", [])
    if not isinstance(actions, list) or len(actions) > MAX_ENVELOPE_ACTIONS:
        raise InvalidRequest(f"kv_hints: actions must be a list of at most {MAX_ENVELOPE_ACTIONS} actions")
    keys = tuple(keys)
    hints: list[SessionHint] = []
    skipped: list[str] = []
    for i, a in enumerate(actions):
        a = _obj(a, f"actions[{i}]")
        kind = a.get("action_type")
        if not isinstance(kind, str):
            raise InvalidRequest(f"kv_hints: actions[{i}].action_type must be a string, got {show(kind)}")
        parse = _ACTIONS.get(kind)
        if parse is None or _major(a.get("action_version"), f"actions[{i}]") != "1":
            aid = a.get("action_id", i)
            skipped.append(aid if isinstance(aid, str) else show(aid))
            continue
        hints.extend(parse(_obj(a.get("payload"), f"actions[{i}].payload"), keys, time))
        if len(hints) > MAX_SESSION_ACTIONS:
            raise InvalidRequest(f"kv_hints: at most {MAX_SESSION_ACTIONS} session actions per envelope "
                                 f"(each applies to all of the request's blocks)")
    return hints, skipped
