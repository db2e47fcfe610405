"""Daemon start-up: the manager, the gRPC server and the background parts, started from the config.

The tiers and the manager are built by :mod:`kvstore.service.build` (the one place concrete
parts are made from the config); this module wires them to the service and starts the
prefetch scheduler, the health monitor, metrics, events and the shared-arena socket.
``kvstore serve [--config FILE]`` (:mod:`kvstore.tools.serve_cmd`) runs it in the foreground
until SIGINT/SIGTERM. Tests and tools start one in-process with :func:`start_server`.
The listen address is bound by :mod:`kvstore.service.listen`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from kvstore import __version__
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.service.auth import Authenticator
from kvstore.service.build import build_manager, prefetch_options, session_options
from kvstore.config.node import Config
from kvstore.common.errors import ConfigError
from kvstore.service.health import HealthMonitor
from kvstore.service.interceptors import BearerTokenInterceptor, RequestDecodeInterceptor
from kvstore.service.listen import UnixSocket, bind, check_port_free, check_socket_free
from kvstore.store.manager import TierManager
from kvstore.agent.sessions import SessionTable
from kvstore.service.server import KVStoreService, data_handler
from kvstore.service.streams import HINT_THREADS, stream_threads
from kvstore.common.transport import channel_options

log = logging.getLogger("kvstore.service.startup")

SERVICE_NAME = "kvstore.v1.KVStore"


@dataclasses.dataclass
class Daemon:
    """A running daemon: gRPC server, its address and the manager behind it.

    ``server, address = start_server(cfg)`` unpacks to the Daemon itself and its
    address; ``server.stop(grace)`` stops serving and closes the tiers.
    """

    server: grpc.Server
    address: str
    manager: TierManager
    service: KVStoreService
    health: health.HealthServicer
    monitor: HealthMonitor | None = None
    background: list = dataclasses.field(default_factory=list)
    socket: UnixSocket | None = None
    metrics: object = None
    events: object = None
    persist_s: float = 60.0
    pools: list = dataclasses.field(default_factory=list)   # thread pools of its own (the stream pool)
    _stopped: bool = False

    def __iter__(self):
        return iter((self, self.address))

    def stop(self, grace: float | None = None, persist_s: float | None = None,
             cancel_persist: Callable[[], bool] | None = None) -> threading.Event:
        """Stop serving (waiting up to ``grace`` s for calls in flight), copy blocks held only
        in memory to NVMe (up to ``persist_s`` s, default ``[store] stop_persist_s``; 0 skips
        it; ``cancel_persist()`` true stops the copying between blocks) and close the tiers."""
        persist_s = self.persist_s if persist_s is None else persist_s
        if self._stopped:
            ev = threading.Event()
            ev.set()
            return ev
        self._stopped = True
        if self.monitor is not None:
            self.monitor.stop()
        self.health.enter_graceful_shutdown()
        for item in self.background:
            item.stop()
        ev = self.server.stop(grace)
        ev.wait()
        for pool in self.pools:
            pool.shutdown(wait=False)
        if persist_s > 0:
            n = self.manager.persist(timeout=persist_s, cancelled=cancel_persist)
            if n:
                log.info("kept %d blocks by copying them from memory to NVMe before stopping", n)
        self.manager.close()
        if self.socket is not None:
            self.socket.release()
        return ev

    def wait(self) -> None:
        self.server.wait_for_termination()



def _start_prefetch(cfg: Config, manager: TierManager, sessions, background: list):
    """The prefetch scheduler: moves blocks when ``[prefetch] enabled``; with prefetch off it
    still runs, observing only, when a policy learns from it (``next_use``). Its clock is
    monotonic: client unix times are converted on arrival (:mod:`kvstore.service.validate`).
    With ``[engines] kv_events`` (and prefetch on) it reads what the engines hold; the
    subscriber is appended to ``background``."""
    from kvstore.policy.hints import UsesReuseModel
    if cfg.engines.kv_events and not cfg.prefetch.enabled:
        log.warning("[engines] kv_events is set but [prefetch] enabled = false: the engines' KV events are not read")
    if not cfg.prefetch.enabled and not any(isinstance(p, UsesReuseModel) for p in manager.policies):
        return None
    from kvstore.agent.prefetch import PrefetchScheduler
    engines = None
    if cfg.prefetch.enabled and cfg.engines.kv_events:
        from kvstore.agent.engine_holdings import EngineHoldings
        engines = EngineHoldings(cfg.engines.kv_events, cfg.engines.kv_events_topic)
        engines.start()
        background.append(engines)
        log.info("prefetch reads what %d engine(s) hold from their KV events: %s", len(cfg.engines.kv_events),
                 ", ".join(cfg.engines.kv_events))
    scheduler = PrefetchScheduler(manager, cfg.prefetch, clock=time.monotonic, sessions=sessions,
                                  engines=engines, **prefetch_options(cfg.prefetch))
    scheduler.start()
    return scheduler


class Every:
    """Calls ``fn`` every ``period_s`` seconds on a daemon thread until :meth:`stop`."""

    def __init__(self, period_s: float, fn, name: str):
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - keep ticking; the error is logged loudly
                    log.exception("%s failed", name)
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def _eviction_log(cfg: Config, manager: TierManager):
    """Record recent evictions and refusals (bounded) for ``kvstore explain``; returns the
    function that explains a prompt's keys against the store."""
    from kvstore.service.explain import EvictionLog, LocalStoreView, explain_prompt
    from kvstore.service.validate import to_unix

    record = EvictionLog(capacity=cfg.server.eviction_log_blocks)
    for p in manager.policies:       # times on the daemon's monotonic clock; shown as unix
        p.listener = lambda ev: record.record(dataclasses.replace(ev, time=to_unix(ev.time)))
    manager.writes.on_refused = lambda key: record.record_refusal(key, time.time())
    view = LocalStoreView(manager, record)
    return lambda keys: explain_prompt(keys, view)


