"""The node config: one TOML file, parsed, validated once and passed down as frozen dataclasses.
It owns every knob the daemon has, each a key of one tree (server, blocks, tiers with the
cluster tier, policy, store, prefetch, sessions, events, metrics, health): the schema and
the choices a key accepts (:mod:`~kvstore.config.node`), loading TOML into it with each
value's type checked (:mod:`~kvstore.config.load`), and every rule between and on the
values (:mod:`~kvstore.config.rules`; load calls rules, rules reads the schema, nothing
imports back). The reference of every key with its default is ``reference.toml`` beside
these modules. It builds no part of the daemon: the tiers, the manager and the prefetch
scheduler are made from a Config by :mod:`kvstore.service.build`. Every failure is a
:class:`~kvstore.common.errors.ConfigError` naming the key.
"""

from kvstore.common.errors import ConfigError
from kvstore.config.load import from_dict, load, loads, replace
from kvstore.config.node import *  # noqa: F401,F403
from kvstore.config.node import __all__ as _node_all
from kvstore.config.rules import validate

__all__ = ["ConfigError", "from_dict", "load", "loads", "replace", "validate", *_node_all]
