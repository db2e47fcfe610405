"""The agent-hint RPCs of the gRPC service: ToolCallStart, Resume, SessionHint, Explain.

:class:`HintHandlers` is mixed into :class:`kvstore.service.server.KVStoreService`. Its
handlers check what the agent framework says (trajectory ids and tool names at most
:data:`MAX_NAME_CHARS` characters, keys, finite times within the clock skew), convert
client unix times to the daemon's monotonic clock and back (:mod:`kvstore.service.validate`),
scope trajectory and session ids to the caller's tenant, and hand the hint to the
prefetch scheduler (``hints``), the session table (``sessions``; a vLLM ``kv_hints``
envelope through :mod:`kvstore.agent.kv_hints`) or the eviction log (``explain``). Each is off
(FAILED_PRECONDITION) when its part is not running. It uses the service's ``_space``,
``hints``, ``sessions`` and ``explain``.
"""

from __future__ import annotations

import dataclasses
import math

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.service.interceptors import unary_handler as _unary
from kvstore.agent.sessions import SessionHint, SessionState
from kvstore.service.validate import MAX_CLOCK_SKEW_S, check_keys, check_number, to_monotonic, to_unix

_STATES = {pb.SessionHintRequest.CONTINUES: SessionState.CONTINUES,
           pb.SessionHintRequest.FINISHED: SessionState.FINISHED,
           pb.SessionHintRequest.ABANDONED: SessionState.ABANDONED}

MAX_NAME_CHARS = 1024
"""Longest trajectory id or tool name a hint may carry (characters)."""


def _check_names(trajectory_id: str, tool: str = "") -> None:
    if not trajectory_id:
        raise errors.InvalidRequest("trajectory_id must not be empty")
    if len(trajectory_id) > MAX_NAME_CHARS or len(tool) > MAX_NAME_CHARS:
        raise errors.InvalidRequest(f"trajectory_id and tool are limited to {MAX_NAME_CHARS} characters")


class HintHandlers:
    """Agent hints and miss explanations (see the module docstring)."""

    def _need_hints(self) -> None:
        if self.hints is None:
            raise errors.FeatureDisabled("tool-call hints are off: set [prefetch] enabled = true "
                                         "or use the next_use eviction policy")

    @_unary
    def ToolCallStart(self, request: pb.ToolCallStartRequest, context) -> pb.ToolCallStartReply:
        space = self._space(context)
        self._need_hints()
        _check_names(request.trajectory_id, request.tool)
        start = to_monotonic(request.start_time, "start_time")
        keys = space.internal_many(check_keys(request.keys))
        predicted = self.hints.tool_call_start(space.scoped(request.trajectory_id), request.tool, start, keys)
        return pb.ToolCallStartReply(predicted_resume_time=to_unix(predicted))

    @_unary
    def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        space = self._space(context)
        self._need_hints()
        _check_names(request.trajectory_id)
        at = to_monotonic(request.time, "time")
        known, observed = self.hints.resume(space.scoped(request.trajectory_id), at)
        return pb.ResumeReply(known=known, observed_seconds=observed)

    @_unary
    def SessionHint(self, request: pb.SessionHintRequest, context) -> pb.SessionHintReply:
        space = self._space(context)
        if self.sessions is None:
            raise errors.FeatureDisabled("session hints are off (no session table)")
        if len(request.session_id) > 1024:
            raise errors.InvalidRequest("session_id is limited to 1024 characters")
        if request.state not in _STATES:
            raise errors.InvalidRequest(f"state: {request.state} is not a SessionHintRequest.State "
                                        f"(CONTINUES, FINISHED, ABANDONED)")
        at = to_monotonic(request.time, "time")
        keys = tuple(space.internal_many(check_keys(request.keys)))
        for name in ("expected_back_s", "ttl_s"):
            check_number(getattr(request, name), name, low=0.0, high=MAX_CLOCK_SKEW_S)
        skipped: list[str] = []
        if request.kv_hints_json:
            import json
            from kvstore.agent.kv_hints import session_hints
            try:
                envelope = json.loads(request.kv_hints_json)
            except ValueError as e:
                raise errors.InvalidRequest(f"kv_hints_json is not JSON: {e}") from None
            except RecursionError:
                raise errors.InvalidRequest("kv_hints_json is nested too deeply to parse") from None
            hints, skipped = session_hints(envelope, keys, at)
            hints = [dataclasses.replace(h, session_id=space.scoped(h.session_id)) for h in hints]
        else:
            hints = [SessionHint(space.scoped(request.session_id), _STATES[request.state], keys,
                                 request.expected_back_s or None, request.ttl_s or None, at)]
        expected = math.inf
        for h in hints:
            expected = self.sessions(h)
        return pb.SessionHintReply(expected_back_time=to_unix(expected) if math.isfinite(expected) else math.inf,
                                   skipped_actions=skipped)

    @_unary
    def Explain(self, request: pb.ExplainRequest, context) -> pb.ExplainReply:
        space = self._space(context)
        if self.explain is None:
            raise errors.FeatureDisabled("explain is off (no eviction log)")
        e = self.explain(space.internal_many(check_keys(request.keys)))
        reply = pb.ExplainReply(kind=e.kind, block=-1 if e.block is None else e.block, text=e.text)
        if e.eviction is not None:
            reply.tier, reply.policy, reply.reason = e.eviction.tier, e.eviction.policy, e.eviction.reason
            reply.time = e.eviction.time
        return reply
