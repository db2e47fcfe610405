"""Eviction policies: the order in which one tier's resident blocks leave, selectable by name
in the TOML config. It owns the interface and its registry (``base``: an
:class:`EvictionPolicy` picks the next victim with :meth:`~EvictionPolicy.victim`, and a
finished session's blocks, let go, go first under every policy, until a use nobody
explains takes the let-go back: ``uses``), the policies ``lru``,
``arc``, ``s3fifo``, ``next_use`` (daemon policies) and ``opt`` (Belady's MIN, the
simulator's oracle), the optional hint protocols a policy may take (``hints``), and what
``next_use`` predicts with: the learned reuse model (``reuse_model``) and the explicit
next-use hints (``hint_groups``). Policies see keys, sizes and times, never data or
media; importing this package registers every built-in policy.
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
