"""What one agent hint may carry: names, times, keys (shared by client, daemon and plug-ins).

An agent hint (``ToolCallStart``, ``Resume``, ``SessionHint``, a vLLM ``kv_hints``
envelope, an engine request's ``kv_transfer_params["kvstore"]``) names a trajectory or
session, maybe a tool, times in seconds and the stored prefix's block keys. The same
limits hold on every path, so a hint refused by the daemon is refused by the client or
the plug-in first, with the same message:

- names (:func:`check_name`): strings of at most :data:`MAX_NAME_CHARS` characters that
  UTF-8 can encode (a lone surrogate from a JSON ``"\\ud800"`` cannot) and without NUL
  (the daemon scopes a caller's names to its tenant as ``tenant`` NUL ``name``);
- times (:func:`check_seconds`): finite numbers of seconds in ``[0, MAX_HINT_S]``; a
  400-digit JSON integer is refused, not an overflow;
- keys: at most :data:`MAX_HINT_KEYS` per hint (the work and memory of one hint are
  proportional to its keys). Plug-ins send the first :data:`MAX_HINT_KEYS` blocks of a
  longer prefix (a hint is advice);
- a vLLM ``kv_hints`` envelope: at most :data:`MAX_ENVELOPE_CHARS` characters of JSON,
  :data:`MAX_ENVELOPE_DEPTH` levels deep (:func:`check_depth`), :data:`MAX_ENVELOPE_ACTIONS`
  actions, :data:`MAX_SESSION_ACTIONS` of them session actions, and
  :data:`MAX_ENVELOPE_EDITS` edits per action, so the work one envelope asks of the daemon
  is bounded whatever it holds.
"""

from __future__ import annotations

import math
from typing import Any

from kvstore.common.errors import InvalidRequest

MAX_NAME_CHARS = 1024
"""Longest trajectory id, session id or tool name (characters)."""

MAX_HINT_S = 24 * 3600.0
"""Largest ``expected_back_s`` / ``ttl_s`` of a hint (seconds: one day, the daemon's
clock-skew bound)."""

MAX_HINT_KEYS = 1 << 17
"""Most block keys one hint may name (131,072: a 2M-token prefix of 16-token blocks;
4 MiB of keys)."""

MAX_ENVELOPE_CHARS = 65536
"""Largest ``kv_hints`` envelope (characters of its JSON)."""

MAX_ENVELOPE_DEPTH = 32
"""Deepest nesting of a ``kv_hints`` envelope (objects and lists)."""

MAX_ENVELOPE_ACTIONS = 64
"""Most actions one ``kv_hints`` envelope may carry."""

MAX_ENVELOPE_EDITS = 64
"""Most ``context_management`` edits one ``agent_hint`` action may carry."""

MAX_SESSION_ACTIONS = 4
"""Most ``kvstore.session`` and ``agent_hint`` actions one envelope may carry (the work of
each is proportional to the request's blocks)."""


def show(value: Any, chars: int = 80) -> str:
    """A short description of a value a caller sent, safe for any value (a deeply nested
    list, a huge string, a lone surrogate): for an error message or a log line."""
    if isinstance(value, str):
        return ascii(value[:chars]) + ("..." if len(value) > chars else "")
    if isinstance(value, (bool, float)) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"an integer of {value.bit_length()} bits" if value.bit_length() > 64 else repr(value)
    return f"a {type(value).__name__}"


def check_name(value: Any, field: str, *, required: bool = True) -> str:
    """``value`` as a hint name (module docstring); ``""`` allowed unless ``required``.

    Raises:
        InvalidRequest: not a string, empty when required, longer than
            :data:`MAX_NAME_CHARS`, containing NUL or not encodable as UTF-8.
    """
    if not isinstance(value, str) or (required and not value) or len(value) > MAX_NAME_CHARS:
        need = "a non-empty string" if required else "a string"
        raise InvalidRequest(f"{field} must be {need} of at most {MAX_NAME_CHARS} characters, got {show(value)}")
    if "\0" in value:
        raise InvalidRequest(f"{field} must not contain NUL, got {show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field} is not valid Unicode (a lone surrogate), got {show(value)}") from None
    return value


def check_seconds(value: Any, field: str, high: float = MAX_HINT_S, low: float = 0.0) -> float | None:
    """``value`` (None, or a finite number of seconds in ``[low, high]``) as a float.

    Raises:
        InvalidRequest: not a number (a bool is not), not finite, outside the range or
            too large for a float.
    """
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if not bad:
        try:
            v = float(value)
        except OverflowError:
            bad = True
        else:
            bad = not math.isfinite(v) or not low <= v <= high
    if bad:
        raise InvalidRequest(f"{field} must be a finite number of seconds in [{low:g}, {high:g}], got {show(value)}")
    return v


def check_depth(value: Any, field: str, limit: int = MAX_ENVELOPE_DEPTH) -> None:
    """Raise InvalidRequest when decoded JSON ``value`` nests objects and lists deeper than
    ``limit`` (an iterative walk: no recursion, whatever the depth)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if d > limit:
            raise InvalidRequest(f"{field} is nested deeper than {limit} levels")
        stack.extend((c, d + 1) for c in items if isinstance(c, (dict, list)))
