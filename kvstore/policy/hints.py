"""Optional hint interfaces a policy may implement on top of :class:`EvictionPolicy`.

The manager never calls these; the agent-aware components do:

- :class:`UsesReuseModel`: the policy reads learned reuse statistics from a shared
  :class:`kvstore.policy.reuse_model.ReuseModel` (``next_use``). The
  :class:`kvstore.agent.prefetch.PrefetchScheduler` (daemon) and ``kvstore simulate`` feed
  the model every request's keys and :meth:`attach` it to every policy that wants it.
- :class:`AcceptsNextUse`: the policy takes explicit predicted next-use times for keys
  (``next_use`` from tool-call predictions, ``opt`` from the simulator's oracle).
- :class:`PredictsDistance`: the policy predicts when a resident block is needed next
  (``next_use``); prefetch uses it not to displace blocks needed sooner.
- :class:`CalibratesHints`: the policy corrects hinted gaps with the session table's
  learned calibration (``next_use``).

All four are checked with ``isinstance`` (runtime protocols), so a policy opts in by
defining the method; :class:`kvstore.policy.lru.LRUPolicy` and the other classic
policies simply ignore hints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.policy.reuse_model import ReuseModel


@runtime_checkable
class UsesReuseModel(Protocol):
    def attach(self, model: "ReuseModel") -> None:
        """Use ``model`` (shared by all tiers) for record membership and reuse distances."""


@runtime_checkable
class AcceptsNextUse(Protocol):
    def set_next_use(self, keys: Sequence[bytes], times: float | Sequence[float], now: float,
                     since: float | None = None, exact: bool = False) -> None:
        """Predicted next use of ``keys``: one time for all, or one per key (seconds, same
        clock as ``now``; ``math.inf`` = never), predicted at ``since`` (default ``now``;
        the hinted gap is ``time - since``); ``exact``: a commitment, not a prediction
        to calibrate. ``keys`` are in prefix order."""


@runtime_checkable
class PredictsDistance(Protocol):
    def distance(self, key: bytes, now: float) -> float:
        """Predicted seconds from ``now`` until ``key`` is used again (``math.inf``: never)."""


@runtime_checkable
class CalibratesHints(Protocol):
    def use_calibration(self, calibration) -> None:
        """Correct hinted gaps with ``calibration`` (a :class:`kvstore.agent.hint_model.HintCalibration`,
        shared by the session table that learns it; None: take hints as given)."""
