"""Eviction policies, selectable by name in the TOML config.

Importing this package registers every built-in policy: ``lru``, ``arc``, ``s3fifo``,
``next_use`` (daemon policies) and ``opt`` (Belady's MIN, the simulator's oracle).
"""

from kvstore.policy.base import POLICIES, EvictionEvent, EvictionPolicy, NoVictim, make_policy, register
from kvstore.policy import lru  # noqa: F401  (registers "lru")
from kvstore.policy import arc  # noqa: F401  (registers "arc")
from kvstore.policy import s3fifo  # noqa: F401  (registers "s3fifo")
from kvstore.policy import next_use  # noqa: F401  (registers "next_use")
from kvstore.policy import opt  # noqa: F401  (registers "opt")
from kvstore.policy.hints import AcceptsNextUse, CalibratesHints, PredictsDistance, UsesReuseModel

__all__ = ["POLICIES", "EvictionEvent", "EvictionPolicy", "NoVictim", "make_policy", "register",
           "AcceptsNextUse", "CalibratesHints", "PredictsDistance", "UsesReuseModel"]
