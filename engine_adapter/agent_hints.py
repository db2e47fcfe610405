"""What an agent framework says about a request, as an engine plug-in receives it.

Two carriers reach a plug-in with a request (the contract is docs/agent_hints.md):

- ``kv_transfer_params`` (vLLM's OpenAI server, ``/v1/completions`` and
  ``/v1/chat/completions``; the engine gets it as ``Request.kv_transfer_params``), under the
  key ``"kvstore"``::

      {"kvstore": {"session_id": "agent-7", "state": "tool_call", "tool": "web_search",
                   "expected_back_s": 3.5, "ttl_s": 300}}

  ``session_id`` (required, a non-empty string of at most :data:`MAX_NAME_CHARS`
  characters), ``state`` (one of :data:`STATES`; default ``"tool_call"`` when ``tool`` is
  given, else ``"continues"``), ``tool`` (a string, ``tool_call`` only), ``expected_back_s``
  and ``ttl_s`` (finite numbers of seconds >= 0, at most :data:`MAX_SECONDS`). Other keys
  are ignored (forward compatible);
- vLLM's typed ``Request.kv_hints`` (a ``vllm.v1.kv_hints.KvHintsEnvelope``, or the same
  envelope as a JSON object): forwarded whole to the daemon, which reads the action types
  it implements (``kvstore.session``, ``agent_hint``: :mod:`kvstore.agent.kv_hints`).

:func:`parse_kvstore_params` and :func:`envelope_of` raise :class:`HintError` for what is
malformed; the plug-in logs it once and serves the request as if it carried no hint.
Nothing here imports an engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.common.errors import InvalidRequest
from kvstore.common.hint_limits import (MAX_ENVELOPE_ACTIONS, MAX_ENVELOPE_CHARS, MAX_ENVELOPE_DEPTH,
                                        MAX_ENVELOPE_EDITS, MAX_HINT_S, MAX_NAME_CHARS, MAX_SESSION_ACTIONS,
                                        check_name, check_seconds, show)

PARAMS_KEY = "kvstore"
"""The key of our hint inside a request's ``kv_transfer_params``."""

TOOL_CALL, CONTINUES, FINISHED, ABANDONED = "tool_call", "continues", "finished", "abandoned"
STATES = (TOOL_CALL, CONTINUES, FINISHED, ABANDONED)
"""What happens to the session once this request finishes."""

MAX_SECONDS = MAX_HINT_S
"""Largest ``expected_back_s`` / ``ttl_s`` accepted (one day: the daemon's limit,
:mod:`kvstore.common.hint_limits`, where :data:`MAX_NAME_CHARS` comes from too)."""

__all__ = ["ABANDONED", "CONTINUES", "FINISHED", "PARAMS_KEY", "STATES", "TOOL_CALL", "AgentHint", "HintError",
           "MAX_ENVELOPE_CHARS", "MAX_ENVELOPE_DEPTH", "MAX_NAME_CHARS", "MAX_SECONDS", "envelope_of",
           "envelope_session", "parse_kvstore_params"]

_SESSION_ACTIONS = ("kvstore.session", "agent_hint")


class HintError(ValueError):
    """A request's hint is malformed (the message says what); the request is served without it."""


@dataclass(frozen=True)
class AgentHint:
    """One request's ``kv_transfer_params["kvstore"]``, checked.

    Attributes:
        session_id: the agent session (trajectory) the request belongs to.
        state: one of :data:`STATES`: what the session does after this request.
        tool: the tool it waits on (``tool_call``; ``""`` otherwise or when not named).
        expected_back_s: seconds from the request's end to the session's next request
            (None: not said).
        ttl_s: keep the session's blocks near at most this many seconds (None: no limit).
    """

    session_id: str
    state: str
    tool: str = ""
    expected_back_s: float | None = None
    ttl_s: float | None = None


def _seconds(p: Mapping, name: str) -> float | None:
    try:
        return check_seconds(p.get(name), f"kv_transfer_params.kvstore.{name}", MAX_SECONDS)
    except InvalidRequest as e:
        raise HintError(str(e)) from None


def _name(p: Mapping, name: str, required: bool) -> str:
    v = p.get(name)
    if v is None and not required:
        return ""
    try:
        return check_name(v, f"kv_transfer_params.kvstore.{name}", required=required)
    except InvalidRequest as e:
        raise HintError(str(e)) from None


