"""The node config: one TOML file, validated once at start, passed down frozen.

Example (every key optional; these are the defaults unless noted)::

    [server]
    listen = "unix:kvstore-data/kvstore.sock"   # or "127.0.0.1:50051" (TCP, loopback)
    max_message_bytes = "64MiB"   # gRPC send/receive limit per message
    max_chunk_bytes = "1MiB"      # largest payload in one Get message (measured: larger is slower;
                                  # default: 1MiB, or max_message_bytes - 16KiB when that is less)
    workers = 32                  # gRPC thread pool size (a Put stream holds one while it runs)
    stream_idle_timeout_s = 30.0  # cancel a Put stream that sends nothing for this long
    auth_token = ""               # bearer token required on every call when set
    tls_cert = ""                 # PEM files: serve TLS when both are set
    tls_key = ""

    [server.tenants]              # optional, instead of auth_token: tenant name = "token";
    alice = "token-of-alice"      # each tenant gets a private key space (kvstore/service/auth.py)

    [blocks]
    block_tokens = 0              # tokens per block of this node's clients (0: not set): published
                                  # by Info; clients cutting prompts into other blocks are refused
                                  # (KVStoreClient.check_block_tokens: kvstore replay, the engine adapter)
    hash = "sha256"               # how keys are computed (the only choice: chained SHA-256)

    [tiers.hbm]                   # GPU memory; off unless a GPU is present and enabled
    enabled = false
    capacity = "8GiB"
    device = 0

    [tiers.host]
    capacity = "1GiB"
    pinned = "auto"               # auto | true | false (pinned needs a GPU)
    shared = true                 # a memfd that same-node clients map (zero-copy get/put)

    [tiers.nvme]
    enabled = true
    path = "kvstore-data/nvme"
    capacity = "16GiB"
    io = "auto"                   # auto | gds | posix
    fsync = false                 # fsync files and index on every put (power-loss safety)

    [tiers.remote]                # the cluster (Mooncake Store), the last tier; off by default
    enabled = false               # (the keys: kvstore/config/remote.py, docs/remote_tier.md)
    master = "127.0.0.1:50051"
    metadata_server = "http://127.0.0.1:8080/metadata"
    publish = "demoted"           # demoted | all (every put, in the background)

    [policy]
    eviction = "lru"              # default policy of every tier: lru | arc | s3fifo | next_use
    write = "write_back"          # write_back | write_through
    params = {}                   # policy parameters, e.g. { small_ratio = 0.1 } for s3fifo
    low_watermark = 0.85          # background cleaning: when a tier holds more than
    high_watermark = 0.95         # high x capacity, copy its coldest blocks down (the last
                                  # tier: evict) until low x capacity is dirty (used)

    [tiers.host.policy]           # optional per-tier override of the eviction policy
    eviction = "arc"              # (eviction and params only; write and watermarks are global)

    [events]                      # KV events for cache-aware routers (vLLM format, ZMQ PUB)
    enabled = false
    endpoint = "tcp://127.0.0.1:5557"
    replay_endpoint = ""          # e.g. "tcp://127.0.0.1:5558": subscribers ask for missed batches
    topic = "kvstore"
    batch_ms = 10.0               # events sent together within this many milliseconds

    [metrics]
    listen = ""                   # e.g. "127.0.0.1:9400": Prometheus /metrics; empty: off

    [prefetch]
    enabled = false
    predictor = "quantile"
    lead_time_s = 0.05
    quantile = 0.1                # the prefix must be back in HBM by this quantile of the tool's duration
    window = 64
    expire_factor = 10.0          # a trajectory that has not resumed after this many times its tool's
    max_wait_s = 3600.0           # predicted (median) duration, or after max_wait_s, stops waiting
    max_waiting = 65536           # most trajectories waiting (and most recently resumed ones kept)

    [server]                      # (continued)
    lease_ttl_s = 30.0            # default lease / reservation TTL of the same-node path

Unknown keys and bad values raise :class:`kvstore.common.errors.ConfigError` naming the key,
e.g. ``tiers.host.capcity: unknown key``. The cross-field rules are
:func:`kvstore.config.rules.validate` (re-exported here as :func:`validate`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvstore.config.rules import EVICTION_CHOICES, IO_CHOICES, WRITE_CHOICES, validate
from kvstore.common.errors import ConfigError
from kvstore.config.remote import REMOTE_SIZE_FIELDS, RemoteConfig
from kvstore.common.units import parse_size

__all__ = ["BlocksConfig", "Config", "EVICTION_CHOICES", "EventsConfig", "HBMConfig", "HostConfig", "IO_CHOICES",
           "MAX_SIZE", "MetricsConfig", "NVMeConfig", "PolicyConfig", "PrefetchConfig", "RemoteConfig",
           "ServerConfig", "TierPolicyConfig", "TiersConfig", "WRITE_CHOICES", "from_dict", "load", "loads",
           "replace", "validate"]


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "unix:kvstore-data/kvstore.sock"
    max_message_bytes: int = 64 << 20
    max_chunk_bytes: int = 1 << 20
    workers: int = 32
    stream_idle_timeout_s: float = 30.0
    auth_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tenants: Mapping[str, str] = field(default_factory=dict)   # tenant name -> bearer token
    lease_ttl_s: float = 30.0


@dataclass(frozen=True)
class BlocksConfig:
    block_tokens: int = 0
    hash: str = "sha256"


@dataclass(frozen=True)
class PolicyConfig:
    eviction: str = "lru"
    write: str = "write_back"
    params: Mapping[str, Any] = field(default_factory=dict)
    low_watermark: float = 0.85
    high_watermark: float = 0.95


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
class TiersConfig:
    hbm: HBMConfig = field(default_factory=HBMConfig)
    host: HostConfig = field(default_factory=HostConfig)
    nvme: NVMeConfig = field(default_factory=NVMeConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = False
    predictor: str = "quantile"
    lead_time_s: float = 0.05
    quantile: float = 0.1
    window: int = 64
    expire_factor: float = 10.0
    max_wait_s: float = 3600.0
    max_waiting: int = 65536


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


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint (kvstore/service/metrics.py); empty ``listen``: off."""

    listen: str = ""


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    blocks: BlocksConfig = field(default_factory=BlocksConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def tier_policy(self, tier: str) -> TierPolicyConfig:
        """The eviction policy of ``tier`` (its override, else ``[policy]``'s)."""
        override = getattr(self.tiers, tier).policy
        if override is not None:
            return override
        return TierPolicyConfig(self.policy.eviction, self.policy.params)


_SIZE_FIELDS = {"capacity", "max_message_bytes", "max_chunk_bytes", *REMOTE_SIZE_FIELDS}
MAX_SIZE = (1 << 63) - 1
"""Largest size any key accepts (bytes): sizes travel as uint64 in the gRPC stats."""


def _convert(path: str, name: str, value: Any, default: Any, ftype: Any) -> Any:
    key = f"{path}.{name}" if path else name
    if name in _SIZE_FIELDS:
        try:
            size = parse_size(value, name=key)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except OverflowError:   # hundreds of digits: parse_size's float becomes infinite
            raise ConfigError(f"{key}: size {value!r} is too large") from None
        if size > MAX_SIZE:
            raise ConfigError(f"{key}: size {value!r} is too large (at most {MAX_SIZE} bytes)")
        return size
    if isinstance(default, bool) or ftype in ("bool", bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        if "\x00" in value:       # paths and addresses: the OS would raise ValueError at start
            raise ConfigError(f"{key}: must not contain a NUL character")
        return value
    if name == "params":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if name == "tenants":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of tenant = \"token\" entries, got {value!r}")
        for tenant, token in value.items():
            if not isinstance(token, str):
                raise ConfigError(f"{key}.{tenant}: expected a token string, got {token!r}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported value {value!r}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key (known keys here: {known})")
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, key)
        elif name == "policy" and cls in (HBMConfig, HostConfig, NVMeConfig, RemoteConfig):
            kwargs[name] = _build(TierPolicyConfig, value, key)
        else:
            kwargs[name] = _convert(path, name, value, default, f.type)
    return cls(**kwargs)


def from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a parsed TOML table."""
    cfg = _build(Config, dict(data), "")
    server = data.get("server")
    if not (isinstance(server, dict) and "max_chunk_bytes" in server):
        # not given: 1 MiB, or what fits below a smaller max_message_bytes
        chunk = max(1, min(cfg.server.max_chunk_bytes, cfg.server.max_message_bytes - (16 << 10)))
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_chunk_bytes=chunk))
    return validate(cfg)


def loads(text: str) -> Config:
    """Parse TOML text into a validated Config. Raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config is not valid TOML: {e}") from None
    return from_dict(data)


def load(path: str | os.PathLike[str] | None) -> Config:
    """Load the config file at ``path``; ``None`` gives the built-in default.

    Raises ConfigError when the file is unreadable, not TOML, or invalid.
    """
    if path is None:
        return validate(Config())
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    return loads(text)


def replace(cfg: Config, **sections: Any) -> Config:
    """A copy of ``cfg`` with whole sections replaced, validated again."""
    return validate(dataclasses.replace(cfg, **sections))
