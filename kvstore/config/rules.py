"""The rules of the node config: :func:`validate`, run once on every :class:`~kvstore.config.node.Config`.

:mod:`kvstore.config.load` parses the TOML file into the frozen dataclasses of
:mod:`kvstore.config.node` and checks each value's type; this module checks the rest, for
every table including ``[tiers.remote]``: ranges (workers, TTLs, message and chunk sizes,
watermarks, deadlines, the prefetch scheduler's and the session table's bounds), choices
(eviction and write policies, NVMe I/O, pinned memory, the cluster's kind, protocol and
publish rule), at least one enabled tier, each tier's capacity at least
:data:`MIN_TIER_BYTES`, every eviction policy's ``params`` (the policy is built once here,
before any tier is opened), readable TLS files, well-formed listen addresses and
endpoints, deadlines in the order that makes the right error win (a put's wait for another
writer ends before its stream counts as idle), and access rules (printable tokens of at
least :data:`MIN_TOKEN_CHARS` characters, one token per tenant, no unauthenticated TCP
beyond the loopback interface). Each failure is a :class:`kvstore.common.errors.ConfigError`
naming the key.
"""

from __future__ import annotations

import math
import os

from kvstore.common.errors import ConfigError
from kvstore.common.units import format_size
from kvstore.config.node import (EVICTION_CHOICES, HOP_TIERS, HUGE_PAGES_CHOICES, IO_CHOICES, PINNED_CHOICES,
                                 PREDICTOR_CHOICES,
                                 PROTOCOL_CHOICES, PUBLISH_CHOICES, REMOTE_KINDS, WRITE_CHOICES, Config, PolicyConfig,
                                 PrefetchConfig, RemoteConfig, ServerConfig, TierPolicyConfig)

_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
MIN_SEGMENT_BYTES = 16 << 20
"""Smallest memory segment Mooncake accepts (``[tiers.remote] segment``, bytes)."""
MIN_TIER_BYTES = 1 << 20
"""Smallest capacity of any tier (``[tiers.X] capacity``, bytes): less holds no useful
block and is a unit slip (``capacity = 5`` is 5 bytes)."""
MIN_TOKEN_CHARS = 16
"""Shortest bearer token (``[server] auth_token``, each ``[server.tenants]`` token): a shorter
one could be guessed."""
_HOUR_S = 3600.0
_DAY_S = 24 * _HOUR_S
_WEEK_S = 7 * _DAY_S


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _within(key: str, value: float, low: float, high: float, *, open_low: bool = False,
            open_high: bool = False, unit: str = "") -> None:
    """Raise ConfigError naming ``key`` unless ``value`` lies in the interval (ends open as asked)."""
    if (low < value if open_low else low <= value) and (value < high if open_high else value <= high):
        return
    interval = f"{'(' if open_low else '['}{_show(low)}, {_show(high)}{')' if open_high else ']'}"
    raise ConfigError(f"{key}: must be in {interval}{unit}, got {value}")


