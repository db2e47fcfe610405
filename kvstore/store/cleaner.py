"""The background watermark keeper: copies the coldest dirty blocks down ahead of need.

:class:`Cleaner` runs on its own thread (``kvstore-cleaner``). When a tier other than
the last holds more than the high watermark of its capacity, it copies that tier's
coldest dirty blocks to the next tier, several copies in flight, until the free and
clean bytes reach ``1 - low`` of the capacity; above a disk it also keeps
:meth:`kvstore.store.room.Room.ahead_bytes` free or clean (a few blocks: a small staging
tier). A later put then evicts a clean block with a free and no I/O. Which blocks it copies is :meth:`kvstore.store.room.Room.dirty_victim`
(the one place victims are chosen); the scheme is described in :mod:`kvstore.store.room`.
Each tick it also runs ``on_tick`` (the store's lease and reservation expiry).

:class:`CleanerSignal` is how the rest of the store wakes the cleaner and sees it
working: the room holds it (a put that found no clean victim waits while the cleaner
is busy), the cleaner owns the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvstore.common.errors import TierFull, TierIOError
from kvstore.policy import NoVictim
from kvstore.store.catalogue import Catalogue
from kvstore.store.counters import Counters
from kvstore.store.placement import Placement
from kvstore.store.room import Room
from kvstore.store.transfers import Transfers

log = logging.getLogger("kvstore.store.placement")

WAIT_S = 0.05
"""Longest the cleaner waits for one of its copies to end before it looks again (seconds)."""


class CleanerSignal:
    """Wakes the cleaner (:meth:`kick`); :attr:`busy` while a cleaning pass may run."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.busy = False

    def kick(self) -> None:
        """Wake the cleaner; :attr:`busy` until its pass ends."""
        self.busy = True
        self.wake.set()


class Cleaner:
    """Background watermark keeper (see the module docstring).

    Runs on its own thread; woken through ``signal`` (a put that found no clean victim,
    a commit past the high watermark) and every ``period_s`` seconds, when it also runs
    ``on_tick``.

    Args:
        signal: shared with the room; room: chooses victims and starts their copies.
        placement: dirty and resident bytes per tier; transfers: runs the copies.
        catalogue: the lock; counters: ``precleaned``.
        disk_workers: copies in flight into a persistent tier (the mover's workers).
    """

    def __init__(self, signal: CleanerSignal, room: Room, placement: Placement, transfers: Transfers,
                 catalogue: Catalogue, counters: Counters, disk_workers: int = 4, period_s: float = 0.25,
                 on_tick: Callable[[], None] | None = None):
        self.signal = signal
        self.room = room
        self.placement = placement
        self.transfers = transfers
        self.cat = catalogue
        self.counters = counters
        self.disk_workers = disk_workers
        self.period_s = period_s
        self.on_tick = on_tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-cleaner", daemon=True)

    @property
    def busy(self) -> bool:
        return self.signal.busy

    def start(self) -> "Cleaner":
        self._thread.start()
        return self

    def kick(self) -> None:
        """Wake the cleaner; :attr:`busy` until its pass ends."""
        self.signal.kick()

    def stop(self) -> None:
        self._stop.set()
        self.signal.wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        wake = self.signal.wake
        while not self._stop.is_set():
            wake.wait(self.period_s)
            wake.clear()
            try:
                if self.on_tick is not None:
                    self.on_tick()
                self.pass_once()
            except Exception:  # noqa: BLE001 - keep cleaning; the error is logged loudly
                log.exception("background cleaning failed")
            finally:
                self.signal.busy = False
                with self.cat.lock:
                    self.cat.changed.notify_all()

    def pass_once(self) -> int:
        """One pass over every tier but the last; returns blocks cleaned."""
        done = 0
        room = self.room
        for i, tier in enumerate(room.tiers):
            if self._stop.is_set():
                break
            cap = tier.capacity_bytes
            if i == room.last or cap <= 0 or not room.needs_cleaning(i):
                continue
            done += self._clean(i, cap)
        return done

    def _clean(self, i: int, cap: int) -> int:
        """Copy tier ``i``'s coldest dirty blocks down, up to ``width`` copies in flight,
        until its free and clean bytes reach the goal: ``1 - low`` of ``cap``, and at least
        the bytes of ``width`` blocks. Bytes being copied do not count as clean: puts find
        clean room while the next copies run, and a finished copy is replaced at once (the
        pass waits for whichever copy ends first, not for the oldest), so a disk keeps
        ``width`` writes in flight while puts outrun it. Returns blocks cleaned."""
        room, p, transfers = self.room, self.placement, self.transfers
        tier = room.tiers[i]
        chosen: set[bytes] = set()
        inflight: list = []
        width = 1 if room.tiers[i + 1].volatile else max(1, self.disk_workers)
        cleaned = 0
        goal = room.clean_goal(i)
        dry = False                                      # no dirty victim (or room) left

        def settle(t) -> None:
            nonlocal cleaned
            transfers.run(t, wait=True)
            if t.ok:
                cleaned += 1
                self.counters.inc("precleaned")

        def reap() -> None:
            for t in [t for t in inflight if t.done.is_set()]:
                inflight.remove(t)
                settle(t)
        with self.cat.lock:
            self.signal.busy = True
            try:
                while not self._stop.is_set():
                    reap()
                    free = cap - tier.used_bytes
                    clean = p.resident_bytes(i) - p.dirty_bytes(i)
                    if free + clean >= goal and not inflight:
                        break
                    if not dry and len(inflight) < width and free + clean < goal:
                        victim = room.dirty_victim(i, chosen)
                        t = None
                        if victim is not None:
                            chosen.add(victim)
                            try:
                                t = room.start_copy_locked(self.cat.raw(victim), i, i + 1, "demoted")
                            except (TierFull, NoVictim, TierIOError) as e:
                                log.debug("pre-cleaning %s skipped: %s", victim.hex()[:16], e)
                        if t is None:
                            dry = True
                            continue
                        transfers.run(t, wait=False)
                        inflight.append(t)
                        # room for ``width`` copies in flight, even in a tier of a few large blocks
                        goal = max(goal, min(cap, width * t.entry.size))
                        continue
                    if not inflight:
                        break
                    oldest = inflight[0]
                    if oldest.done.is_set():
                        continue
                    if time.monotonic() - oldest.started > transfers.transfer_timeout_s:
                        inflight.pop(0)
                        settle(oldest)     # waits up to transfer_timeout_s more, then abandons it
                        continue
                    self.cat.changed.wait(WAIT_S)    # a copy ended (notified), or look again
                    dry = False        # a put may have left a new dirty block meanwhile
                reap()
                while inflight:
                    settle(inflight.pop(0))
            finally:
                self.signal.busy = False
                self.cat.changed.notify_all()
        return cleaned


__all__ = ["Cleaner", "CleanerSignal"]