def parse_kvstore_params(params: Any) -> AgentHint | None:
    """The hint in a request's ``kv_transfer_params`` (a dict, or None).

    Returns None when there is none (no params, or no ``"kvstore"`` key).
    Raises:
        HintError: the ``"kvstore"`` entry is not an object, lacks a session id, names an
            unknown state, or has a time that is not a finite number of seconds in range.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise HintError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    p = params.get(PARAMS_KEY)
    if p is None:
        return None
    if not isinstance(p, Mapping):
        raise HintError(f"kv_transfer_params.kvstore must be an object, got {type(p).__name__}")
    sid = _name(p, "session_id", required=True)
    tool = _name(p, "tool", required=False)
    state = p.get("state", TOOL_CALL if tool else CONTINUES)
    if not isinstance(state, str) or state not in STATES:
        raise HintError(f"kv_transfer_params.kvstore.state must be one of {list(STATES)}, got {show(state)}")
    return AgentHint(sid, state, tool if state == TOOL_CALL else "", _seconds(p, "expected_back_s"),
                     _seconds(p, "ttl_s"))


class _Budget:
    """What is left of the characters and depth an envelope may take while it is read."""

    def __init__(self):
        self.chars = MAX_ENVELOPE_CHARS

    def spend(self, n: int) -> None:
        self.chars -= n
        if self.chars < 0:
            raise HintError(f"kv_hints is larger than {MAX_ENVELOPE_CHARS} characters of JSON; not forwarded")


def _plain(value: Any, budget: _Budget, depth: int = 1) -> Any:
    """A msgspec Struct (vLLM's ``KvHintsEnvelope`` / ``KvHintAction``) as plain JSON values;
    stops at the size and depth limits, whatever the envelope holds (``depth``: of
    ``value`` if it is an object or a list, the envelope being 1, as the daemon counts)."""
    fields = getattr(value, "__struct_fields__", None)
    if depth > MAX_ENVELOPE_DEPTH and (fields is not None or isinstance(value, (Mapping, list, tuple))):
        raise HintError(f"kv_hints is nested deeper than {MAX_ENVELOPE_DEPTH} levels; not forwarded")
    if isinstance(value, str):
        budget.spend(len(value) + 2)
    elif isinstance(value, int) and not isinstance(value, bool):
        budget.spend(value.bit_length() * 3 // 10 + 2)         # its decimal digits, about
    else:
        budget.spend(2)
    if fields is not None:
        return {f: _plain(getattr(value, f), budget, depth + 1) for f in fields}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise HintError(f"kv_hints has an object key that is not a string: {show(k)}")
            budget.spend(len(k) + 3)
            out[k] = _plain(v, budget, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, budget, depth + 1) for v in value]
    return value


def envelope_of(kv_hints: Any) -> dict | None:
    """A request's ``kv_hints`` as the JSON object the daemon takes (None when absent).

    Accepts vLLM's ``KvHintsEnvelope`` (read by its fields, vLLM is not imported) or a dict.
    Reading stops as soon as the envelope is found too large or too deep.
    Raises:
        HintError: not an object with a list of ``actions``, not JSON (a key that is not
            a string, a NaN, a value of another type), larger than
            :data:`MAX_ENVELOPE_CHARS`, nested deeper than :data:`MAX_ENVELOPE_DEPTH`, or
            with more actions, session actions or edits than the daemon takes
            (:mod:`kvstore.common.hint_limits`).
    """
    if kv_hints is None:
        return None
    try:
        env = _plain(kv_hints, _Budget())
    except HintError:
        raise
    except Exception as e:                    # an engine object whose fields cannot be read
        raise HintError(f"kv_hints could not be read: {type(e).__name__}: {e}") from None
    if not isinstance(env, dict) or not isinstance(env.get("actions"), list):
        raise HintError("kv_hints must be an envelope object with a list of actions")
    try:
        text = json.dumps(env, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise HintError(f"kv_hints is not JSON: {e}") from None
    if len(text) > MAX_ENVELOPE_CHARS:
        raise HintError(f"kv_hints is {len(text)} characters of JSON; at most {MAX_ENVELOPE_CHARS} are forwarded")
    _check_counts(env["actions"])
    return env


def _check_counts(actions: list) -> None:
    """The daemon's bounds on actions, session actions and edits (kvstore.common.hint_limits)."""
    ours = [a for a in actions if isinstance(a, Mapping) and a.get("action_type") in _SESSION_ACTIONS]
    edits = max((len(e) for a in ours if isinstance(p := a.get("payload"), Mapping)
                 and isinstance(cm := p.get("context_management"), Mapping)
                 and isinstance(e := cm.get("edits"), list)), default=0)
    if len(actions) > MAX_ENVELOPE_ACTIONS or len(ours) > MAX_SESSION_ACTIONS or edits > MAX_ENVELOPE_EDITS:
        raise HintError(f"kv_hints has {len(actions)} actions, {len(ours)} session actions, up to {edits} edits "
                        f"in one; at most {MAX_ENVELOPE_ACTIONS}, {MAX_SESSION_ACTIONS} and {MAX_ENVELOPE_EDITS}")


def envelope_session(env: Mapping | None) -> str:
    """The session id the envelope's first session action names (``""``: none): a later
    request of that session is its resume."""
    for a in (env or {}).get("actions", ()):
        if isinstance(a, Mapping) and a.get("action_type") in _SESSION_ACTIONS:
            sid = (a.get("payload") or {}).get("session_id") if isinstance(a.get("payload"), Mapping) else None
            try:
                return check_name(sid, "session_id")
            except InvalidRequest:
                pass
    return ""
