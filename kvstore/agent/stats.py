"""What the prefetch scheduler did and how well: readiness, waste, prediction error."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

RESERVOIR = 4096
"""Prediction errors kept for the medians of :meth:`PrefetchStats.summary` (a uniform
sample of all resumes: Vitter 1985, "Random sampling with a reservoir", Algorithm R)."""


@dataclass
class PrefetchStats:
    """Counters of :class:`kvstore.agent.prefetch.PrefetchScheduler` (bytes, blocks, seconds).

    Readiness is measured at each known resume (a ``Resume``, or the next hint of a
    session that was expected back):

    - ``ready_rate``: share of resumes whose whole prefix was in the fastest tier (HBM)
      with every promotion of it finished;
    - ``ready_token_rate``: token-weighted: blocks of the longest such prefix over the
      prefix's blocks, summed over resumes (prefixes are whole blocks, so blocks
      weigh as tokens).
    """

    tool_calls: int = 0
    session_hints: int = 0
    resumes: int = 0
    resumes_unknown: int = 0
    resumes_ready: int = 0            # whole prefix in HBM (transfer finished) at resume
    resume_blocks: int = 0            # prefix blocks over all resumes
    ready_blocks: int = 0             # of those, in the HBM-ready prefix at resume
    promoted_blocks: int = 0          # paged back (promoted into HBM)
    promoted_bytes: int = 0
    used_bytes: int = 0               # paged back and still in HBM at resume
    wasted_bytes: int = 0             # paged back, evicted from HBM before use, or never used
    demoted_blocks: int = 0
    promotions_blocked: int = 0       # page backs stopped: no room without evicting a protected block
    engine_held_skipped: int = 0      # blocks a page back left out: an engine still held them
    engine_drop_page_backs: int = 0   # page backs run again after an engine dropped blocks
    waste_by: dict[str, int] = field(default_factory=dict)   # wasted bytes per reason
    expired: int = 0                  # waiting trajectories dropped without a resume
    resumes_expired: int = 0          # resumes of expired trajectories (learned from, not scored)
    abs_error_s: list[float] = field(default_factory=list)     # reservoir of |predicted - actual| (s)
    rel_error: list[float] = field(default_factory=list)       # the same resumes' relative errors
    errors_seen: int = 0
    abs_error_sum_s: float = 0.0
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False, compare=False)

    def add_error(self, abs_error_s: float, rel_error: float) -> None:
        """One resume's prediction error, kept in O(:data:`RESERVOIR`) memory."""
        self.errors_seen += 1
        self.abs_error_sum_s += abs_error_s
        if len(self.abs_error_s) < RESERVOIR:
            self.abs_error_s.append(abs_error_s)
            self.rel_error.append(rel_error)
            return
        j = self._rng.randrange(self.errors_seen)
        if j < RESERVOIR:
            self.abs_error_s[j], self.rel_error[j] = abs_error_s, rel_error

    def resumed(self, predicted_resume: float, now: float, observed_s: float, blocks: int, ready_blocks: int) -> None:
        """Score one resume at ``now`` of a wait predicted back at ``predicted_resume``
        (seconds) that lasted ``observed_s``: ``ready_blocks`` of its ``blocks`` prefix
        blocks were ready in the fastest tier."""
        self.resumes += 1
        err = predicted_resume - now
        self.add_error(abs(err), abs(err) / observed_s if observed_s > 0 else 0.0)
        self.resume_blocks += blocks
        self.ready_blocks += ready_blocks
        if ready_blocks == blocks:
            self.resumes_ready += 1

    def waste_of(self, nbytes: int, reason: str) -> None:
        """Count ``nbytes`` promoted bytes as wasted for ``reason``."""
        self.wasted_bytes += nbytes
        self.waste_by[reason] = self.waste_by.get(reason, 0) + nbytes

    @property
    def ready_rate(self) -> float:
        """Share of known resumes whose prefix was wholly in HBM when they arrived."""
        return self.resumes_ready / self.resumes if self.resumes else 0.0

    @property
    def ready_token_rate(self) -> float:
        """Token-weighted readiness: HBM-ready prefix blocks / prefix blocks at resumes."""
        return self.ready_blocks / self.resume_blocks if self.resume_blocks else 0.0

    @property
    def waste(self) -> float:
        """Wasted promoted bytes / promoted bytes (0 when nothing was promoted)."""
        return self.wasted_bytes / self.promoted_bytes if self.promoted_bytes else 0.0

    def summary(self) -> dict:
        errs = sorted(self.abs_error_s)
        rel = sorted(self.rel_error)
        return {
            "tool_calls": self.tool_calls, "session_hints": self.session_hints, "resumes": self.resumes,
            "resumes_unknown": self.resumes_unknown, "ready_rate": self.ready_rate,
            "ready_token_rate": self.ready_token_rate,
            "promoted_blocks": self.promoted_blocks, "promoted_bytes": self.promoted_bytes,
            "wasted_bytes": self.wasted_bytes, "waste": self.waste, "waste_by": dict(self.waste_by),
            "demoted_blocks": self.demoted_blocks, "promotions_blocked": self.promotions_blocked,
            "engine_held_skipped": self.engine_held_skipped, "engine_drop_page_backs": self.engine_drop_page_backs,
            "expired": self.expired, "resumes_expired": self.resumes_expired,
            "prediction_mae_s": self.abs_error_sum_s / self.errors_seen if self.errors_seen else 0.0,
            "prediction_median_abs_error_s": errs[len(errs) // 2] if errs else 0.0,
            "prediction_median_rel_error": rel[len(rel) // 2] if rel else 0.0,
        }
