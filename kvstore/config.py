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
    alice = "token-of-alice"      # each tenant gets a private key space (kvstore/auth.py)

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
    enabled = false               # (the keys: kvstore/remote_config.py, docs/remote_tier.md)
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

Unknown keys and bad values raise :class:`kvstore.errors.ConfigError` naming the key,
e.g. ``tiers.host.capcity: unknown key``.
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

from .errors import ConfigError
from .remote_config import REMOTE_SIZE_FIELDS, RemoteConfig, validate_remote
from .units import parse_size

EVICTION_CHOICES = ("lru", "arc", "s3fifo", "next_use")
WRITE_CHOICES = ("write_back", "write_through")
IO_CHOICES = ("auto", "gds", "posix")


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
    """``[events]``: KV events for cache-aware routers (kvstore/events.py)."""

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
    """``[metrics]``: the Prometheus endpoint (kvstore/metrics.py); empty ``listen``: off."""

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


_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def _is_loopback(listen: str) -> bool:
    """True for a TCP ``host:port`` on the loopback interface."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def _check_token(key: str, token: str) -> None:
    # gRPC metadata values are printable ASCII; a token with spaces or other bytes
    # could never be sent, so every call would be refused.
    if not token or not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{key}: a token must be non-empty printable ASCII without spaces")


def _validate_access(s: ServerConfig) -> None:
    """Tokens, tenants, and no unauthenticated TCP beyond the loopback interface."""
    if s.auth_token:
        _check_token("server.auth_token", s.auth_token)
    if s.tenants:
        if s.auth_token:
            raise ConfigError("server.tenants: cannot be combined with server.auth_token (a caller of the "
                              "shared key space could compute tenants' keys); give each client a tenant")
        seen: dict[str, str] = {}
        for tenant, token in s.tenants.items():
            if not tenant or not tenant.isprintable():
                raise ConfigError(f"server.tenants: tenant name {tenant!r} must be non-empty and printable")
            _check_token(f"server.tenants.{tenant}", token)
            if token in seen:
                raise ConfigError(f"server.tenants.{tenant}: same token as tenant {seen[token]!r}; "
                                  "every tenant needs its own token")
            seen[token] = tenant
    if not s.listen.startswith("unix:"):
        host, sep, port = s.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"server.listen: {s.listen!r} is not 'unix:PATH' or 'HOST:PORT' "
                              "with a port in 0..65535")
    if not s.listen.startswith("unix:") and not _is_loopback(s.listen) and not (s.auth_token or s.tenants):
        raise ConfigError(f"server.listen: {s.listen!r} is reachable from other machines; set "
                          "server.auth_token or server.tenants, or listen on a unix socket or loopback")


def _validate_policy(p: PolicyConfig | TierPolicyConfig, path: str) -> None:
    if p.eviction not in EVICTION_CHOICES:
        raise ConfigError(f"{path}.eviction: {p.eviction!r} is not one of {', '.join(EVICTION_CHOICES)}")
    if isinstance(p, PolicyConfig):
        if p.write not in WRITE_CHOICES:
            raise ConfigError(f"{path}.write: {p.write!r} is not one of {', '.join(WRITE_CHOICES)}")
        if not 0.0 < p.low_watermark <= p.high_watermark <= 1.0:
            raise ConfigError(f"{path}.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                              f"{p.low_watermark} and {p.high_watermark}")


def validate(cfg: Config) -> Config:
    """Check cross-field rules; raise ConfigError naming the key. Returns ``cfg``."""
    s = cfg.server
    if not s.listen or s.listen.startswith("unix:") and not s.listen[len("unix:"):].strip("/"):
        raise ConfigError(f"server.listen: {s.listen!r} names no address or socket path")
    if s.workers < 1:
        raise ConfigError(f"server.workers: must be >= 1, got {s.workers}")
    if not 0 < s.lease_ttl_s <= 600:
        raise ConfigError(f"server.lease_ttl_s: must be in (0, 600] seconds, got {s.lease_ttl_s}")
    if not 0 < s.stream_idle_timeout_s < float("inf"):
        raise ConfigError(f"server.stream_idle_timeout_s: must be > 0 seconds, got {s.stream_idle_timeout_s}")
    if s.max_message_bytes < 64 << 10:
        raise ConfigError(f"server.max_message_bytes: must be >= 64KiB, got {s.max_message_bytes}")
    if not 0 < s.max_chunk_bytes <= s.max_message_bytes - (16 << 10):
        raise ConfigError("server.max_chunk_bytes: must be > 0 and at least 16KiB below server.max_message_bytes")
    _validate_access(s)
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("server.tls_cert/server.tls_key: set both or neither")
    for name in ("tls_cert", "tls_key"):
        value = getattr(s, name)
        if value and not os.access(value, os.R_OK):
            raise ConfigError(f"server.{name}: cannot read {value!r}")
    if not 0 <= cfg.blocks.block_tokens <= 1 << 20:
        raise ConfigError(f"blocks.block_tokens: must be in [1, 1048576] (0: not set), got {cfg.blocks.block_tokens}")
    if cfg.blocks.hash != "sha256":
        raise ConfigError(f"blocks.hash: {cfg.blocks.hash!r} is not supported (keys are chained SHA-256: "
                          "\"sha256\")")
    t = cfg.tiers
    if t.host.pinned not in ("auto", "true", "false"):
        raise ConfigError(f"tiers.host.pinned: {t.host.pinned!r} is not one of auto, true, false")
    if t.nvme.io not in IO_CHOICES:
        raise ConfigError(f"tiers.nvme.io: {t.nvme.io!r} is not one of {', '.join(IO_CHOICES)}")
    if t.nvme.enabled and not t.nvme.path:
        raise ConfigError("tiers.nvme.path: must be set when the NVMe tier is enabled")
    if t.hbm.device < 0:
        raise ConfigError(f"tiers.hbm.device: must be >= 0, got {t.hbm.device}")
    enabled = [n for n in ("hbm", "host", "nvme") if getattr(t, n).enabled]
    if not enabled:
        raise ConfigError("tiers: at least one tier must be enabled")
    for n in enabled:
        if getattr(t, n).capacity <= 0:
            raise ConfigError(f"tiers.{n}.capacity: must be > 0 for an enabled tier")
    _validate_policy(cfg.policy, "policy")
    validate_remote(t.remote)
    for n in ("hbm", "host", "nvme", "remote"):
        override = getattr(t, n).policy
        if override is not None:
            _validate_policy(override, f"tiers.{n}.policy")
    ev = cfg.events
    for name in ("buffer_steps", "hwm", "max_queue"):
        if getattr(ev, name) < 1:
            raise ConfigError(f"events.{name}: must be >= 1, got {getattr(ev, name)}")
    if not 0 <= ev.batch_ms <= 10_000:
        raise ConfigError(f"events.batch_ms: must be in [0, 10000] ms, got {ev.batch_ms}")
    if ev.enabled and not ev.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"events.endpoint: {ev.endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    if cfg.metrics.listen:
        host, sep, port = cfg.metrics.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"metrics.listen: {cfg.metrics.listen!r} is not HOST:PORT")
    p = cfg.prefetch
    if not 0.0 < p.quantile < 1.0:
        raise ConfigError(f"prefetch.quantile: must be in (0, 1), got {p.quantile}")
    if p.lead_time_s < 0:
        raise ConfigError(f"prefetch.lead_time_s: must be >= 0, got {p.lead_time_s}")
    if p.window < 1:
        raise ConfigError(f"prefetch.window: must be >= 1, got {p.window}")
    if not 1.0 <= p.expire_factor <= 1e6:
        raise ConfigError(f"prefetch.expire_factor: must be in [1, 1e6], got {p.expire_factor}")
    if not 0.0 < p.max_wait_s <= 7 * 24 * 3600:
        raise ConfigError(f"prefetch.max_wait_s: must be in (0, 604800] seconds, got {p.max_wait_s}")
    if not 1 <= p.max_waiting <= 1 << 24:
        raise ConfigError(f"prefetch.max_waiting: must be in [1, 16777216], got {p.max_waiting}")
    return cfg


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
