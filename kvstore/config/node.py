"""The node config's schema: one frozen dataclass per TOML table, and the choices a key accepts.

Each field is a key of its table, with its default (sizes in bytes, times in seconds: the
``_s`` suffix; ``_ms``: milliseconds). The reference of every key, with its default and
meaning, is ``kvstore/config/reference.toml`` (a test checks it loads to :class:`Config`'s
defaults). Parsing a TOML table into these classes is :mod:`kvstore.config.load`; the
rules a value must meet are :mod:`kvstore.config.rules`. Nothing here builds a tier or
any other part of the daemon (that is :mod:`kvstore.service.build`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvstore.common.types import PUBLISH_CHOICES

EVICTION_CHOICES = ("lru", "arc", "s3fifo", "next_use")
WRITE_CHOICES = ("write_back", "write_through")
IO_CHOICES = ("auto", "gds", "posix")
PINNED_CHOICES = ("auto", "true", "false")
HUGE_PAGES_CHOICES = ("auto", "hugetlb", "thp", "off")
PREDICTOR_CHOICES = ("quantile", "lognormal")    # kvstore.agent.tool_durations.ESTIMATORS
"""``[tiers.host] huge_pages``: the arena's pages (:mod:`tiers.memory`)."""
REMOTE_KINDS = ("mooncake",)
PROTOCOL_CHOICES = ("tcp", "rdma")
HOP_TIERS = ("hbm", "host", "nvme", "remote")
"""Tier kinds a ``[prefetch.hop_bandwidth]`` entry names, as ``"SRC:DST"``."""

MAX_SIZE = (1 << 63) - 1
"""Largest size any key accepts (bytes): sizes travel as uint64 in the gRPC stats."""
SIZE_KEYS = frozenset({"capacity", "max_message_bytes", "max_chunk_bytes", "segment", "staging",
                       "min_throughput", "page_in_chunk"})
"""Keys that take sizes (``"64MiB"``, or a number of bytes)."""


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: the gRPC server, access, and how the daemon stops."""

    listen: str = "unix:kvstore-data/kvstore.sock"
    max_message_bytes: int = 64 << 20
    max_chunk_bytes: int = 1 << 20
    workers: int = 32
    max_streams: int = 0                  # streaming calls served at once (0: workers - workers // 4)
    stream_idle_timeout_s: float = 30.0   # a stream whose client sends or reads nothing for this long is cancelled
    stream_first_message_s: float = 5.0   # ... and a Put stream that has sent no message yet, after this long
    stream_timeout_s: float = 120.0       # a streaming call running longer is ended
    auth_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tenants: Mapping[str, str] = field(default_factory=dict)   # tenant name -> bearer token
    lease_ttl_s: float = 30.0             # the longest lease / reservation TTL granted
    stop_grace_s: float = 5.0             # calls in flight get this long when ``kvstore serve`` stops
    eviction_log_blocks: int = 100_000    # blocks whose last evictions ``kvstore explain`` can name


@dataclass(frozen=True)
class BlocksConfig:
    """``[blocks]``: the block size clients must use (0: not set) and the key hash."""

    block_tokens: int = 0
    hash: str = "sha256"


@dataclass(frozen=True)
class PolicyConfig:
    """``[policy]``: every tier's default eviction policy, the write policy, promotion on
    reads, and the background cleaner's watermarks (fractions of capacity)."""

    eviction: str = "lru"
    write: str = "write_back"
    params: Mapping[str, Any] = field(default_factory=dict)
    low_watermark: float = 0.85
    high_watermark: float = 0.95
    promote_on_get: bool = True


@dataclass(frozen=True)
class TierPolicyConfig:
    """A tier's override of the eviction policy (``[tiers.X.policy]``)."""

    eviction: str = "lru"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HBMConfig:
    enabled: bool = False
    capacity: int = 8 << 30
    device: int = 0
    policy: TierPolicyConfig | None = None


@dataclass(frozen=True)
class HostConfig:
    enabled: bool = True
    capacity: int = 1 << 30
    pinned: str = "auto"
    shared: bool = True
    huge_pages: str = "auto"
    block_table: bool = True
    policy: TierPolicyConfig | None = None


@dataclass(frozen=True)
class NVMeConfig:
    enabled: bool = True
    path: str = "kvstore-data/nvme"
    capacity: int = 16 << 30
    io: str = "auto"
    fsync: bool = False
    policy: TierPolicyConfig | None = None


@dataclass(frozen=True)
class RemoteConfig:
    """``[tiers.remote]``: the cluster (Mooncake Store), the daemon's last tier; off by default.
    ``segment`` None: as much as ``capacity``. What the core does with the tier:
    :mod:`kvstore.cluster.cluster`; the tier: :mod:`tiers.mooncake`; the setup and measured
    behaviour: ``docs/remote_tier.md``."""

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
    min_throughput: int = 256 << 20       # bytes per second
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_in_flight: int = 8
    publish: str = "demoted"
    lookup_timeout_s: float = 0.5
    publish_backlog: int = 65536          # puts waiting to be published (publish = "all")
    page_in_chunk: int = 0                # bytes one page-in fetches at once (0: the staging buffer)
    policy: TierPolicyConfig | None = None


