"""Mooncake Store client plumbing for the remote tier: configuration, loading the
library, its error codes, its own timeouts, and making one client session.

Mooncake (kvcache-ai/Mooncake, Apache-2.0) is used through its Python wheel
``mooncake-transfer-engine-non-cuda`` (``mooncake.store.MooncakeDistributedStore``),
which needs the system library ``libibverbs.so.1`` (Debian: ``libibverbs1``) even for
TCP. What we measured of its behaviour is in ``docs/remote_tier.md``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from tiers.errors import MediaIOError
from tiers.mooncake.guard import RemoteUnavailable

log = logging.getLogger("kvstore.tiers.remote")

# Mooncake Store error codes we act on (mooncake-store/include/types.h, ErrorCode).
NO_AVAILABLE_HANDLE = -200        # no space in any segment of the cluster
INVALID_PARAMS = -600             # e.g. the buffer is smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800              # the peer holding the replica did not answer
RPC_FAIL = -900                   # the master is unreachable
RPC_TIMEOUT = -901                # the master did not answer within MC_RPC_TIMEOUT_MS
MASTER_DOWN = frozenset({RPC_FAIL, RPC_TIMEOUT})

_CODE_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", INVALID_PARAMS: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
    -703: "REPLICA_IS_NOT_READY", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT",
}

MIN_SEGMENT_BYTES = 16 << 20
"""Smallest segment Mooncake accepts (setup fails with INVALID_PARAMS below it)."""

WHEEL = "mooncake-transfer-engine-non-cuda"
WHEEL_VERSION = "0.3.13.post1"


def code_name(rc: int) -> str:
    """``"NAME (rc)"`` for a Mooncake error code."""
    return f"{_CODE_NAMES.get(rc, 'ERROR')} ({rc})"


# Judges of call results for :meth:`tiers.mooncake.guard.CallGuard.call`: the error text
# when a result means "the cluster is unavailable" (a failure for the circuit breaker),
# None when it is an answer.

def master_down(rc: int) -> str | None:
    """A single call's code: the master is unreachable."""
    return f"master unreachable: {code_name(rc)}" if rc in MASTER_DOWN else None


def all_master_down(rcs: list[int]) -> str | None:
    """A batch call's codes: every one says the master is unreachable."""
    return f"master unreachable: {code_name(rcs[0])}" if rcs and all(rc in MASTER_DOWN for rc in rcs) else None


def any_error(rcs: list[int]) -> str | None:
    """``batch_is_exist`` codes: any one of them an error."""
    bad = [rc for rc in rcs if rc < 0]
    return f"existence check failed: {code_name(bad[0])}" if bad else None


class MooncakeUnavailable(MediaIOError):
    """The Mooncake client library cannot be loaded on this machine (the reason says
    which package is missing)."""


def mooncake_missing() -> str | None:
    """Why the Mooncake client cannot be used here, or None when it can.

    Tells apart a missing wheel from a missing ``libibverbs1`` (the wheel's native
    modules link ``libibverbs.so.1`` even for TCP).
    """
    if importlib.util.find_spec("mooncake") is None:
        return f"the Mooncake wheel is not installed (pip install {WHEEL}=={WHEEL_VERSION})"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if "libibverbs" in str(exc):
            return f"libibverbs1 is missing (apt-get install -y libibverbs1): {exc}"
        return f"the Mooncake wheel does not load: {exc}"
    return None


