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
from kvstore.common.hint_limits import MAX_HINT_KEYS, check_seconds, show

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
        session_id: the session (trajectory, conversation); non-empty. A caller's id is
            checked where it enters (:func:`kvstore.common.hint_limits.check_name`); the
            daemon's ids are scoped to the caller's tenant (``tenant`` NUL ``id``).
        state: :class:`SessionState`.
        keys: the session's stored prefix blocks in prefix order (32-byte keys, at most
            :data:`~kvstore.common.hint_limits.MAX_HINT_KEYS`); empty: the keys of its
            previous hint.
        expected_back_s: seconds from ``time`` until its next request (continues only;
            None: unknown, learned); at most one day (``MAX_HINT_S``).
        ttl_s: keep its blocks near for at most this many seconds (continues only;
            None: no limit); at most one day.
        time: when the hint applies (seconds, the table's clock, finite; None: now).
        source: who says so (an agent framework, a model of hints; at most
            :data:`MAX_SOURCE_CHARS` characters); trust is kept per source
            (:class:`kvstore.agent.hint_trust.HintTrust`); the daemon sets the caller's
            tenant. Empty: the shared source.
        dropped: blocks the session's context dropped (a ``kv_hints`` evict edit of a
            block range; continues only): not part of ``keys``, let go as the session's
            own where nothing else used them.
    Raises:
        InvalidRequest: empty or unencodable id, times negative, non-finite or above
            their bound, bad or too many keys, bad source.
    """

    session_id: str
    state: SessionState
    keys: tuple[bytes, ...] = ()
    expected_back_s: float | None = None
    ttl_s: float | None = None
    time: float | None = None
    source: str = ""
    dropped: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        sid = self.session_id
        if not isinstance(sid, str) or not sid:
            raise InvalidRequest(f"session hint: session_id must be a non-empty string, got {show(sid)}")
        try:
            sid.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"session hint: session_id is not valid Unicode, got {show(sid)}") from None
        try:
            object.__setattr__(self, "state", SessionState(self.state))
        except (ValueError, TypeError):
            raise InvalidRequest(f"session hint: state must be one of "
                                 f"{[s.value for s in SessionState]}, got {show(self.state)}") from None
        for name in ("expected_back_s", "ttl_s"):
            object.__setattr__(self, name, check_seconds(getattr(self, name), f"session hint: {name}"))
        # a clock reading: may be below 0 (a monotonic clock shortly after boot)
        object.__setattr__(self, "time", check_seconds(self.time, "session hint: time", math.inf, -math.inf))
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequest(f"session hint: source must be a string of at most {MAX_SOURCE_CHARS} characters")
        keys, dropped = tuple(self.keys), tuple(self.dropped)
        if len(keys) + len(dropped) > MAX_HINT_KEYS:
            raise InvalidRequest(f"session hint: {len(keys) + len(dropped)} keys; at most {MAX_HINT_KEYS} per hint")
        object.__setattr__(self, "keys", _block_keys(keys))
        object.__setattr__(self, "dropped", _block_keys(dropped))


def _block_keys(keys: tuple) -> tuple[bytes, ...]:
    """``keys`` as a tuple of bytes; InvalidRequest unless each is a 32-byte key."""
    if not keys:
        return keys
    types = set(map(type, keys))          # C-level passes: a hint may name 131,072 keys
    if not types <= {bytes, bytearray} or set(map(len, keys)) != {32}:
        raise InvalidRequest("session hint: keys must be 32-byte block keys")
    return keys if types == {bytes} else tuple(map(bytes, keys))


def source_of(hint: SessionHint) -> str:
    """The source trust is kept for: the declared one (the daemon declares the caller's
    tenant), else the shared source ``""``. Never read from the session id, which the
    caller chooses."""
    return hint.source