def _start_metrics(cfg: Config, manager: TierManager, monitor: HealthMonitor, hints):
    """The Prometheus endpoint (``[metrics] listen``), or None when off."""
    if not cfg.metrics.listen:
        return None
    from kvstore.service.metrics import Metrics
    check_port_free(cfg.metrics.listen, "metrics.listen")     # every address its host stands for
    try:
        return Metrics(manager, cfg.blocks.block_tokens, cfg.metrics.listen,
                       serving=lambda: monitor.serving, prefetch=hints)
    except OSError as e:
        raise ConfigError(f"metrics.listen: cannot serve on {cfg.metrics.listen} ({e})") from None


def _start_events(cfg: Config, manager: TierManager):
    """The KV event publisher (``[events] enabled``), or None when off. It starts with a
    snapshot of the blocks held now (recovered from NVMe) and then follows the catalogue's
    events (:mod:`kvstore.service.events`)."""
    if not cfg.events.enabled:
        return None
    import zmq

    from kvstore.service.events import KVEventPublisher, held_blocks
    for key, endpoint in (("endpoint", cfg.events.endpoint), ("replay_endpoint", cfg.events.replay_endpoint)):
        if endpoint.startswith("tcp://") and not endpoint.startswith("tcp://*:"):
            check_port_free(endpoint[len("tcp://"):], f"events.{key}")   # every address its host stands for
        if endpoint.startswith("ipc://") and os.path.lexists(endpoint[len("ipc://"):]):
            try:                 # ZMQ replaces the file at an ipc:// path, even one another process serves
                check_socket_free(endpoint[len("ipc://"):])
            except OSError as e:
                raise ConfigError(f"events.{key}: {e}") from None
    try:
        pub = KVEventPublisher(cfg.events, cfg.blocks.block_tokens, manager.counters,
                               held=lambda: held_blocks(manager))
    except zmq.ZMQError as e:
        raise ConfigError(f"events.endpoint: cannot bind {cfg.events.endpoint} or "
                          f"{cfg.events.replay_endpoint or 'the replay endpoint'} ({e})") from None
    manager.events.subscribe(pub.on_event)
    return pub.start()


def _start_arena(cfg: Config, manager: TierManager, sock: UnixSocket | None, auth: Authenticator | None,
                 control=None):
    """The shared-arena hand-out socket, or None and the reason the path is off. ``control``
    (:class:`kvstore.service.arena_control.ArenaControl`) answers its sessions' control frames."""
    from kvstore.service.arena_server import ArenaServer
    shared = manager.shared_tier
    if shared is None:
        return None, "the host tier is not shared memory ([tiers.host] shared = false, or no host tier)"
    if cfg.server.tenants:
        return None, "multi-tenant config ([server.tenants]): a mapped arena would show every tenant's blocks"
    if sock is None:
        return None, "the daemon listens on TCP: the shared arena is for clients on its unix socket"
    from kvstore.service.liveness import ClientSessions
    host = manager.tiers[shared].capabilities.shared
    seg = host.segment()
    table = getattr(host, "block_table", None)
    if table is not None:                   # a lookup's tier codes are the host's only when it is fastest
        table.answer_lookups(shared == 0)

    def end(session: str, client_gone: bool = True):    # a dead client's hold ends with it
        if table is not None:
            table.close_reader(session)
        return manager.end_session(session, client_gone)

    sessions = ClientSessions(manager.open_session, end)
    try:
        arena = ArenaServer(f"{sock.path}.arena", seg.fd, seg.size, auth, sessions=sessions,
                            max_ttl_s=cfg.server.lease_ttl_s, control=control, table=table).start()
    except OSError as e:
        sessions.stop()
        log.warning("shared arena socket unavailable (%s); same-node clients use gRPC", e)
        return None, f"cannot bind the arena socket: {e}"
    return arena, ""


