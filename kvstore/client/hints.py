"""The client's agent-hint calls: ToolCallStart, SessionHint, Explain, Resume.

:class:`HintCalls` is a part of :class:`kvstore.client.KVStoreClient`, built on its
:class:`~kvstore.client.connection.Connection`: it builds each request (unix times
default to now, keys checked and within the daemon's per-request cap, since such a call
cannot be split), names and times checked as the daemon does
(:mod:`kvstore.common.hint_limits`), and makes the call. The facade's methods document the verbs.
"""

from __future__ import annotations

import json
import time
from typing import Sequence

from kvstore.common import errors
from kvstore.common.hint_limits import MAX_HINT_KEYS, check_name, check_seconds
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.checks import check_keys
from kvstore.client.connection import Connection

_STATES = {"continues": pb.SessionHintRequest.CONTINUES, "finished": pb.SessionHintRequest.FINISHED,
           "abandoned": pb.SessionHintRequest.ABANDONED}


class HintCalls:
    """Agent hints to one daemon (see :meth:`kvstore.client.KVStoreClient.session_hint` and
    its neighbours for what each means). Raises InvalidRequest before sending for a key
    that is not 32 bytes, more keys than one hint may name (``MAX_HINT_KEYS``), or a name
    or time the daemon would refuse."""

    def __init__(self, connection: Connection):
        self.connection = connection

    def _keys(self, keys: Sequence[bytes], limit: int = MAX_HINT_KEYS) -> list[bytes]:
        return check_keys(keys, limit=min(self.connection.max_keys_per_request, limit))

    def tool_call_start(self, trajectory_id: str, tool: str, keys: Sequence[bytes], start_time: float | None,
                        timeout: float | None) -> float:
        check_name(trajectory_id, "trajectory_id")
        check_name(tool, "tool", required=False)
        req = pb.ToolCallStartRequest(trajectory_id=trajectory_id, tool=tool, keys=self._keys(keys),
                                      start_time=start_time if start_time is not None else time.time())
        c = self.connection
        return c.call(c.stub.ToolCallStart, req, timeout).predicted_resume_time

    def session_hint(self, session_id: str, state: str, keys: Sequence[bytes], expected_back_s: float | None,
                     ttl_s: float | None, at: float | None, kv_hints: dict | None, timeout: float | None) -> float:
        if state not in _STATES:
            raise errors.InvalidRequest(f"state must be one of {sorted(_STATES)}, got {state!r}")
        if kv_hints is None:
            check_name(session_id, "session_id")
            check_seconds(expected_back_s, "expected_back_s")
            check_seconds(ttl_s, "ttl_s")
        req = pb.SessionHintRequest(session_id=session_id, state=_STATES[state], keys=self._keys(keys),
                                    expected_back_s=expected_back_s or 0.0, ttl_s=ttl_s or 0.0,
                                    time=at if at is not None else time.time(),
                                    kv_hints_json=json.dumps(kv_hints) if kv_hints is not None else "")
        c = self.connection
        return c.call(c.stub.SessionHint, req, timeout).expected_back_time

    def explain(self, keys: Sequence[bytes], timeout: float | None) -> pb.ExplainReply:
        c = self.connection
        return c.call(c.stub.Explain, pb.ExplainRequest(keys=self._keys(keys, c.max_keys_per_request)), timeout)

    def resume(self, trajectory_id: str, at: float | None, timeout: float | None) -> tuple[bool, float]:
        check_name(trajectory_id, "trajectory_id")
        c = self.connection
        req = pb.ResumeRequest(trajectory_id=trajectory_id, time=at if at is not None else time.time())
        reply = c.call(c.stub.Resume, req, timeout)
        return reply.known, reply.observed_seconds
