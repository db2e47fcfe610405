"""The agent-hint RPCs of the gRPC service: ToolCallStart, Resume, SessionHint, Explain.

:class:`HintHandlers` is held by :class:`kvstore.service.server.KVStoreService`, which
delegates these four RPCs to it with the caller's key space. Its handlers check what the
agent framework says (trajectory ids and tool names at most :data:`MAX_NAME_CHARS`
characters, keys, finite times within the clock skew), convert client unix times to the
daemon's monotonic clock and back (:mod:`kvstore.service.validate`), scope trajectory and
session ids to the caller's tenant, and hand the hint to the prefetch scheduler, the
session table (a vLLM ``kv_hints`` envelope through :mod:`kvstore.agent.kv_hints`) or the
eviction log. Each is off (FAILED_PRECONDITION) when its part is not running.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

from kvstore.common import errors
from kvstore.common.hint_limits import (MAX_ENVELOPE_CHARS, MAX_HINT_KEYS, MAX_NAME_CHARS, check_depth, check_name,
                                        check_seconds)
from kvstore._proto import kvstore_pb2 as pb
from kvstore.service.auth import KeySpace
from kvstore.agent.sessions import MAX_SOURCE_CHARS, SessionHint, SessionState
from kvstore.service.validate import check_keys, to_monotonic, to_unix

_STATES = {pb.SessionHintRequest.CONTINUES: SessionState.CONTINUES,
           pb.SessionHintRequest.FINISHED: SessionState.FINISHED,
           pb.SessionHintRequest.ABANDONED: SessionState.ABANDONED}

__all__ = ["HintHandlers", "MAX_NAME_CHARS"]


def _hint_keys(keys, space: KeySpace) -> list[bytes]:
    """A hint's keys, checked (at most ``MAX_HINT_KEYS``), in the caller's key space."""
    return space.internal_many(check_keys(keys, limit=MAX_HINT_KEYS))


def _source(space: KeySpace) -> str:
    """The trust source of a caller's hints: its tenant (``""``: the shared key space)."""
    t = space.tenant
    if len(t) <= MAX_SOURCE_CHARS:
        return t
    return t[:MAX_SOURCE_CHARS - 9] + "#" + format(zlib.crc32(t.encode("utf-8")), "08x")


def _reported(action_id: str) -> str:
    """An envelope's action id as it can go back in a reply (at most 128 characters, UTF-8)."""
    return action_id[:128].encode("utf-8", "replace").decode("utf-8")


class HintHandlers:
    """Agent hints and miss explanations (see the module docstring).

    Args:
        scheduler: the prefetch scheduler (``tool_call_start(trajectory, tool, start,
            keys)`` and ``resume(trajectory, at)``, monotonic seconds), or None: ToolCallStart
            and Resume raise FeatureDisabled.
        sessions: applies a :class:`~kvstore.agent.sessions.SessionHint` (monotonic
            seconds), returning the expected-back time; None: SessionHint raises FeatureDisabled.
        explain: maps a prompt's keys to an :class:`~kvstore.service.explain.Explanation`,
            or None: Explain raises FeatureDisabled.

    Each handler takes the request and the caller's :class:`~kvstore.service.auth.KeySpace`
    and returns the reply; it raises InvalidRequest for what the agent framework got wrong.
    """

    def __init__(self, scheduler=None, sessions=None, explain=None):
        self._scheduler = scheduler
        self._sessions = sessions
        self._explain = explain

    def _need_scheduler(self) -> None:
        if self._scheduler is None:
            raise errors.FeatureDisabled("tool-call hints are off: set [prefetch] enabled = true "
                                         "or use the next_use eviction policy")

    def tool_call_start(self, request: pb.ToolCallStartRequest, space: KeySpace) -> pb.ToolCallStartReply:
        """``ToolCallStart``: the tool call is scheduled; the reply has the predicted resume
        time (unix seconds)."""
        self._need_scheduler()
        check_name(request.trajectory_id, "trajectory_id")
        check_name(request.tool, "tool", required=False)
        start = to_monotonic(request.start_time, "start_time")
        keys = _hint_keys(request.keys, space)
        predicted = self._scheduler.tool_call_start(space.scoped(request.trajectory_id), request.tool, start, keys)
        return pb.ToolCallStartReply(predicted_resume_time=to_unix(predicted))

    def resume(self, request: pb.ResumeRequest, space: KeySpace) -> pb.ResumeReply:
        """``Resume``: whether the trajectory was waiting, and for how long (seconds)."""
        self._need_scheduler()
        check_name(request.trajectory_id, "trajectory_id")
        at = to_monotonic(request.time, "time")
        known, observed = self._scheduler.resume(space.scoped(request.trajectory_id), at)
        return pb.ResumeReply(known=known, observed_seconds=observed)

    def session_hint(self, request: pb.SessionHintRequest, space: KeySpace) -> pb.SessionHintReply:
        """``SessionHint`` (or a vLLM ``kv_hints`` envelope): applied to the session table;
        the reply has the expected-back time (unix seconds, ``inf`` once ended)."""
        if self._sessions is None:
            raise errors.FeatureDisabled("session hints are off (no session table)")
        if request.state not in _STATES:
            raise errors.InvalidRequest(f"state: {request.state} is not a SessionHintRequest.State "
                                        f"(CONTINUES, FINISHED, ABANDONED)")
        at = to_monotonic(request.time, "time")
        keys = tuple(_hint_keys(request.keys, space))
        for name in ("expected_back_s", "ttl_s"):
            check_seconds(getattr(request, name), name)
        source = _source(space)
        skipped: list[str] = []
        if request.kv_hints_json:
            import json
            from kvstore.agent.kv_hints import session_hints
            if len(request.kv_hints_json) > MAX_ENVELOPE_CHARS:
                raise errors.InvalidRequest(f"kv_hints_json: {len(request.kv_hints_json)} characters; at most "
                                            f"{MAX_ENVELOPE_CHARS}")
            try:
                envelope = json.loads(request.kv_hints_json)
            except ValueError as e:
                raise errors.InvalidRequest(f"kv_hints_json is not JSON: {e}") from None
            except RecursionError:
                raise errors.InvalidRequest("kv_hints_json is nested too deeply to parse") from None
            check_depth(envelope, "kv_hints_json")
            hints, skipped = session_hints(envelope, keys, at)
            hints = [dataclasses.replace(h, session_id=space.scoped(h.session_id), source=source) for h in hints]
            skipped = [_reported(a) for a in skipped]
        else:
            check_name(request.session_id, "session_id")
            hints = [SessionHint(space.scoped(request.session_id), _STATES[request.state], keys,
                                 request.expected_back_s or None, request.ttl_s or None, at, source)]
        expected = math.inf
        for h in hints:
            expected = self._sessions(h)
        return pb.SessionHintReply(expected_back_time=to_unix(expected) if math.isfinite(expected) else math.inf,
                                   skipped_actions=skipped)

    def explain(self, request: pb.ExplainRequest, space: KeySpace) -> pb.ExplainReply:
        """``Explain``: why the prompt with these keys misses (the first block not stored)."""
        if self._explain is None:
            raise errors.FeatureDisabled("explain is off (no eviction log)")
        e = self._explain(space.internal_many(check_keys(request.keys)))
        reply = pb.ExplainReply(kind=e.kind, block=-1 if e.block is None else e.block, text=e.text)
        if e.eviction is not None:
            reply.tier, reply.policy, reply.reason = e.eviction.tier, e.eviction.policy, e.eviction.reason
            reply.time = e.eviction.time
        return reply
