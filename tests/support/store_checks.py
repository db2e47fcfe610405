"""Checks on an in-process daemon shared by the load tests: blocks only on NVMe, RPC counts."""

from __future__ import annotations

import time

from kvstore.common.types import TierKind


def only_on_nvme(d, c, keys) -> None:
    """Demote ``keys`` out of the host tier until the daemon says they are only on NVMe (a
    block being written back or copied at that moment is not demoted: tried again; fails
    the test after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        d.manager.drain()
        for k in keys:
            d.manager.demote(k, 0)
        d.manager.drain()
        if c.lookup(keys).tiers == (TierKind.NVME,) * len(keys):
            return
        assert time.monotonic() < deadline, c.lookup(keys).tiers
        time.sleep(0.05)


def rpcs(d, method: str, at_least: int = 0) -> int:
    """How many ``method`` calls the daemon ``d`` answered (its request histogram), once
    that count is ``at_least`` (waited for up to 60 s): the arena session records a
    frame's metrics after its answer, when no other frame waits, so the count may lag
    the call that the client already saw answered."""
    deadline = time.monotonic() + 60
    while True:
        n = int(d.metrics.registry.get_sample_value("kvstore:request_seconds_count",
                                                    {"method": method, "tenant": ""}) or 0)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.01)
