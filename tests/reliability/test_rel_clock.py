"""Monotonic clocks (issue 9, item 4): stepping the wall clock after a ToolCallStart
neither postpones the page-back (a step back of an hour) nor fires it at once (a step
forward of an hour).

The daemon runs in this process with ``[prefetch] enabled``; ``time.time`` is replaced,
before the daemon starts, by a clock that the test steps an hour (what an NTP step or an
operator does), for the daemon and the client alike. The block is demoted to NVMe first, so its page-back is visible as its tier.
Verdicts wait on events (the block's tier, the scheduler's ticks) with generous deadlines.
"""

from __future__ import annotations

import threading
import time

import pytest

from support.daemon import daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from rel_support import key
from tiers.base import TierKind

K = key(1, "clock")
HOUR = 3600.0


class WallClock:
    """``time.time`` off by ``offset`` seconds (``time.monotonic`` is untouched)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return _REAL_TIME() + self.offset


_REAL_TIME = time.time


@pytest.fixture
def wall(monkeypatch):
    """The process's wall clock, steppable. Installed before the daemon starts, so a
    component that kept a reference to ``time.time`` sees the step too. Calls made after
    a step carry no gRPC deadline: grpc turns deadlines into wall-clock times for its core."""
    clock = WallClock()
    monkeypatch.setattr(time, "time", clock)
    return clock


@pytest.fixture
def node(wall, tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="32MiB", extra={"prefetch": {"enabled": True}}))
    yield d
    wall.offset = 0.0
    d.stop(0)


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def store_on_nvme(d, c) -> None:
    c.put([(K, b"kv" * 2048)])
    assert d.manager.demote(K, 0) and d.manager.tier_of(K) == TierKind.NVME


def test_a_step_back_of_an_hour_does_not_postpone_the_page_back(node, wall):
    d = node
    with KVStoreClient(d.address, timeout=None) as c:
        store_on_nvme(d, c)
        predicted = c.tool_call_start("T", "search", [K])     # nothing learned yet: back in ~1 s
        assert abs(predicted - time.time()) < 60
        wall.offset = -HOUR
        assert abs(c.tool_call_start("U", "other", []) - time.time()) < 60   # replies follow the step
        # the block reaches host before the page-back counts it: wait for both
        wait_for(lambda: d.manager.tier_of(K) == TierKind.HOST and d.service.hints.stats.promoted_blocks >= 1,
                 "the page-back (due ~1 s after the call)")
        assert d.service.hints.stats.promoted_blocks == 1
        known, observed = c.resume("T")                       # the client's time is stepped too
        assert known and 0 <= observed < 60


def test_a_step_forward_of_an_hour_does_not_fire_the_page_back_early(node, wall, monkeypatch):
    d = node
    sched = d.service.hints
    with KVStoreClient(d.address, timeout=None) as c:
        for i in range(3):                                    # "slow" takes 120 s
            c.tool_call_start(f"w{i}", "slow", [], start_time=time.time() - 120)
            assert c.resume(f"w{i}") == (True, pytest.approx(120, abs=5))
        store_on_nvme(d, c)
        predicted = c.tool_call_start("T", "slow", [K])
        assert 100 < predicted - time.time() < 125
        due = sched.next_due()

        ticks = threading.Semaphore(0)
        tick = sched.tick

        def counted_tick(now=None):
            tick(now)
            ticks.release()
        monkeypatch.setattr(sched, "tick", counted_tick)
        wall.offset = +HOUR
        for _ in range(20):                                   # 20 scheduler passes after the step
            assert ticks.acquire(timeout=60), "the prefetch thread stopped ticking"
        assert "T" in sched.waits, "the call expired at once"
        assert d.manager.tier_of(K) == TierKind.NVME and sched.stats.promoted_blocks == 0, "paged back at once"
        assert sched.next_due() == due                        # the schedule did not move
