"""``kvstore serve [--config FILE] [--listen ADDR]``: run the daemon in the foreground.

Starts it with :func:`kvstore.service.startup.start_server`, prints what it serves (tiers,
recovered blocks, metrics and event endpoints, the same-node path) and runs until
SIGINT/SIGTERM, then stops it (blocks held only in memory are copied to NVMe first).
A config that cannot be served is logged and exits with status 2; so is an empty
``--listen`` or ``--config`` (refused as ``listen = ""`` is, rather than taken to mean the
default).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import pathlib
import signal
import sys
import threading

from kvstore import config as config_mod
from kvstore.common.errors import ConfigError
from kvstore.service.startup import Daemon, start_server
from kvstore.common.units import format_size
from kvstore.tools.cliargs import address, non_empty_path
from kvstore.tools.serve_summary import data_lines

log = logging.getLogger("kvstore.service.startup")


def _describe(daemon: Daemon) -> str:
    lines = [f"kvstore serving on {daemon.address}"]
    for u in daemon.manager.usage():
        lines.append(f"  tier {u.name:5s} capacity {format_size(u.capacity_bytes):>12s}  "
                     f"used {format_size(u.used_bytes):>12s}  blocks {u.blocks:>8d}  eviction {u.policy}")
    recovered = daemon.manager.counters.get("blocks_recovered", 0)
    if recovered:
        lines.append(f"  recovered {recovered} blocks from NVMe")
    if daemon.metrics is not None:
        lines.append(f"  Prometheus metrics on http://{daemon.metrics.address}/metrics")
    if daemon.events is not None:
        lines.append(f"  KV events published on {daemon.events.endpoint}"
                     + (f" (replay {daemon.events.replay_endpoint})" if daemon.events.replay_endpoint else ""))
    info = daemon.service.info
    if info.shm_socket:
        lines.append(f"  same-node clients map the host arena through {info.shm_socket}")
    elif info.shm_refused:
        lines.append(f"  shared-memory path off: {info.shm_refused}")
    return "\n".join(lines)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(args.config)
        if args.listen is not None:
            cfg = config_mod.replace(cfg, server=dataclasses.replace(cfg.server, listen=args.listen))
        daemon = start_server(cfg)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:
        _say(_describe(daemon), *data_lines(cfg, args.config))
        _wait_and_stop(daemon, cfg)
    finally:
        daemon.stop(0)      # no-op after the graceful stop; stops it on any error before
    _say("kvstore stopped")
    return 0


def _say(*lines: str) -> None:
    """Print to stdout; a closed stdout (``kvstore serve | true``) is logged, not fatal:
    the daemon goes on serving and stops gracefully on a signal."""
    try:
        print(*lines, sep="\n", flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        log.warning("stdout is closed: the daemon's messages go only to the log")


def _wait_and_stop(daemon: Daemon, cfg) -> None:
    """Wait for SIGTERM/SIGINT, then stop ``daemon`` gracefully."""
    done, hurry = threading.Event(), threading.Event()
    signals = itertools.count()     # next() is one C call: a handler run inside another still counts right

    def on_signal(signum, frame):
        if next(signals):           # a second signal: no more copying of blocks to NVMe
            hurry.set()
            done.set()
            log.info("signal %d again: stopping without copying the rest of memory to NVMe", signum)
            return
        done.set()
        log.info("signal %d: stopping (a second signal skips copying memory-only blocks to NVMe)", signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Wait in slices: a signal delivered to another thread (gRPC's, the tiers') only sets a
    # flag that the main thread acts on when it runs Python code again; a wait without a
    # timeout could sleep through SIGTERM for ever.
    while not done.wait(0.2):
        pass
    # then up to [store] stop_persist_s copying blocks to NVMe, cut short by a second signal
    daemon.stop(grace=cfg.server.stop_grace_s, cancel_persist=hurry.is_set)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground",
                       description="Run the kvstore daemon. Without --config, a built-in default "
                                   "(1 GiB host tier + 16 GiB NVMe tier under ./kvstore-data) is used.")
    p.add_argument("--config", type=lambda text: pathlib.Path(non_empty_path(text)), default=None,
                   help="TOML config file")
    p.add_argument("--listen", type=address, default=None,
                   help="override [server] listen, e.g. 127.0.0.1:50051 or unix:/run/kvstore.sock")
    p.set_defaults(func=cmd_serve)
