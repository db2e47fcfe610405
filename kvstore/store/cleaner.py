"""The background watermark keeper of a Placement: copies the coldest dirty blocks down.

:class:`Cleaner` runs on its own thread (``kvstore-cleaner``). When a tier other than
the last holds more than the high watermark of its capacity, it copies that tier's
coldest dirty blocks to the next tier, several copies in flight, until the free and
clean bytes reach ``1 - low`` of the capacity; a later put then evicts a clean block
with a free and no I/O. Victims come in the tier policy's order while a dirty one is
within :data:`kvstore.store.placement.CLEAN_SCAN` of the front, else from the placement's
least recently used dirty list. Each tick it also runs ``on_tick`` (the manager's lease
and reservation expiry). The scheme is described in :mod:`kvstore.store.placement`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvstore.store import placement as _placement
from kvstore.common.errors import TierFull, TierIOError
from kvstore.store.placement import Placement
from kvstore.policy import NoVictim

log = logging.getLogger("kvstore.store.placement")


class _ScanBudgetSpent(Exception):
    """The policy looked at :data:`kvstore.store.placement.CLEAN_SCAN` blocks without finding a dirty one."""


class Cleaner:
    """Background watermark keeper of a :class:`Placement` (see :mod:`kvstore.store.placement`).

    Runs on its own thread; woken by :meth:`kick` (a put that found no clean victim,
    a commit past the high watermark) and every ``period_s`` seconds, when it also runs
    ``on_tick`` (the manager's lease and reservation expiry).
    """

    def __init__(self, placement: Placement, period_s: float = 0.25,
                 on_tick: Callable[[], None] | None = None):
        self.p = placement
        self.period_s = period_s
        self.on_tick = on_tick
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.busy = False                 # a cleaning pass is copying blocks down
        self._thread = threading.Thread(target=self._run, name="kvstore-cleaner", daemon=True)
        placement.cleaner = self

    def start(self) -> "Cleaner":
        self._thread.start()
        return self

    def kick(self) -> None:
        """Wake the cleaner; :attr:`busy` until its pass ends."""
        self.busy = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            try:
                if self.on_tick is not None:
                    self.on_tick()
                self.pass_once()
            except Exception:  # noqa: BLE001 - keep cleaning; the error is logged loudly
                log.exception("background cleaning failed")
            finally:
                self.busy = False
                with self.p.cat.lock:
                    self.p.cat.changed.notify_all()

    def pass_once(self) -> int:
        """One pass over every tier but the last; returns blocks cleaned."""
        done = 0
        for i, tier in enumerate(self.p.tiers):
            if self._stop.is_set():
                break
            cap = tier.capacity_bytes
            if i == self.p.last or cap <= 0 or tier.used_bytes <= self.p.high * cap:
                continue
            done += self._clean(i, cap)
        return done

    def _clean(self, i: int, cap: int) -> int:
        """Copy tier ``i``'s coldest dirty blocks down, several copies in flight, until its
        free and clean bytes reach ``1 - low`` of ``cap``. Returns blocks cleaned."""
        p = self.p
        tier, policy = p.tiers[i], p.policies[i]
        raw = p.cat.raw
        chosen: set[bytes] = set()
        inflight: list = []
        width = 1 if p.tiers[i + 1].volatile else max(1, p.mover.disk_workers)
        done = {"cleaned": 0, "moving": 0}               # blocks cleaned, bytes being copied

        def dirty(key: bytes) -> bool:
            e = raw(key)
            return e is not None and e.pins == 0 and not e.deleted and e.tiers[-1] == i and key not in chosen

        looked = [0]

        def dirty_near_front(key: bytes) -> bool:
            looked[0] += 1
            if looked[0] > _placement.CLEAN_SCAN:
                raise _ScanBudgetSpent
            return dirty(key)

        def next_victim() -> bytes | None:
            looked[0] = 0
            try:
                return policy.victim(dirty_near_front, incoming=None, now=p.clock())
            except NoVictim:
                return None
            except _ScanBudgetSpent:      # the policy's coldest blocks are clean already
                return next((k for k in p.dirty_keys(i) if dirty(k)), None)

        def settle(t) -> None:
            p.run_transfer(t, wait=True)
            done["moving"] -= t.entry.size
            if t.ok:
                done["cleaned"] += 1
                p.counters.inc("precleaned")
        with p.cat.lock:
            self.busy = True
            try:
                while not self._stop.is_set():
                    free = cap - tier.used_bytes
                    clean = p.resident_bytes(i) - p.dirty_bytes(i) + done["moving"]
                    if free + clean >= (1.0 - p.low) * cap:
                        break
                    victim = next_victim()
                    if victim is None:
                        break
                    chosen.add(victim)
                    try:
                        t = p.start_transfer_locked(raw(victim), i, i + 1, "demoted")
                    except (TierFull, NoVictim, TierIOError) as e:
                        log.debug("pre-cleaning %s skipped: %s", victim.hex()[:16], e)
                        break
                    p.run_transfer(t, wait=False)
                    inflight.append(t)
                    done["moving"] += t.entry.size
                    if len(inflight) >= width:
                        settle(inflight.pop(0))
                while inflight:
                    settle(inflight.pop(0))
            finally:
                self.busy = False
                p.cat.changed.notify_all()
        return done["cleaned"]
