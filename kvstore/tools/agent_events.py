"""Tool-call and session events of an agent trace: the hints a worker would send.

The events file goes with a Mooncake-format trace (``x.jsonl`` -> ``x.events.jsonl``),
one JSON object per line, in time order (``time`` in seconds from the trace start)::

    {"time": 12.345, "event": "tool_call_start", "trajectory": "a3-e1", "tool": "search",
     "hash_ids": [0, 1, 2, 17, 18]}
    {"time": 13.101, "event": "resume", "trajectory": "a3-e1"}
    {"time": 40.2, "event": "session_end", "trajectory": "a3-e1", "state": "finished",
     "hash_ids": [0, 1, 2, 17, 18, 25]}

- ``tool_call_start``: ``hash_ids`` are the trajectory's stored full blocks (the next
  call's prompt starts with them); gRPC ``ToolCallStart``.
- ``resume``: at the same time as the trajectory's next request; gRPC ``Resume``.
- ``session_end``: the trajectory finished (after its final answer) or was abandoned
  (``state``); ``hash_ids`` its stored blocks; a session hint
  (:class:`kvstore.agent.sessions.SessionHint`).
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

from kvstore.tools.trace import TraceError, loads_json, not_json

EVENT_KINDS = ("tool_call_start", "resume", "session_end")
END_STATES = ("finished", "abandoned")


@dataclass(frozen=True)
class ToolEvent:
    """One event: ``kind`` in :data:`EVENT_KINDS`; ``time_s`` in seconds from the trace
    start; ``tool`` for a start; ``hash_ids`` for a start or an end; ``state`` for an end."""

    time_s: float
    kind: str
    trajectory: str
    tool: str = ""
    hash_ids: tuple[int, ...] = ()
    state: str = ""

    def to_json(self) -> str:
        d: dict = {"time": round(self.time_s, 6), "event": self.kind, "trajectory": self.trajectory}
        if self.kind == "tool_call_start":
            d["tool"] = self.tool
        if self.kind == "session_end":
            d["state"] = self.state
        if self.kind != "resume":
            d["hash_ids"] = list(self.hash_ids)
        return json.dumps(d)


def events_path(trace_path: str | pathlib.Path) -> pathlib.Path:
    """The events file that goes with a trace: ``x.jsonl`` -> ``x.events.jsonl``."""
    p = pathlib.Path(trace_path)
    stem = p.name[:-len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".events.jsonl")


def parse_event(d, where: str) -> ToolEvent:
    """One decoded events line. Raises TraceError naming ``where``."""
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected a JSON object")
    kind, traj, t = d.get("event"), d.get("trajectory"), d.get("time")
    if kind not in EVENT_KINDS:
        raise TraceError(f"{where}: event must be one of {EVENT_KINDS}, got {kind!r}")
    if not isinstance(traj, str) or not traj:
        raise TraceError(f"{where}: trajectory must be a non-empty string")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: time must be a number >= 0, got {t!r}")
    ids: tuple[int, ...] = ()
    tool = state = ""
    if kind == "tool_call_start":
        tool = d.get("tool")
        if not isinstance(tool, str) or not tool:
            raise TraceError(f"{where}: tool must be a non-empty string")
    if kind == "session_end":
        state = d.get("state")
        if state not in END_STATES:
            raise TraceError(f"{where}: state must be one of {END_STATES}, got {state!r}")
    if kind != "resume":
        raw = d.get("hash_ids")
        if not isinstance(raw, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in raw):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        ids = tuple(raw)
    return ToolEvent(float(t), kind, traj, tool, ids, state)


def read_tool_events(path: str | pathlib.Path) -> list[ToolEvent]:
    """Read an events file, sorted by time (stable). Raises TraceError naming the line."""
    out: list[ToolEvent] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read events {str(path)!r}: {e.strerror or e}") from None
    with f:
        try:
            lines = list(f)
        except OSError as e:
            raise TraceError(f"cannot read events {str(path)!r}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise TraceError(f"events {str(path)!r} are not UTF-8 text: {e}") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                d = loads_json(line)
            except json.JSONDecodeError as e:
                raise TraceError(not_json(where, line, e, 'one JSON object per line, e.g. {"time": 12.3, '
                                                          '"event": "resume", "trajectory": "a3-e1"}')) from None
            out.append(parse_event(d, where))
    out.sort(key=lambda e: e.time_s)
    return out