def store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``. Raises MooncakeUnavailable."""
    reason = mooncake_missing()
    if reason:
        raise MooncakeUnavailable(reason)
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore


@dataclass(frozen=True)
class MooncakeConfig:
    """Settings of the Mooncake remote tier (the ``[tiers.remote]`` section, parsed).

    Attributes:
        master: the master's RPC address, ``host:port``.
        metadata_server: the Transfer Engine metadata service: ``http://host:port/metadata``
            (the master's built-in one with ``-enable_http_metadata_server``), an etcd
            address, or ``P2PHANDSHAKE``.
        local_hostname: this node's address as peers reach it (``host`` or ``host:port``).
        protocol: ``"tcp"`` or ``"rdma"``.
        rdma_devices: RDMA NICs for ``"rdma"`` (comma-separated), '' for auto.
        capacity_bytes: bytes of blocks this node may hold in the cluster (headers
            included); the tier's capacity.
        segment_bytes: memory this node mounts into the cluster's pool (None: as much
            as ``capacity_bytes``; 0: none, a pure client; else at least 16 MiB).
        staging_bytes: the registered host buffer every transfer goes through; bounds
            the tier's own memory and the largest block.
        local_buffer_bytes: the library's own transfer buffer (unused by our calls).
        prefix: prepended to object names (``prefix + key hex``), to share a cluster
            with other users.
        tenant: Mooncake tenant id.
        replicas: replicas of each block in the cluster.
        prefer_local_segment: place new blocks in this node's segment when it has room.
        timeout_s: deadline of one metadata call, and the base of a transfer's deadline.
        min_throughput: bytes per second a transfer is allowed at least: a transfer of
            ``n`` bytes gets ``timeout_s + n / min_throughput`` seconds.
        failure_threshold: consecutive failures that open the circuit breaker.
        cooldown_s: seconds the breaker stays open before one probe call.
        max_in_flight: concurrent calls into the library (abandoned ones included).
        reconnect_max_s: longest wait between attempts to (re)connect at start.
        set_library_timeouts: also set the library's own timeouts from ``timeout_s``
            (``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``,
            ``MC_TCP_PROGRESS_TIMEOUT_SEC``) unless already set in the environment.
            They are process-wide and read at the first session.
    """

    master: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    capacity_bytes: int = 4 << 30
    segment_bytes: int | None = None
    staging_bytes: int = 64 << 20
    local_buffer_bytes: int = 16 << 20
    prefix: str = "kvstore/"
    tenant: str = "default"
    replicas: int = 1
    prefer_local_segment: bool = False
    timeout_s: float = 2.0
    min_throughput: float = 256 << 20
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_in_flight: int = 8
    reconnect_max_s: float = 30.0
    set_library_timeouts: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not _host_port(self.master):
            problems.append(f"master must be host:port, got {self.master!r}")
        if not self.metadata_server:
            problems.append("metadata_server is required")
        if self.protocol not in ("tcp", "rdma"):
            problems.append(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        segment = self.capacity_bytes if self.segment_bytes is None else self.segment_bytes
        if segment != 0 and not segment >= MIN_SEGMENT_BYTES:
            problems.append(f"the segment (segment_bytes, else capacity_bytes) must be 0 or >= "
                            f"{MIN_SEGMENT_BYTES} bytes, got {segment}")
        if self.staging_bytes < (1 << 20):
            problems.append(f"staging_bytes must be >= 1 MiB, got {self.staging_bytes}")
        if self.replicas < 1:
            problems.append(f"replicas must be >= 1, got {self.replicas}")
        if not self.timeout_s > 0 or not self.min_throughput > 0 or not self.cooldown_s >= 0:
            problems.append("timeout_s and min_throughput must be > 0, cooldown_s >= 0")
        if self.failure_threshold < 1 or self.max_in_flight < 1 or not self.reconnect_max_s > 0:
            problems.append("failure_threshold, max_in_flight and reconnect_max_s must be positive")
        if problems:
            raise ValueError("bad remote tier settings: " + "; ".join(problems))

    def deadline_s(self, nbytes: int) -> float:
        """Deadline in seconds of a call that moves ``nbytes`` bytes."""
        return self.timeout_s + nbytes / self.min_throughput

    def setup_args(self) -> dict:
        """The dict ``MooncakeDistributedStore.setup`` takes."""
        segment = self.capacity_bytes if self.segment_bytes is None else self.segment_bytes
        return {"local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
                "global_segment_size": segment, "local_buffer_size": self.local_buffer_bytes,
                "protocol": self.protocol, "rdma_devices": self.rdma_devices,
                "master_server_addr": self.master, "tenant_id": self.tenant}


def apply_library_timeouts(timeout_s: float) -> None:
    """Set Mooncake's own timeouts (environment variables it reads when a session
    starts) from our deadline, leaving any the operator already set: master RPCs give
    up after ``timeout_s`` (RPC_TIMEOUT) instead of 30 s, connecting to the master after
    ``timeout_s``, a TCP transfer that makes no progress after ``ceil(timeout_s)`` s
    (TRANSFER_FAIL) instead of 30 s."""
    ms = str(max(1, int(timeout_s * 1000)))
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", ms)
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", ms)
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(timeout_s))))


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def reachable(address: str, timeout_s: float) -> str | None:
    """None when a TCP connection to ``address`` (``host:port`` or an http URL) opens
    within ``timeout_s``; otherwise why not. Other metadata servers are not probed."""
    if "://" in address:
        url = urllib.parse.urlsplit(address)
        if url.scheme not in ("http", "https") or not url.hostname:
            return None
        target = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    else:
        target = _host_port(address)
        if target is None:
            return None
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{target[0]}:{target[1]} unreachable: {exc}"


def open_session(config: MooncakeConfig, staging_address: int, staging_bytes: int) -> Any:
    """Connect one client to the cluster and register the staging buffer.

    Blocking: the library's ``setup`` can take ~90 s when the master vanishes meanwhile,
    so call this from a thread of its own. Returns the store object.

    Raises:
        MooncakeUnavailable: the library cannot be loaded.
        MediaIOError: the master or metadata server is unreachable, or setup or
            registration failed.
    """
    cls = store_class()
    for address in (config.master, config.metadata_server):
        why = reachable(address, config.timeout_s)
        if why:
            raise MediaIOError(f"mooncake: {why}")
    if config.set_library_timeouts:
        apply_library_timeouts(config.timeout_s)
    store = cls()
    rc = store.setup(config.setup_args())
    if rc != 0:
        raise MediaIOError(f"mooncake: setup with master {config.master} failed: {code_name(rc)}")
    rc = store.register_buffer(staging_address, staging_bytes)
    if rc != 0:
        _close_quietly(store)
        raise MediaIOError(f"mooncake: registering the {staging_bytes}-byte staging buffer failed: {code_name(rc)}")
    return store


class Connector:
    """The client session with the cluster, made on a background thread (``setup`` can
    block ~90 s) and retried with exponential backoff up to ``reconnect_max_s`` until it
    succeeds or :meth:`detach` is called. Once made, the library itself reconnects to
    a restarted master, so one session serves the tier's life.

    Attributes:
        store: the library's store object, None until connected and after detach.
        error: why the last attempt failed ('' once connected).
        connected: set once connected.
    """

    def __init__(self, config: MooncakeConfig, staging_address: int, staging_bytes: int, name: str,
                 on_connect: Callable[[], None] | None = None):
        self.config = config
        self.name = name
        self.store: Any = None
        self.error = "connecting"
        self.connected = threading.Event()
        self._closed = threading.Event()
        self._on_connect = on_connect
        self._staging = (staging_address, staging_bytes)
        threading.Thread(target=self._run, name=f"{name}-connect", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _run(self) -> None:
        delay = 0.25
        while not self._closed.is_set():
            try:
                store = open_session(self.config, *self._staging)
            except Exception as exc:                 # MediaIOError, or the library raised
                if str(exc) != self.error:
                    log.warning("%s: cannot connect to the cluster (retrying): %s", self.name, exc)
                self.error = str(exc)
                self._closed.wait(delay)
                delay = min(delay * 2, self.config.reconnect_max_s)
                continue
            if self._closed.is_set():
                _close_quietly(store)
                return
            self.store = store
            self.error = ""
            if self._on_connect is not None:
                self._on_connect()
            self.connected.set()
            log.info("%s: connected to Mooncake master %s", self.name, self.config.master)
            return

    def require(self) -> Any:
        """The store object. Raises RemoteUnavailable when not connected or detached."""
        store = self.store
        if store is None:
            state = "closed" if self._closed.is_set() else f"not connected to master {self.config.master}"
            raise RemoteUnavailable(f"{self.name}: {state} ({self.error})")
        return store

    def detach(self) -> Any:
        """Stop connecting and hand over the store object (None if never connected)."""
        self._closed.set()
        store, self.store = self.store, None
        return store


def replicate_config(config: MooncakeConfig) -> Any:
    """The library's ``ReplicateConfig`` for our puts."""
    from mooncake.store import ReplicateConfig

    rc = ReplicateConfig()
    rc.replica_num = config.replicas
    rc.prefer_alloc_in_same_node = config.prefer_local_segment
    return rc


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception:
        pass


__all__ = ["MASTER_DOWN", "Connector", "MooncakeConfig", "MooncakeUnavailable", "WHEEL", "WHEEL_VERSION",
           "all_master_down", "any_error", "apply_library_timeouts", "code_name", "master_down", "mooncake_missing",
           "open_session", "reachable", "replicate_config", "store_class"]
