"""The one place where concrete parts are built from the config: the tiers (the Mooncake
tier of ``[tiers.remote]`` included), the tier manager with its policies, and the keyword
arguments of the prefetch scheduler and the session table.

:mod:`kvstore.service.startup` starts the daemon from these; ``kvstore simulate``
(:mod:`kvstore.tools.simulate`) takes the scheduler's and the session table's arguments
from here too, so a key means the same in both. The config itself (:mod:`kvstore.config`)
knows nothing of the parts.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from tiers.base import Tier, TierKind
from tiers.errors import MediaError

from kvstore.cluster.cluster import ClusterOptions
from kvstore.common.errors import ConfigError
from kvstore.common.units import format_size
from kvstore.config.node import Config, PrefetchConfig, RemoteConfig, SessionsConfig
from kvstore.policy import make_policy
from kvstore.store.manager import TierManager

log = logging.getLogger("kvstore.service.build")

SETUP_HINT = "run scripts/setup-mooncake.sh (installs libibverbs1 and the Mooncake wheel)"


def gpu_available() -> bool:
    """Whether a CUDA GPU can be used (detected once, in :mod:`tiers.gpu`)."""
    try:
        from tiers.gpu import gpu_available as detect
    except ImportError:
        return False
    return bool(detect())


def close_all(named: list[tuple[str, Tier]]) -> None:
    """Close every tier of ``(config_name, tier)`` pairs."""
    for _, tier in named:
        tier.close()


def build_remote_tier(r: RemoteConfig) -> Tier:
    """The remote tier of ``[tiers.remote]``. Returns at once: the session with the
    master is made in the background, so a master that is down never delays start-up
    (the tier answers "unavailable" until it connects).

    Raises ConfigError when the client library cannot load (naming the missing package
    and the setup script) or a setting is refused.
    """
    from tiers.mooncake.client import MooncakeConfig, MooncakeUnavailable
    from tiers.mooncake.tier import MooncakeTier

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


def cluster_options(r: RemoteConfig) -> ClusterOptions | None:
    """How the core uses the remote tier (None when ``[tiers.remote]`` is off)."""
    if not r.enabled:
        return None
    return ClusterOptions(publish=r.publish, lookup_timeout_s=r.lookup_timeout_s,
                          publish_backlog=r.publish_backlog, chunk_bytes=r.page_in_chunk)


def check_host_memory(capacity: int) -> None:
    """A host tier's arena is populated when it is made: refuse one larger than the memory
    this machine (or its cgroup) has in all, which got the daemon or a process beside it
    killed by the kernel's out-of-memory killer instead of a message (ConfigError), and
    warn of one larger than what is available now (it may still fit: a stopped daemon's
    arena that a client has not unmapped yet is freed when the client lets go)."""
    from tiers.memory import memory_limits
    limits = memory_limits()
    if limits is None:
        return
    total, available = limits
    if capacity > total:
        raise ConfigError(f"tiers.host.capacity: {format_size(capacity)} of host memory asked, but this machine "
                          f"has {format_size(total)} in all; lower it")
    if capacity > available:
        log.warning("tiers.host.capacity: %s of host memory asked and %s available now: the arena is populated "
                    "at start, so the kernel may kill this daemon or a process beside it; lower it or free memory "
                    "(a client still mapping a stopped daemon's arena holds that memory until it lets go)",
                    format_size(capacity), format_size(available))


def build_tiers(cfg: Config) -> list[tuple[str, Tier]]:
    """Concrete tiers from the config, fastest first, as ``(config_name, tier)`` pairs.

    Raises ConfigError when a configured tier cannot be built (e.g. HBM without a GPU).
    """
    t = cfg.tiers
    out: list[tuple[str, Tier]] = []
    has_gpu = gpu_available()
    try:
        if t.hbm.enabled:
            if not has_gpu:
                raise ConfigError("tiers.hbm.enabled: no CUDA GPU found; disable the HBM tier on this machine")
            from tiers.hbm import HBMTier
            out.append(("hbm", HBMTier(t.hbm.capacity, device=t.hbm.device)))
        if t.host.enabled:
            from tiers.host import HostTier
            pinned = {"auto": has_gpu, "true": True, "false": False}[t.host.pinned]
            if pinned and not has_gpu:
                raise ConfigError("tiers.host.pinned = true needs a CUDA GPU")
            check_host_memory(t.host.capacity)
            try:
                out.append(("host", HostTier(t.host.capacity, pinned=pinned, shared=t.host.shared,
                                             huge_pages=t.host.huge_pages, block_table=t.host.block_table)))
            except (MemoryError, OSError) as e:
                raise ConfigError(f"tiers.host.capacity: cannot allocate {format_size(t.host.capacity)} of host "
                                  f"memory ({e}); lower it") from None
        if t.nvme.enabled:
            from tiers.nvme.tier import NVMeTier
            folder = pathlib.Path(t.nvme.path)
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"tiers.nvme.path: {t.nvme.path!r} is a file, not a folder: give the folder "
                                  f"the NVMe tier keeps its blocks in")
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"tiers.nvme.path: cannot create {t.nvme.path!r}: {e.strerror}") from None
            try:
                out.append(("nvme", NVMeTier(t.nvme.path, t.nvme.capacity, io=t.nvme.io, fsync=t.nvme.fsync)))
            except (ValueError, NotImplementedError, OSError, MediaError) as e:
                raise ConfigError(f"tiers.nvme: {e}") from None
        if t.remote.enabled:       # the cluster, last; returns at once even with the master down
            out.append(("remote", build_remote_tier(t.remote)))
    except BaseException:
        close_all(out)
        raise
    return out


def build_manager(cfg: Config, named: list[tuple[str, Tier]] | None = None) -> TierManager:
    """The daemon's tier manager: the configured tiers (``named``, or :func:`build_tiers`),
    each tier's eviction policy, ``[policy]`` and ``[store]``, the cluster's options.

    Raises ConfigError for a policy parameter the policy refuses (the tiers are closed).
    """
    named = build_tiers(cfg) if named is None else named
    policies = []
    for name, tier in named:
        pc = cfg.tier_policy(name)
        try:
            policies.append(make_policy(pc.eviction, tier.capacity_bytes, pc.params, tier_name=name))
        except ConfigError as e:
            key = f"tiers.{name}.policy" if getattr(cfg.tiers, name).policy is not None else "policy"
            close_all(named)
            raise ConfigError(f"{key}.params: {e}") from None
    p, st = cfg.policy, cfg.store
    return TierManager([t for _, t in named], policies, write_policy=p.write, async_moves=True,
                       promote_on_get=p.promote_on_get, writer_wait_s=st.writer_wait_s,
                       transfer_timeout_s=st.transfer_timeout_s, watermarks=(p.low_watermark, p.high_watermark),
                       cluster=cluster_options(cfg.tiers.remote))


def hop_bandwidth(p: PrefetchConfig) -> dict[tuple[TierKind, TierKind], float]:
    """``[prefetch.hop_bandwidth]`` keyed as the scheduler wants: (source, destination) kind
    -> bytes per second."""
    out = {}
    for hop, rate in p.hop_bandwidth.items():
        src, _, dst = hop.partition(":")
        out[(TierKind[src.upper()], TierKind[dst.upper()])] = float(rate)
    return out


def prefetch_options(p: PrefetchConfig) -> dict[str, Any]:
    """The keyword arguments of :class:`kvstore.agent.prefetch.PrefetchScheduler` that
    ``[prefetch]`` sets besides the section itself (every one a key of the same name)."""
    return dict(hop_bandwidth=hop_bandwidth(p), measure_bandwidth=p.measure_bandwidth,
                headroom_fraction=p.headroom_fraction, active_protect_s=p.active_protect_s, poll_s=p.poll_s,
                refresh_s=p.refresh_s, retry_s=p.retry_s, margin_s=p.margin_s, dedupe_s=p.dedupe_s,
                victim_margin=p.victim_margin, repromote=p.repromote, protect_s=p.protect_s,
                confidence=p.confidence, horizon_s=p.horizon_s, exclusive_after_s=p.exclusive_after_s)


def session_options(s: SessionsConfig) -> dict[str, Any]:
    """The keyword arguments of :class:`kvstore.agent.sessions.SessionTable` from ``[sessions]``."""
    return dict(calibrate=s.calibrate, default_gap_s=s.default_gap_s, window=s.window,
                max_sessions=s.max_sessions, max_keys=s.max_keys)


__all__ = ["SETUP_HINT", "build_manager", "build_remote_tier", "build_tiers", "close_all", "cluster_options",
           "gpu_available", "hop_bandwidth", "prefetch_options", "session_options"]
