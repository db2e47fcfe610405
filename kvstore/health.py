"""Whether the daemon can store and serve, told truthfully to gRPC health and Stats.

Every ``period_s`` seconds :class:`HealthMonitor` asks each tier what keeps it from
storing (:meth:`tiers.base.Tier.problem`: a folder gone, a remote master down) and
looks at the manager's last put failure. The daemon is **not serving** while puts
fail (the last put failed within ``window_s`` seconds and none succeeded since), or
while every tier reports a problem. A tier with a problem while another still takes
puts is reported (Stats ``problems``) but the daemon keeps serving.

The standard gRPC health service then says NOT_SERVING for ``""``, ``kvstore.v1.KVStore``
and ``kvstore.v1.KVStoreData``, and SERVING again once a put succeeds or the failure
ages out with every tier healthy.
"""

from __future__ import annotations

import logging
import threading
import time

from grpc_health.v1 import health_pb2

from .manager import TierManager

log = logging.getLogger("kvstore.health")

SERVICES = ("", "kvstore.v1.KVStore", "kvstore.v1.KVStoreData")


class HealthMonitor:
    """Keeps ``servicer`` (a ``grpc_health.v1.health.HealthServicer``) truthful.

    Attributes:
        serving: the last verdict.
        problems: human-readable reasons (empty when all is well).
    """

    def __init__(self, manager: TierManager, servicer, *, period_s: float = 1.0, window_s: float = 10.0):
        self.manager = manager
        self.servicer = servicer
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
                p = tier.problem()
            except Exception as e:  # noqa: BLE001 - a failing check is itself a problem
                p = f"health check failed: {e}"
            if p:
                broken += 1
                problems.append(f"{tier.name}: {p}")
        failure = self.manager.put_failure
        failing = failure is not None and time.monotonic() - failure[0] < self.window_s
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