def start_server(cfg: Config) -> Daemon:
    """Build the tiers and start serving ``cfg`` in background threads.

    Returns the :class:`Daemon` (it unpacks as ``daemon, address``).
    Raises ConfigError for a config that cannot be served (unbindable address, ...).
    """
    manager = build_manager(cfg)
    background: list = []
    try:
        auth = Authenticator.from_config(cfg.server)
        interceptors = [BearerTokenInterceptor(auth)] if auth is not None else []
        interceptors.append(RequestDecodeInterceptor())
        # SO_REUSEPORT off: a second daemon on the same TCP port is refused, not served beside it
        options = channel_options(cfg.server.max_message_bytes) + [("grpc.so_reuseport", 0)]
        # streaming calls on threads of their own, so slow streams never hold a unary call's
        # thread (kvstore.service.streams)
        n_streams = stream_threads(cfg.server.workers, cfg.server.max_streams)
        stream_pool = futures.ThreadPoolExecutor(max_workers=n_streams, thread_name_prefix="kvstore-stream")
        unary_pool = futures.ThreadPoolExecutor(max_workers=cfg.server.workers - n_streams,
                                                thread_name_prefix="kvstore-rpc")
        hint_pool = futures.ThreadPoolExecutor(max_workers=HINT_THREADS, thread_name_prefix="kvstore-hint")
        server = grpc.server(unary_pool, options=options, interceptors=interceptors)
        sessions = SessionTable(manager.policies, **session_options(cfg.sessions))
        hints = _start_prefetch(cfg, manager, sessions, background)
        if hints is not None:
            background.append(hints)
            apply_hint = hints.session_hint
        else:                               # hints still steer eviction; TTLs need a tick
            def apply_hint(h):
                return sessions.apply(h, time.monotonic())
            background.append(Every(1.0, lambda: sessions.tick(time.monotonic()), "kvstore-sessions"))
        explain = _eviction_log(cfg, manager)
        health_servicer = health.HealthServicer()     # non-blocking: a Watch holds no thread
        folders = {"nvme": os.path.abspath(cfg.tiers.nvme.path)} if cfg.tiers.nvme.enabled else {}
        monitor = HealthMonitor(manager, health_servicer, folders=folders, period_s=cfg.health.period_s,
                                capacities={"nvme": cfg.tiers.nvme.capacity} if folders else None,
                                window_s=cfg.health.window_s)
        metrics = _start_metrics(cfg, manager, monitor, hints)
        if metrics is not None:
            background.append(metrics)
        events = _start_events(cfg, manager)
        if events is not None:
            background.append(events)
        info = pb.InfoReply(version=__version__, block_tokens=cfg.blocks.block_tokens, key_hash=cfg.blocks.hash,
                            max_message_bytes=cfg.server.max_message_bytes, max_lease_seconds=cfg.server.lease_ttl_s)
        service = KVStoreService(manager, max_chunk_bytes=cfg.server.max_chunk_bytes,
                                 max_message_bytes=cfg.server.max_message_bytes, hints=hints, auth=auth,
                                 stream_idle_timeout_s=cfg.server.stream_idle_timeout_s,
                                 stream_first_message_s=cfg.server.stream_first_message_s, health=monitor, info=info,
                                 lease_ttl_s=cfg.server.lease_ttl_s,
                                 observe=metrics.observe if metrics is not None else None,
                                 tally=metrics.tally if metrics is not None else None,
                                 sessions=apply_hint, explain=explain,
                                 stream_timeout_s=cfg.server.stream_timeout_s, stream_pool=stream_pool,
                                 hint_pool=hint_pool)
        pb_grpc.add_KVStoreServicer_to_server(service, server)
        server.add_generic_rpc_handlers((data_handler(service),))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address, sock = bind(server, cfg)
        try:
            from kvstore.service.arena_control import ArenaControl
            control = ArenaControl(manager, lease_ttl_s=cfg.server.lease_ttl_s, hints=hints,
                                   tally=service.tally, observe=metrics.observe if metrics is not None else None)
            arena, refused = _start_arena(cfg, manager, sock, auth, control)
            if arena is not None:
                background += [arena, arena.sessions]
                service.arena_id = arena.identity
                info.shm_socket = str(arena.path.resolve())
                info.shm_arena_bytes = arena.size
            info.shm_refused = refused
            server.start()
        except BaseException:
            if sock is not None:
                sock.release()
            raise
    except BaseException:
        for item in background:
            item.stop()
        manager.close()
        raise
    monitor.start()
    return Daemon(server, address, manager, service, health_servicer, monitor=monitor,
                  background=background, socket=sock, metrics=metrics, events=events,
                  persist_s=cfg.store.stop_persist_s, pools=[stream_pool, unary_pool, hint_pool])
