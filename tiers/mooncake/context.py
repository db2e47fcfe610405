"""What the parts of the remote tier share: made once by :class:`tiers.mooncake.MooncakeTier`
and handed to each part (single-block reads, batched calls, background removals) through
its constructor, so no part reaches into the tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiers.mooncake.client import Connector, MooncakeConfig
from tiers.mooncake.guard import CallGuard
from tiers.mooncake.ledger import Ledger
from tiers.mooncake.object_format import object_name
from tiers.mooncake.staging import StagingArena


@dataclass
class CopyFaults:
    """Remote copies that reads could not serve, counted since start.

    Attributes:
        corrupt: copies that failed verification (or were longer than the block stored).
        peer_errors: reads that the peer holding the copy did not serve.
        oversize: batch reads whose object exceeded the caller's buffer.
    """

    corrupt: int = 0
    peer_errors: int = 0
    oversize: int = 0


@dataclass(frozen=True)
class RemoteContext:
    """This node's means of reaching the cluster and what it knows of its own blocks.

    Attributes:
        name: the tier's name, in logs and errors.
        config: the tier's settings (deadlines: :meth:`MooncakeConfig.deadline_s`).
        staging: the registered buffer every transfer goes through.
        guard: the deadline and circuit breaker every library call goes through.
        connector: the session with the cluster (:meth:`session`).
        ledger: the blocks this node put and its open writes.
        replicate: the library's ``ReplicateConfig`` for puts.
        faults: counts of copies reads could not serve.
    """

    name: str
    config: MooncakeConfig
    staging: StagingArena
    guard: CallGuard
    connector: Connector
    ledger: Ledger
    replicate: Any
    faults: CopyFaults = field(default_factory=CopyFaults)

    def session(self) -> Any:
        """The library's store object. Raises RemoteUnavailable (not connected, closed)."""
        return self.connector.require()

    def object_name(self, key: bytes) -> str:
        """The cluster object name of a block (``prefix + key hex``)."""
        return object_name(self.config.prefix, key)


__all__ = ["CopyFaults", "RemoteContext"]
