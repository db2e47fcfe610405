"""Eviction policies, selectable by name in the TOML config.

Importing this package registers every built-in policy.
"""

from .base import POLICIES, EvictionPolicy, NoVictim, make_policy, register
from . import lru  # noqa: F401  (registers "lru")

__all__ = ["POLICIES", "EvictionPolicy", "NoVictim", "make_policy", "register"]
