"""The remote tier: blocks as objects in a Mooncake Store cluster shared by many nodes. Holds
the object format, the client library plumbing, the deadline/circuit-breaker guard, the
registered staging buffer, single-block and batched calls, and a one-machine cluster on
loopback for tests.
"""

from tiers.mooncake.tier import MooncakeConfig, MooncakeTier, RemoteHealth

__all__ = ["MooncakeConfig", "MooncakeTier", "RemoteHealth"]
