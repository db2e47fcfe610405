"""The node config: one TOML file, parsed, validated once and passed down frozen. Owns
every knob the daemon has (server, blocks, tiers, policy, prefetch, events, metrics,
the cluster tier) and the rules between them.
"""

from kvstore.common.errors import ConfigError
from kvstore.config.node import *  # noqa: F401,F403
from kvstore.config.node import __all__ as _node_all

__all__ = ["ConfigError", *_node_all]