def _is_loopback(listen: str) -> bool:
    """True for a TCP ``host:port`` on the loopback interface."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def _check_token(key: str, token: str) -> None:
    # gRPC metadata values are printable ASCII; a token with spaces or other bytes
    # could never be sent, so every call would be refused.
    if not token or not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{key}: a token must be non-empty printable ASCII without spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{key}: the token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are "
                          "needed (e.g. `openssl rand -hex 16`)")


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


def _validate_server(s: ServerConfig) -> None:
    if not s.listen or s.listen.startswith("unix:") and not s.listen[len("unix:"):].strip("/"):
        raise ConfigError(f"server.listen: {s.listen!r} names no address or socket path")
    if s.workers < 2:
        raise ConfigError(f"server.workers: must be >= 2 (streaming calls and unary calls each need a thread), "
                          f"got {s.workers}")
    if s.max_streams:
        _within("server.max_streams", s.max_streams, 1, s.workers - 1,
                unit=" (0: automatic; below server.workers, so unary calls keep a thread)")
    if not 1.0 <= s.lease_ttl_s <= 600:
        raise ConfigError(f"server.lease_ttl_s: must be in [1, 600] seconds, got {s.lease_ttl_s}")
    if not 0 < s.stream_idle_timeout_s < float("inf"):
        raise ConfigError(f"server.stream_idle_timeout_s: must be > 0 seconds, got {s.stream_idle_timeout_s}")
    _within("server.stream_first_message_s", s.stream_first_message_s, 0, _HOUR_S, open_low=True, unit=" seconds")
    _within("server.stream_timeout_s", s.stream_timeout_s, 0, _DAY_S, open_low=True, unit=" seconds")
    if not 64 << 10 <= s.max_message_bytes < 1 << 31:      # gRPC takes a signed 32-bit limit
        raise ConfigError(f"server.max_message_bytes: must be in [64KiB, 2GiB) (gRPC's limit is a signed "
                          f"32-bit count), got {s.max_message_bytes}")
    if not 0 < s.max_chunk_bytes <= s.max_message_bytes - (16 << 10):
        raise ConfigError("server.max_chunk_bytes: must be > 0 and at least 16KiB below server.max_message_bytes")
    _validate_access(s)
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("server.tls_cert/server.tls_key: set both or neither")
    for name in ("tls_cert", "tls_key"):
        value = getattr(s, name)
        if value and not os.access(value, os.R_OK):
            raise ConfigError(f"server.{name}: cannot read {value!r}")
    _within("server.stop_grace_s", s.stop_grace_s, 0, _HOUR_S, unit=" seconds")
    _within("server.eviction_log_blocks", s.eviction_log_blocks, 1, 1 << 26)


def _fail_remote(key: str, why: str) -> None:
    raise ConfigError(f"tiers.remote.{key}: {why}")


def _validate_remote(r: RemoteConfig) -> None:
    """``[tiers.remote]`` (checked whether or not it is enabled)."""
    if r.kind not in REMOTE_KINDS:
        _fail_remote("kind", f"{r.kind!r} is not one of {', '.join(REMOTE_KINDS)}")
    if r.protocol not in PROTOCOL_CHOICES:
        _fail_remote("protocol", f"{r.protocol!r} is not one of {', '.join(PROTOCOL_CHOICES)}")
    if r.publish not in PUBLISH_CHOICES:
        _fail_remote("publish", f"{r.publish!r} is not one of {', '.join(PUBLISH_CHOICES)}")
    host, sep, port = r.master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        _fail_remote("master", f"{r.master!r} is not HOST:PORT")
    for key in ("metadata_server", "local_hostname", "prefix"):
        if not getattr(r, key):
            _fail_remote(key, "must not be empty")
    if r.capacity < MIN_TIER_BYTES:
        _fail_remote("capacity", f"must be at least {format_size(MIN_TIER_BYTES)}, got {r.capacity} bytes")
    segment = r.capacity if r.segment is None else r.segment
    if segment != 0 and segment < MIN_SEGMENT_BYTES:
        _fail_remote("segment", f"must be 0 (a pure client) or at least 16MiB (Mooncake refuses less), got "
                                f"{segment} bytes" + (" (it defaults to capacity)" if r.segment is None else ""))
    if r.staging < (1 << 20):
        _fail_remote("staging", f"must be at least 1MiB, got {r.staging}")
    if r.replicas < 1:
        _fail_remote("replicas", f"must be >= 1, got {r.replicas}")
    for key in ("timeout_s", "lookup_timeout_s"):
        value = getattr(r, key)
        if not 0 < value < math.inf:
            _fail_remote(key, f"must be > 0 seconds, got {value}")
    if not 0 <= r.cooldown_s < math.inf:
        _fail_remote("cooldown_s", f"must be >= 0 seconds, got {r.cooldown_s}")
    if r.min_throughput <= 0:
        _fail_remote("min_throughput", f"must be > 0 bytes per second, got {r.min_throughput}")
    for key in ("failure_threshold", "max_in_flight"):
        if getattr(r, key) < 1:
            _fail_remote(key, f"must be >= 1, got {getattr(r, key)}")
    _within("tiers.remote.publish_backlog", r.publish_backlog, 1, 1 << 24)


def _validate_tiers(cfg: Config) -> None:
    t = cfg.tiers
    if t.host.pinned not in PINNED_CHOICES:
        raise ConfigError(f"tiers.host.pinned: {t.host.pinned!r} is not one of {', '.join(PINNED_CHOICES)}")
    if t.host.huge_pages not in HUGE_PAGES_CHOICES:
        raise ConfigError(f"tiers.host.huge_pages: {t.host.huge_pages!r} is not one of "
                          f"{', '.join(HUGE_PAGES_CHOICES)}")
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
        if getattr(t, n).capacity < MIN_TIER_BYTES:
            raise ConfigError(f"tiers.{n}.capacity: must be at least {format_size(MIN_TIER_BYTES)}, got "
                              f"{getattr(t, n).capacity} bytes (sizes take units: \"64GiB\")")
    _validate_policy(cfg.policy, "policy")
    _validate_remote(t.remote)
    for n in ("hbm", "host", "nvme", "remote"):
        override = getattr(t, n).policy
        if override is not None:
            _validate_policy(override, f"tiers.{n}.policy")
    for n in ("hbm", "host", "nvme", "remote"):
        tier = getattr(t, n)
        if tier.enabled:
            _validate_params(cfg.tier_policy(n), "policy" if tier.policy is None else f"tiers.{n}.policy",
                             n, tier.capacity)


def _validate_params(p: TierPolicyConfig, path: str, tier: str, capacity: int) -> None:
    """Build the eviction policy once, as :mod:`kvstore.service.build` will (no tier is
    opened): a parameter it refuses is a ConfigError naming ``path.params``."""
    from kvstore.policy import make_policy
    try:
        make_policy(p.eviction, capacity, p.params, tier_name=tier)
    except ConfigError as e:
        raise ConfigError(f"{path}.params: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}.params: {p.eviction}: {e}") from None


def _validate_prefetch(p: PrefetchConfig) -> None:
    if p.predictor not in PREDICTOR_CHOICES:
        raise ConfigError(f"prefetch.predictor: unknown predictor {p.predictor!r} (known: "
                          f"{', '.join(PREDICTOR_CHOICES)})")
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
    for hop, rate in p.hop_bandwidth.items():
        src, sep, dst = hop.partition(":")
        if not sep or src not in HOP_TIERS or dst not in HOP_TIERS or src == dst:
            raise ConfigError(f"prefetch.hop_bandwidth.{hop}: not a hop 'SRC:DST' between two of "
                              f"{', '.join(HOP_TIERS)}")
        if rate <= 0:
            raise ConfigError(f"prefetch.hop_bandwidth.{hop}: must be > 0 bytes per second, got {rate}")
    _within("prefetch.headroom_fraction", p.headroom_fraction, 0, 1, open_high=True)
    _within("prefetch.poll_s", p.poll_s, 0, 60, open_low=True, unit=" seconds")
    for name in ("refresh_s", "retry_s"):
        _within(f"prefetch.{name}", getattr(p, name), 0, _DAY_S, open_low=True, unit=" seconds")
    _within("prefetch.horizon_s", p.horizon_s, 0, _WEEK_S, open_low=True, unit=" seconds")
    for name in ("active_protect_s", "margin_s", "protect_s"):
        _within(f"prefetch.{name}", getattr(p, name), 0, _WEEK_S, unit=" seconds")
    _within("prefetch.dedupe_s", p.dedupe_s, 0, _HOUR_S, unit=" seconds")
    _within("prefetch.victim_margin", p.victim_margin, 0, 1e6)
    _within("prefetch.exclusive_after_s", p.exclusive_after_s, 0, 1e6)
    _within("prefetch.confidence", p.confidence, 0, 1)


def _validate_services(cfg: Config) -> None:
    """``[events]``, ``[metrics]``, ``[health]``."""
    ev = cfg.events
    for name in ("buffer_steps", "hwm", "max_queue"):
        if getattr(ev, name) < 1:
            raise ConfigError(f"events.{name}: must be >= 1, got {getattr(ev, name)}")
    if not 0 <= ev.batch_ms <= 10_000:
        raise ConfigError(f"events.batch_ms: must be in [0, 10000] ms, got {ev.batch_ms}")
    _within("events.snapshot_interval_s", ev.snapshot_interval_s, 0, _DAY_S, unit=" seconds")
    if ev.enabled and not ev.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"events.endpoint: {ev.endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    if cfg.metrics.listen:
        host, sep, port = cfg.metrics.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"metrics.listen: {cfg.metrics.listen!r} is not HOST:PORT")
    _within("health.period_s", cfg.health.period_s, 0, _HOUR_S, open_low=True, unit=" seconds")
    _within("health.window_s", cfg.health.window_s, 0, _DAY_S, unit=" seconds")


_ANY_HOST = {"", "*", "0.0.0.0", "::", "[::]"}
_LOOPBACK_NAMES = {"localhost": "127.0.0.1", "[::1]": "::1"}


def _tcp_ports(cfg: Config) -> list[tuple[str, str, int]]:
    """The daemon's own TCP listen addresses as ``(key, host, port)``; port 0 (any free
    port) left out."""
    found = []
    candidates = [("server.listen", "" if cfg.server.listen.startswith("unix:") else cfg.server.listen),
                  ("metrics.listen", cfg.metrics.listen)]
    if cfg.events.enabled:
        candidates += [(f"events.{k}", e[len("tcp://"):]) for k, e in
                       (("endpoint", cfg.events.endpoint), ("replay_endpoint", cfg.events.replay_endpoint))
                       if e.startswith("tcp://")]
    for key, address in candidates:
        host, sep, port = address.rpartition(":")
        if sep and port.isdigit() and int(port):
            host = host.lower()
            found.append((key, _LOOPBACK_NAMES.get(host, host), int(port)))
    return found


def _validate_ports(cfg: Config) -> None:
    """Two of the daemon's own listen addresses on one port (a host one of them also
    covers) is refused here, naming both keys: at bind time the second looked like another
    daemon's."""
    seen: list[tuple[str, str, int]] = []
    for key, host, port in _tcp_ports(cfg):
        for other, other_host, other_port in seen:
            if port == other_port and (host == other_host or host in _ANY_HOST or other_host in _ANY_HOST):
                raise ConfigError(f"{key}: port {port} is {other}'s too: give each listen address its own port")
        seen.append((key, host, port))


