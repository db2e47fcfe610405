"""The remote tier (:class:`MooncakeTier`, in :mod:`tiers.mooncake.tier`): blocks as objects in
a Mooncake Store cluster shared by many nodes, each object a 64-byte header (key, size,
xxh3_64) and the payload, verified before a byte is served (:mod:`tiers.mooncake.object_format`).
It holds the client library plumbing and settings (:mod:`tiers.mooncake.client`), the
deadline and circuit breaker every library call goes through (:mod:`tiers.mooncake.guard`),
the registered staging buffer (:mod:`tiers.mooncake.staging`), the ledger of the blocks this
node put (:mod:`tiers.mooncake.ledger`), the context its parts share
(:mod:`tiers.mooncake.context`), single-block reads (:mod:`tiers.mooncake.read`), batched
calls (:mod:`tiers.mooncake.batch`), background removals (:mod:`tiers.mooncake.remover`), and
a one-machine cluster on loopback for tests and benchmarks (:mod:`tiers.mooncake.local_cluster`).
"""

from tiers.mooncake.tier import MooncakeConfig, MooncakeTier, RemoteHealth

__all__ = ["MooncakeConfig", "MooncakeTier", "RemoteHealth"]
