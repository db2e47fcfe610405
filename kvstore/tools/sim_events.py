"""Tool-call and session events in ``kvstore simulate``, and the score of every resume.

The simulator feeds a generated agent trace's events (:mod:`kvstore.tools.agent_events`)
to the prefetch scheduler as the daemon's gRPC handlers would. The scheduler's own
statistics score the resumes it was waiting for; a trajectory it expired (waited too
long) or never knew is left out there. :class:`ResumeScore` scores *every* resume the
trace has, independently of the scheduler: the blocks of the trajectory's prefix (its
last tool call's keys) that were in the fastest tier, with any page back finished,
when the resume arrived; a resume the scheduler did not wait for (expired, or unknown)
counts as not ready at all, whatever the tier holds.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvstore.agent.prefetch import PrefetchScheduler
from kvstore.agent.sessions import SessionHint, SessionState


class ResumeScore:
    """Readiness of every resume of a trace (blocks weigh as tokens: prefixes are whole
    blocks)."""

    def __init__(self) -> None:
        self._prefix: dict[str, list[bytes]] = {}
        self.resumes = 0
        self.ready = 0               # whole prefix ready
        self.blocks = 0
        self.ready_blocks = 0
        self.not_waited = 0          # resumes the scheduler had expired or never knew

    def event(self, scheduler: PrefetchScheduler, e, t: float,
              keys_of: Callable[[Sequence[int]], list[bytes]]) -> None:
        """Feed one event to ``scheduler`` at ``t`` (seconds), scoring a resume."""
        if e.kind == "resume":
            keys = self._prefix.pop(e.trajectory, None)
            ready = scheduler.ready_prefix(keys, t) if keys else 0
            st = scheduler.stats
            before = st.resumes
            scheduler.resume(e.trajectory, t)
            if keys is None:
                return
            if st.resumes == before:             # expired or unknown: not ready
                ready = 0
                self.not_waited += 1
            self.resumes += 1
            self.blocks += len(keys)
            self.ready_blocks += ready
            self.ready += ready == len(keys)
        elif e.kind == "tool_call_start":
            keys = keys_of(e.hash_ids)
            self._prefix[e.trajectory] = keys
            scheduler.tool_call_start(e.trajectory, e.tool, t, keys)
        elif e.kind == "session_end":
            self._prefix.pop(e.trajectory, None)
            scheduler.session_hint(SessionHint(e.trajectory, SessionState(e.state), tuple(keys_of(e.hash_ids)),
                                               time=t))

    def summary(self) -> dict:
        """``resumes``, ``ready_rate`` (whole prefix), ``ready_token_rate`` and ``not_waited``."""
        return {"resumes": self.resumes, "not_waited": self.not_waited,
                "ready_rate": self.ready / self.resumes if self.resumes else 0.0,
                "ready_token_rate": self.ready_blocks / self.blocks if self.blocks else 0.0}
