"""The cross-field rules of the node config: :func:`validate`, run once on every Config.

:mod:`kvstore.config` parses the TOML file into frozen dataclasses and checks each
value's type; this module checks what one value cannot say alone: ranges (workers,
TTLs, message and chunk sizes, watermarks, prefetch bounds), choices (eviction and
write policies, NVMe I/O, pinned memory), at least one enabled tier with a capacity,
readable TLS files, well-formed listen addresses and endpoints, and access rules
(printable tokens, one token per tenant, no unauthenticated TCP beyond the loopback
interface). Each failure is a :class:`kvstore.common.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvstore.common.errors import ConfigError
from kvstore.config.remote import validate_remote

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.config.node import Config, PolicyConfig, ServerConfig, TierPolicyConfig

EVICTION_CHOICES = ("lru", "arc", "s3fifo", "next_use")
WRITE_CHOICES = ("write_back", "write_through")
IO_CHOICES = ("auto", "gds", "posix")

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
    from kvstore.config.node import PolicyConfig     # at call time: kvstore.config imports this module
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
    if not 1.0 <= s.lease_ttl_s <= 600:
        raise ConfigError(f"server.lease_ttl_s: must be in [1, 600] seconds, got {s.lease_ttl_s}")
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