@dataclass(frozen=True)
class TiersConfig:
    hbm: HBMConfig = field(default_factory=HBMConfig)
    host: HostConfig = field(default_factory=HostConfig)
    nvme: NVMeConfig = field(default_factory=NVMeConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)


@dataclass(frozen=True)
class StoreConfig:
    """``[store]``: the tier manager's deadlines (seconds)."""

    writer_wait_s: float = 10.0           # a put of a key another client is writing waits this long
    transfer_timeout_s: float = 30.0      # a tier-to-tier copy waited on longer is abandoned
    stop_persist_s: float = 60.0          # on stop, blocks only in memory are copied to NVMe (0: skip)


@dataclass(frozen=True)
class PrefetchConfig:
    """``[prefetch]``: tool-call- and session-timed promotion
    (:class:`kvstore.agent.prefetch.PrefetchScheduler`, whose arguments of the same names
    these keys are). ``hop_bandwidth``: bytes per second per ``"SRC:DST"`` hop, over the
    scheduler's built-in estimates."""

    enabled: bool = False
    predictor: str = "quantile"
    lead_time_s: float = 0.05
    quantile: float = 0.1
    window: int = 64
    expire_factor: float = 10.0
    max_wait_s: float = 3600.0
    max_waiting: int = 65536
    hop_bandwidth: Mapping[str, int] = field(default_factory=dict)
    measure_bandwidth: bool = True
    headroom_fraction: float = 0.0
    active_protect_s: float = 30.0
    poll_s: float = 0.05
    refresh_s: float = 2.0
    retry_s: float = 0.5
    margin_s: float = 1.0
    dedupe_s: float = 0.5
    victim_margin: float = 2.0
    repromote: bool = False
    protect_s: float = 30.0
    confidence: float = 0.7
    horizon_s: float = 30.0
    exclusive_after_s: float = 2.0


@dataclass(frozen=True)
class SessionsConfig:
    """``[sessions]``: the session-hint table (:class:`kvstore.agent.sessions.SessionTable`)."""

    calibrate: bool = True                # learn how hinted gaps turn out, correct per session
    default_gap_s: float = 60.0           # expected gap before any was observed
    window: int = 256                     # observed gaps kept for the learned median
    max_sessions: int = 100_000           # sessions remembered (least recently hinted forgotten)
    max_keys: int = 4_000_000             # keys whose owning session is remembered; keys held by hints in all


@dataclass(frozen=True)
class EventsConfig:
    """``[events]``: KV events for cache-aware routers (kvstore/service/events.py)."""

    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str = ""
    topic: str = "kvstore"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue: int = 100_000
    batch_ms: float = 10.0
    snapshot_interval_s: float = 0.0      # also re-send every block this often (0: on joins, restarts, gaps)


@dataclass(frozen=True)
class EnginesConfig:
    """``[engines]``: what the daemon reads from its engines (kvstore/agent/engine_holdings.py).

    ``kv_events``: ZMQ endpoints of the engines' own KV event publishers (vLLM's
    ``--kv-events-config`` ``endpoint``, e.g. ``"tcp://127.0.0.1:5557"``): prefetch then
    pages back only the blocks an engine no longer holds. ``kv_events_topic``: their topic
    ("": every topic)."""

    kv_events: tuple[str, ...] = ()
    kv_events_topic: str = ""


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint (kvstore/service/metrics.py); empty ``listen``: off."""

    listen: str = ""


@dataclass(frozen=True)
class HealthConfig:
    """``[health]``: the health monitor (kvstore/service/health.py), in seconds."""

    period_s: float = 1.0                 # how often the tiers are checked
    window_s: float = 10.0                # while puts fail, a failure this recent means not serving


@dataclass(frozen=True)
class Config:
    """The whole node config; build it with :func:`kvstore.config.load` / ``loads`` / ``from_dict``."""

    server: ServerConfig = field(default_factory=ServerConfig)
    blocks: BlocksConfig = field(default_factory=BlocksConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def tier_policy(self, tier: str) -> TierPolicyConfig:
        """The eviction policy of ``tier`` (its override, else ``[policy]``'s)."""
        override = getattr(self.tiers, tier).policy
        if override is not None:
            return override
        return TierPolicyConfig(self.policy.eviction, self.policy.params)


TIER_SECTIONS = (HBMConfig, HostConfig, NVMeConfig, RemoteConfig)
"""The ``[tiers.X]`` tables: each may have a ``[tiers.X.policy]`` override."""

__all__ = ["BlocksConfig", "Config", "EVICTION_CHOICES", "EnginesConfig", "EventsConfig", "HBMConfig", "HOP_TIERS", "HealthConfig",
           "HostConfig", "HUGE_PAGES_CHOICES", "IO_CHOICES", "MAX_SIZE", "MetricsConfig", "NVMeConfig", "PINNED_CHOICES",
           "PROTOCOL_CHOICES", "PUBLISH_CHOICES", "PolicyConfig", "PrefetchConfig", "REMOTE_KINDS", "RemoteConfig",
           "SIZE_KEYS", "ServerConfig", "SessionsConfig", "StoreConfig", "TIER_SECTIONS", "TierPolicyConfig",
           "TiersConfig"]