def validate(cfg: Config) -> Config:
    """Check every rule above; raise ConfigError naming the key. Returns ``cfg``."""
    _validate_server(cfg.server)
    if not 0 <= cfg.blocks.block_tokens <= 1 << 20:
        raise ConfigError(f"blocks.block_tokens: must be in [1, 1048576] (0: not set), got {cfg.blocks.block_tokens}")
    if cfg.blocks.hash != "sha256":
        raise ConfigError(f"blocks.hash: {cfg.blocks.hash!r} is not supported (keys are chained SHA-256: "
                          "\"sha256\")")
    _validate_tiers(cfg)
    st = cfg.store
    for name in ("writer_wait_s", "transfer_timeout_s"):
        _within(f"store.{name}", getattr(st, name), 0, _DAY_S, open_low=True, unit=" seconds")
    if st.writer_wait_s >= cfg.server.stream_idle_timeout_s:
        raise ConfigError(f"store.writer_wait_s: must be below server.stream_idle_timeout_s "
                          f"({_show(cfg.server.stream_idle_timeout_s)} s), got {_show(st.writer_wait_s)}: a put "
                          "waiting for another writer would be cancelled as idle instead of told WriteConflict")
    _within("store.stop_persist_s", st.stop_persist_s, 0, _DAY_S, unit=" seconds")
    _validate_services(cfg)
    _validate_ports(cfg)
    _validate_prefetch(cfg.prefetch)
    for i, endpoint in enumerate(cfg.engines.kv_events):
        if not endpoint.startswith(ENGINE_EVENT_SCHEMES) or endpoint.partition("://")[2] == "":
            raise ConfigError(f"engines.kv_events[{i}]: {endpoint!r} is not a ZMQ endpoint "
                              f"({', '.join(s + '...' for s in ENGINE_EVENT_SCHEMES)})")
    if len(set(cfg.engines.kv_events)) != len(cfg.engines.kv_events):
        raise ConfigError("engines.kv_events: an endpoint is listed twice")
    se = cfg.sessions
    _within("sessions.default_gap_s", se.default_gap_s, 0, _WEEK_S, open_low=True, unit=" seconds")
    _within("sessions.window", se.window, 1, 1 << 20)
    _within("sessions.max_sessions", se.max_sessions, 1, 1 << 26)
    _within("sessions.max_keys", se.max_keys, 1, 1 << 32)
    return cfg


ENGINE_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")
"""The ZMQ transports an engine's KV event publisher may be reached by."""

__all__ = ["ENGINE_EVENT_SCHEMES", "MIN_SEGMENT_BYTES", "MIN_TIER_BYTES", "MIN_TOKEN_CHARS", "validate"]
