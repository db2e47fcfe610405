"""Whether the daemon can store and serve, told truthfully to gRPC health and Stats.

Every ``period_s`` seconds :class:`HealthMonitor` asks each tier what keeps it from
storing (:meth:`tiers.base.Tier.problem`: a folder gone, a remote master down), checks
the folders the config gives to persistent tiers itself (the NVMe folder: present, a
folder, writable; a tier's own report comes first when it has one), and looks at the
manager's last put failure. The daemon is **not serving** while puts fail: the last
put failed and none succeeded since, and either a tier still reports a problem or the
failure is less than ``window_s`` seconds old; or while every tier reports a problem.
A tier with a problem while another still takes puts is reported (Stats ``problems``)
but the daemon keeps serving. A tier that holds less than its configured capacity (the
NVMe tier after its disk filled up first: it evicts to make room) is reported too, and
does not count as a problem for serving.

Only failures that say something about the tiers count as failing puts: a medium that
fails, no room even after evicting (every block pinned or leased). A put refused for
itself, such as a block larger than the largest block any tier can hold, a size
conflict or a bad request, leaves :attr:`TierManager.put_failure` alone
(:meth:`kvstore.store.writes.Writes._reserve_somewhere`), so one bad call never takes
the daemon out of service.

The standard gRPC health service then says NOT_SERVING for ``""``, ``kvstore.v1.KVStore``
and ``kvstore.v1.KVStoreData``, and SERVING again once a put succeeds, or once every
tier is healthy and the failure is ``window_s`` old.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Mapping

from grpc_health.v1 import health_pb2

from kvstore.store.manager import TierManager

log = logging.getLogger("kvstore.service.health")

SERVICES = ("", "kvstore.v1.KVStore", "kvstore.v1.KVStoreData")


class HealthMonitor:
    """Keeps ``servicer`` (a ``grpc_health.v1.health.HealthServicer``) truthful.

    Attributes:
        serving: the last verdict.
        problems: human-readable reasons (empty when all is well).
    """

    def __init__(self, manager: TierManager, servicer, *, folders: Mapping[str, str] | None = None,
                 capacities: Mapping[str, int] | None = None, period_s: float = 1.0, window_s: float = 10.0):
        self.manager = manager
        self.servicer = servicer
        self.folders = dict(folders or {})       # tier name -> the folder it stores in
        self.capacities = dict(capacities or {})   # tier name -> its configured capacity (bytes)
        self.period_s = period_s
        self.window_s = window_s
        self.serving = True
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-health", daemon=True)

    def start(self) -> "HealthMonitor":
        self.check()
        self._thread.start()
        return self

    def check(self) -> bool:
        """Evaluate now; update gRPC health on a change. Returns ``serving``."""
        problems = []
        broken = 0
        for tier in self.manager.tiers:
            try:
                p = tier.problem() or folder_problem(self.folders.get(tier.name))
            except Exception as e:  # noqa: BLE001 - a failing check is itself a problem
                p = f"health check failed: {e}"
            if p:
                broken += 1
                problems.append(f"{tier.name}: {p}")
            configured = self.capacities.get(tier.name)
            if not p and configured and tier.capacity_bytes < configured:
                problems.append(f"{tier.name}: holds at most {tier.capacity_bytes} of its configured {configured} "
                                "bytes: its disk is full (blocks are evicted to make room)")
        failure = self.manager.put_failure
        failing = failure is not None and (broken > 0 or time.monotonic() - failure[0] < self.window_s)
        if failing:
            problems.append(f"puts are failing: {failure[1]}")
        serving = not failing and broken < len(self.manager.tiers)
        if serving != self.serving:
            if serving:
                log.info("serving again")
            else:
                log.warning("not serving: %s", "; ".join(problems))
        self.serving, self.problems = serving, problems
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self.servicer is not None:
            for name in SERVICES:
                self.servicer.set(name, status)
        return serving

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001
                log.exception("health check failed")

    def stop(self) -> None:
        self._stop.set()


def folder_problem(path: str | None) -> str | None:
    """Why a tier cannot store files in folder ``path`` (gone, not a folder, not
    writable), or None (also for no folder)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"its folder {path} is gone"
    except OSError as e:
        return f"its folder {path} cannot be reached: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"its folder {path} is not a folder any more"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"its folder {path} is not writable"
    return None
