"""The records of :class:`kvstore.agent.sessions.SessionTable`: one session's hint, a hint
waiting to be judged, an ended session watched for a return, and the table's counts."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.agent.session_hint import SessionState


@dataclass
class Pending:
    """A source's continuing hint, to be judged by the session's return."""

    source: str
    hinted_at: float
    raw_gap: float | None        # the hint's expected_back_s
    median: float                # the table's own guess then


@dataclass
class Ended:
    """A finished or abandoned session, watched for a return that proves its hint wrong."""

    source: str
    time: float
    keys: list[bytes]            # the blocks it would let go ...
    allowed: list[int]           # ... and the uses each is allowed


@dataclass
class Session:
    sid: str
    state: SessionState
    keys: tuple[bytes, ...]
    hinted_at: float
    expected: float          # absolute seconds; inf when not continuing
    deadline: float          # absolute seconds (TTL); inf: none
    outcome: list | None = None    # HintCalibration record of this hint
    raw_gap: float | None = None   # the gap the hint gave (before the session's correction)
    exact: bool = False            # a commitment (kept until used), not a prediction
    believed: bool = True          # its source is trusted: the hint moves placement
    pending: Pending | None = None
    back: bool = False             # its return was seen (returned()): the next hint is no second return


@dataclass
class SessionStats:
    """Counts of hints and of their effect (blocks)."""

    hints: int = 0
    continues: int = 0
    finished: int = 0
    abandoned: int = 0
    released_blocks: int = 0     # blocks let go (the name is the simulator report's key)
    kept_used: int = 0           # blocks of ended sessions kept: somebody else used them
    ignored: int = 0             # hints of a source not trusted: recorded, moved nothing
    lapsed: int = 0
    returns: int = 0
