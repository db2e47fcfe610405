"""Reader of Mooncake-format request traces.

The format is the one of the Mooncake project's FAST'25 traces
(kvcache-ai/Mooncake, ``FAST25-release/traces/``): one JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

- ``timestamp``: arrival time in milliseconds from the start of the trace.
- ``input_length`` / ``output_length``: prompt and generated lengths in tokens.
- ``hash_ids``: one id per ``block_tokens``-token block of the prompt (512 in the
  released traces), the last one possibly partial; equal ids mean identical prefixes
  up to and including that block.

:func:`block_key` turns an id into the store's 32-byte key, so a trace drives the
real manager (``kvstore simulate``) or daemon (``kvstore replay``) with stable keys.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterable

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""


class TraceError(ValueError):
    """A trace file is unreadable or a line is malformed; the message names the line."""


TRACE_LINE_EXAMPLE = '{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}'
"""One line of a Mooncake-format trace, as the messages show it."""


def loads_json(text: str):
    """``json.loads(text)``, with every way a hostile text fails it raised as
    ``json.JSONDecodeError``: nesting deeper than Python's recursion limit, or an integer
    of more digits than Python converts (4,300)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:          # int of too many digits
        raise json.JSONDecodeError(f"a value out of range ({str(e).split(':')[0]})", text, 0) from None


def not_json(where: str, text: str, error: json.JSONDecodeError, expected: str) -> str:
    """The message for ``text`` (one line or one file, at ``where``) that is not JSON: what was
    found, what is expected, and a hint when it looks like CSV."""
    found = text.strip().splitlines()[0] if text.strip() else text
    hint = ""
    if "," in found and not found.lstrip().startswith(("{", "[", '"')):
        hint = "; this looks like CSV, which is not read: convert each row to one JSON object"
    return (f"{where}: not valid JSON ({error.msg}, column {error.colno}): found {found[:80]!r}; "
            f"expected {expected}{hint}")


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time, milliseconds from the start of the trace.
        input_length: prompt length in tokens.
        output_length: generated length in tokens.
        hash_ids: block ids of the prompt, ``ceil(input_length / block_tokens)`` of them.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)

    @property
    def time_s(self) -> float:
        """Arrival time in seconds from the start of the trace."""
        return self.timestamp_ms / 1000.0

    def block_tokens(self, i: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
        """Real tokens in block ``i``: ``block_tokens`` except for a partial last block."""
        n = len(self.hash_ids)
        if i < n - 1:
            return block_tokens
        return self.input_length - block_tokens * (n - 1)

    def prefix_tokens(self, hit_blocks: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
        """Tokens covered by the first ``hit_blocks`` blocks (the last counts its real tokens)."""
        if hit_blocks >= len(self.hash_ids):
            return self.input_length
        return block_tokens * hit_blocks


KEY_DOMAIN = b"kvstore.tools.replay.mooncake.v1:"
"""Domain tag of :func:`block_key`."""


def block_key(block_id: int, namespace: bytes = b"") -> bytes:
    """The 32-byte store key of trace block ``block_id``: SHA-256 of a tagged decimal id.

    ``namespace`` separates replays whose payloads differ (``kvstore replay`` passes the
    payload size), so a block stored with another size is a miss, not a wrong block.
    The simulator and the replay share this function, so they use the same keys.
    """
    tag = KEY_DOMAIN + (namespace + b":" if namespace else b"")
    return hashlib.sha256(tag + str(int(block_id)).encode()).digest()


def _field(obj: dict, name: str, kind: type | tuple[type, ...], where: str):
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if kind is int else "a number"
        raise TraceError(f"{where}: field {name!r} must be {want}, got {value!r}")
    return value


def parse_request(line: str, where: str = "line",
                  block_tokens: int = TRACE_BLOCK_TOKENS) -> Request:
    """Parse one trace line. Raises TraceError naming ``where`` for anything malformed."""
    try:
        obj = loads_json(line)
    except json.JSONDecodeError as e:
        raise TraceError(not_json(where, line, e, f"one JSON object per line (Mooncake JSONL), e.g. "
                                                  f"{TRACE_LINE_EXAMPLE}")) from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object like {TRACE_LINE_EXAMPLE}, got {type(obj).__name__}")
    ts = _field(obj, "timestamp", (int, float), where)
    if not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a finite number >= 0, got {ts!r}")
    inp = _field(obj, "input_length", int, where)
    out = _field(obj, "output_length", int, where)
    if inp < 1:
        raise TraceError(f"{where}: input_length must be >= 1, got {inp}")
    if out < 0:
        raise TraceError(f"{where}: output_length must be >= 0, got {out}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: hash_ids must be a non-empty list of integers")
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise TraceError(f"{where}: hash_ids must hold integers >= 0, got {x!r}")
    expected = -(-inp // block_tokens)
    if len(ids) != expected:
        raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {inp} "
                         f"(expected ceil({inp}/{block_tokens}) = {expected})")
    return Request(float(ts), inp, out, list(ids))


def parse_lines(lines: Iterable[str], name: str = "trace",
                block_tokens: int = TRACE_BLOCK_TOKENS) -> list[Request]:
    """Parse trace lines (blank lines skipped) and sort them by timestamp (stable)."""
    requests = [parse_request(line, f"{name}:{i}", block_tokens)
                for i, line in enumerate(lines, 1) if line.strip()]
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def read_mooncake_trace(path: str | os.PathLike[str],
                        block_tokens: int = TRACE_BLOCK_TOKENS) -> list[Request]:
    """Read a Mooncake-format JSONL trace, sorted by timestamp (ties keep file order).

    Args:
        path: the ``.jsonl`` file.
        block_tokens: tokens per hash id (512 in the released traces); each line must
            have ``ceil(input_length / block_tokens)`` ids.
    Raises:
        TraceError: the file cannot be read, or a line is malformed (the message gives
            ``file:line`` and what is wrong).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return parse_lines(f, str(path), block_tokens)
    except OSError as e:
        raise TraceError(f"cannot read trace {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"trace {str(path)!r} is not UTF-8 text: {e}") from None
