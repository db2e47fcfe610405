"""The ``[tiers.remote]`` section: the cluster tier's keys, their validation, and the tier
they build (the last tier of the daemon, after NVMe; off by default).

Example (every key optional; these are the defaults)::

    [tiers.remote]
    enabled = false
    kind = "mooncake"                  # registry name -> tier class (only "mooncake" now)
    master = "127.0.0.1:50051"         # the Mooncake master's RPC address
    metadata_server = "http://127.0.0.1:8080/metadata"   # or "etcd://...", "P2PHANDSHAKE"
    local_hostname = "127.0.0.1"       # how peers reach this node
    protocol = "tcp"                   # tcp | rdma
    rdma_devices = ""
    capacity = "4GiB"                  # blocks this node may keep in the cluster
    # segment = "1GiB"                 # memory mounted into the pool (default: capacity; 0: none)
    staging = "64MiB"                  # registered staging buffer; also the largest block
    prefix = "kvstore/"                # object names: prefix + key hex
    tenant = "default"
    replicas = 1
    prefer_local_segment = false
    timeout_s = 2.0                    # deadline of a metadata call, base of a transfer's
    min_throughput = "256MiB"          # per second: a transfer of n bytes gets timeout_s + n / this
    failure_threshold = 3              # consecutive failures that open the circuit
    cooldown_s = 5.0                   # seconds the circuit stays open before a probe
    max_in_flight = 8                  # concurrent calls into the client library
    publish = "demoted"                # demoted: blocks leaving NVMe; all: every put, in the background
    lookup_timeout_s = 0.5             # deadline of the existence check a Lookup makes

    [tiers.remote.policy]              # optional: eviction of this node's blocks in the cluster
    eviction = "lru"

What the core does with the tier: :mod:`kvstore.cluster.cluster`; the tier: :mod:`tiers.mooncake`;
measured behaviour and the Mooncake setup: ``docs/remote_tier.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.common.errors import ConfigError
from kvstore.cluster.cluster import PUBLISH_CHOICES, ClusterOptions

if TYPE_CHECKING:  # pragma: no cover
    from tiers.base import Tier

    from kvstore.config.node import TierPolicyConfig

REMOTE_KINDS = ("mooncake",)
PROTOCOL_CHOICES = ("tcp", "rdma")
REMOTE_SIZE_FIELDS = frozenset({"segment", "staging", "min_throughput"})
"""Keys of ``[tiers.remote]`` that take sizes (``"64MiB"``), besides ``capacity``."""
MIN_SEGMENT_BYTES = 16 << 20
SETUP_HINT = "run scripts/setup-mooncake.sh (installs libibverbs1 and the Mooncake wheel)"


@dataclass(frozen=True)
class RemoteConfig:
    """``[tiers.remote]``, parsed (sizes in bytes, times in seconds; see the module
    docstring). ``segment`` None: as much as ``capacity``."""

    enabled: bool = False
    kind: str = "mooncake"
    master: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    capacity: int = 4 << 30
    segment: int | None = None
    staging: int = 64 << 20
    prefix: str = "kvstore/"
    tenant: str = "default"
    replicas: int = 1
    prefer_local_segment: bool = False
    timeout_s: float = 2.0
    min_throughput: int = 256 << 20
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_in_flight: int = 8
    publish: str = "demoted"
    lookup_timeout_s: float = 0.5
    policy: "TierPolicyConfig | None" = None


def _fail(key: str, why: str) -> None:
    raise ConfigError(f"tiers.remote.{key}: {why}")


def validate_remote(r: RemoteConfig) -> None:
    """Check ``[tiers.remote]``; raise ConfigError naming the key."""
    if r.kind not in REMOTE_KINDS:
        _fail("kind", f"{r.kind!r} is not one of {', '.join(REMOTE_KINDS)}")
    if r.protocol not in PROTOCOL_CHOICES:
        _fail("protocol", f"{r.protocol!r} is not one of {', '.join(PROTOCOL_CHOICES)}")
    if r.publish not in PUBLISH_CHOICES:
        _fail("publish", f"{r.publish!r} is not one of {', '.join(PUBLISH_CHOICES)}")
    host, sep, port = r.master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        _fail("master", f"{r.master!r} is not HOST:PORT")
    for key in ("metadata_server", "local_hostname", "prefix"):
        if not getattr(r, key):
            _fail(key, "must not be empty")
    if r.capacity <= 0:
        _fail("capacity", f"must be > 0, got {r.capacity}")
    segment = r.capacity if r.segment is None else r.segment
    if segment != 0 and segment < MIN_SEGMENT_BYTES:
        _fail("segment", f"must be 0 (a pure client) or at least 16MiB (Mooncake refuses less), got {segment} "
                         "bytes" + (" (it defaults to capacity)" if r.segment is None else ""))
    if r.staging < (1 << 20):
        _fail("staging", f"must be at least 1MiB, got {r.staging}")
    if r.replicas < 1:
        _fail("replicas", f"must be >= 1, got {r.replicas}")
    for key in ("timeout_s", "lookup_timeout_s"):
        value = getattr(r, key)
        if not 0 < value < math.inf:
            _fail(key, f"must be > 0 seconds, got {value}")
    if not 0 <= r.cooldown_s < math.inf:
        _fail("cooldown_s", f"must be >= 0 seconds, got {r.cooldown_s}")
    if r.min_throughput <= 0:
        _fail("min_throughput", f"must be > 0 bytes per second, got {r.min_throughput}")
    for key in ("failure_threshold", "max_in_flight"):
        if getattr(r, key) < 1:
            _fail(key, f"must be >= 1, got {getattr(r, key)}")


def cluster_options(r: RemoteConfig) -> ClusterOptions | None:
    """How the core uses the tier (None when the section is off)."""
    return ClusterOptions(publish=r.publish, lookup_timeout_s=r.lookup_timeout_s) if r.enabled else None


def build_remote_tier(r: RemoteConfig) -> "Tier":
    """The remote tier of ``[tiers.remote]``. Returns at once: the session with the
    master is made in the background, so a master that is down never delays start-up
    (the tier answers "unavailable" until it connects).

    Raises ConfigError when the client library cannot load (naming the missing package
    and the setup script) or a setting is refused.
    """
    from tiers.mooncake.tier import MooncakeTier
    from tiers.mooncake.client import MooncakeConfig, MooncakeUnavailable

    try:
        mc = MooncakeConfig(master=r.master, metadata_server=r.metadata_server, local_hostname=r.local_hostname,
                            protocol=r.protocol, rdma_devices=r.rdma_devices, capacity_bytes=r.capacity,
                            segment_bytes=r.segment, staging_bytes=r.staging, prefix=r.prefix, tenant=r.tenant,
                            replicas=r.replicas, prefer_local_segment=r.prefer_local_segment,
                            timeout_s=r.timeout_s, min_throughput=float(r.min_throughput),
                            failure_threshold=r.failure_threshold, cooldown_s=r.cooldown_s,
                            max_in_flight=r.max_in_flight)
        return MooncakeTier(mc, name="remote")
    except MooncakeUnavailable as e:
        raise ConfigError(f"tiers.remote: the Mooncake client cannot be used here: {e}; {SETUP_HINT}, "
                          "or set tiers.remote.enabled = false") from None
    except (ValueError, MemoryError, OSError) as e:
        raise ConfigError(f"tiers.remote: {e}") from None


__all__ = ["REMOTE_KINDS", "REMOTE_SIZE_FIELDS", "RemoteConfig", "build_remote_tier", "cluster_options",
           "validate_remote"]
