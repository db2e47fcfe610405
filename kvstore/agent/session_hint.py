"""One session hint: what an agent framework says about a session's future.

The value type of :mod:`kvstore.agent.sessions` (which turns hints into placement), of
the gRPC ``SessionHint`` handler and of the vLLM ``kv_hints`` mapping
(:mod:`kvstore.agent.kv_hints`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvstore.common.errors import InvalidRequest

MAX_SOURCE_CHARS = 256
"""Longest declared hint source (characters)."""


class SessionState(str, enum.Enum):
    """What a session hint says about the session's future."""

    CONTINUES = "continues"
    FINISHED = "finished"
    ABANDONED = "abandoned"


@dataclass(frozen=True)
class SessionHint:
    """One hint about one session.

    Attributes:
        session_id: the session (trajectory, conversation); non-empty.
        state: :class:`SessionState`.
        keys: the session's stored prefix blocks in prefix order (32-byte keys); empty:
            the keys of its previous hint.
        expected_back_s: seconds from ``time`` until its next request (continues only;
            None: unknown, learned).
        ttl_s: keep its blocks near for at most this many seconds (continues only;
            None: no limit).
        time: when the hint applies (seconds, the table's clock; None: now).
        source: who says so (an agent framework, a model of hints; at most
            :data:`MAX_SOURCE_CHARS` characters); trust is kept per source
            (:class:`kvstore.agent.hint_trust.HintTrust`). Empty: :func:`source_of`.
    Raises:
        InvalidRequest: empty id, negative or non-finite times, bad keys or source.
    """

    session_id: str
    state: SessionState
    keys: tuple[bytes, ...] = ()
    expected_back_s: float | None = None
    ttl_s: float | None = None
    time: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise InvalidRequest("session hint: session_id must be a non-empty string")
        try:
            object.__setattr__(self, "state", SessionState(self.state))
        except ValueError:
            raise InvalidRequest(f"session hint: state must be one of "
                                 f"{[s.value for s in SessionState]}, got {self.state!r}") from None
        for name in ("expected_back_s", "ttl_s", "time"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise InvalidRequest(f"session hint: {name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequest(f"session hint: source must be a string of at most {MAX_SOURCE_CHARS} characters")
        keys = tuple(self.keys)
        if any(not isinstance(k, (bytes, bytearray)) or len(k) != 32 for k in keys):
            raise InvalidRequest("session hint: keys must be 32-byte block keys")
        object.__setattr__(self, "keys", tuple(bytes(k) for k in keys))


def source_of(hint: SessionHint) -> str:
    """The source trust is kept for: the declared one, else the tenant of a session id
    scoped by the daemon (``tenant`` NUL ``id``), else the shared source ``""``."""
    if hint.source:
        return hint.source
    tenant, sep, _ = hint.session_id.partition("\0")
    return tenant if sep else ""
