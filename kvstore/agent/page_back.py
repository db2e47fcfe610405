"""Page back: bring a waiting trajectory's prefix up into the fastest tier before it resumes.

:class:`Pager` is the moving part of the
:class:`~kvstore.agent.prefetch.PrefetchScheduler`. For one :class:`~kvstore.agent.waiting.Wait`
it asks the cluster for the blocks held only there, makes room in the fastest tier and
promotes the prefix head first, through the
:class:`~kvstore.agent.store_port.ManagerPort` (every block move goes through it). It owns
what it paged back and has not seen used yet (so it is not evicted again: no ping-pong,
and its waste is counted), the per-hop bandwidths (bytes per second: configured, or
measured when ``measure_bandwidth`` is on) and when each hop's link is free.

Room is made without evicting a pinned block, a block of a running trajectory, a block it
paged back that has not been used yet, or a block of a trajectory expected to resume no
later than this one (expected: :meth:`~kvstore.agent.timing.Timeline.expect`): victims
are first blocks of trajectories expected later (farthest first, tail first), then the
tier policy's choice among unprotected blocks (``next_use``'s only if that block is
predicted to be needed later); if none is left the page back stops and the scheduler
retries it.

Not thread-safe on its own: the scheduler's lock is held around every call (and taken by
the cluster's page-in callback).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from kvstore.common.types import TierKind
from kvstore.agent.sessions import SessionTable
from kvstore.agent.stats import PrefetchStats
from kvstore.agent.store_port import ManagerPort
from kvstore.agent.timing import Timeline
from kvstore.agent.waiting import Wait, WaitTable

DEFAULT_HOP_BANDWIDTH: dict[tuple[TierKind, TierKind], float] = {
    (TierKind.HOST, TierKind.HBM): 64e9,   # PCIe Gen5 x16
    (TierKind.NVME, TierKind.HBM): 1.5e9,  # NVMe read (fio O_DIRECT, measured on our machines)
    (TierKind.NVME, TierKind.HOST): 1.5e9,
    (TierKind.HBM, TierKind.HOST): 64e9,
    (TierKind.HOST, TierKind.NVME): 4e9,
    (TierKind.REMOTE, TierKind.HOST): 0.8e9,   # Mooncake over loopback TCP (docs/remote_tier.md)
    (TierKind.REMOTE, TierKind.HBM): 0.8e9,
}
"""Bytes per second per (source, destination) hop, before any measurement."""


class Pager:
    """Pages waiting trajectories' prefixes back into the fastest tier.

    Args:
        port: the store, as the agent sees it.
        waits: the wait table (the other waits and the running trajectories are protected).
        timeline: for the expected resume time of each wait.
        sessions: the session table (a paged-back prefix is hinted as needed soon).
        stats: the scheduler's statistics (page backs, waste, demotions).
        lock: the scheduler's lock (the page-in callback takes it).
        hop_bandwidth: bytes/s per (source kind, destination kind) over
            :data:`DEFAULT_HOP_BANDWIDTH`.
        measure_bandwidth: time each promotion (``time.perf_counter``) and keep an
            exponentially weighted average per hop.
        headroom_fraction: free share of the fastest tier that :meth:`keep_headroom` keeps.
        margin_s: room is made from another wait's blocks only when that one is expected
            at least this many seconds later.
        victim_margin: with a policy that predicts distances, a block is evicted only when
            its predicted next use is this many times farther than the prefix's.
        protect_s: a paged-back prefix is hinted as needed within ``refresh_s`` (0: not).
        refresh_s: see ``protect_s`` (seconds).
    """

    def __init__(self, port: ManagerPort, waits: WaitTable, timeline: Timeline, sessions: SessionTable,
                 stats: PrefetchStats, lock: threading.RLock, *,
                 hop_bandwidth: Mapping[tuple[TierKind, TierKind], float] | None = None,
                 measure_bandwidth: bool = True, headroom_fraction: float = 0.0, margin_s: float = 1.0,
                 victim_margin: float = 2.0, protect_s: float = 30.0, refresh_s: float = 2.0):
        self.port = port
        self.waits = waits
        self.timeline = timeline
        self.sessions = sessions
        self.stats = stats
        self._lock = lock
        self.bandwidth = dict(DEFAULT_HOP_BANDWIDTH)
        self.bandwidth.update(hop_bandwidth or {})
        self.measure_bandwidth = measure_bandwidth
        self.headroom_fraction = headroom_fraction
        self.margin_s = margin_s
        self.victim_margin = victim_margin
        self.protect_s = protect_s
        self.refresh_s = refresh_s
        self._paged: dict[bytes, tuple[str, int, float]] = {}   # key -> (trajectory, bytes, ready at)
        self._link_free: dict[tuple[TierKind, TierKind], float] = {}
        self._skipped: dict[int, str] = {}    # engine hash -> trajectory whose page back left it to the engine

    def __len__(self) -> int:
        """Blocks paged back and not used (or wasted) yet."""
        return len(self._paged)

    # ------------------------------------------------------------------ readings

    def transfer_seconds(self, keys: Sequence[bytes], assume: TierKind | None = None) -> float:
        """Seconds to bring ``keys`` into the fastest tier at the current hop bandwidths.

        ``assume``: plan for the worst plausible case, every block (even one in the
        fastest tier now, which may be demoted while it waits) one hop away in tier
        ``assume``, or where it is when that is slower (NVMe, the cluster).
        """
        dst = self.port.fast_kind()
        total = 0.0
        for key in keys:
            src = self.port.kind_of(key)
            if src is None:
                continue
            if assume is not None and src not in (TierKind.NVME, TierKind.REMOTE):
                src = assume
            if src == dst:
                continue
            total += self.port.size_of(key) / self.bandwidth.get((src, dst), 1e9)
        return total

    def ready_prefix(self, keys: Sequence[bytes], now: float) -> int:
        """Blocks of the longest prefix of ``keys`` in the fastest tier whose page back
        (if any) finished by ``now`` (seconds), or that an engine still holds (it will not
        load them)."""
        n = 0
        for key in keys:
            rec = self._paged.get(key)
            if not self.port.in_fast(key) or (rec is not None and rec[2] > now):
                if not self.port.engine_holds(key):
                    break
            n += 1
        return n

    # ------------------------------------------------------------------ page back

    def page_back(self, w: Wait, now: float) -> bool:
        """Bring ``w``'s blocks into the fastest tier, head first (a partial page back
        still hits), but for those an engine still holds in its own cache: they are
        watched, and paged back when the engine drops them
        (:meth:`PrefetchScheduler.tick`), the ones in the fastest tier now too, since an
        engine-held copy there is a first victim meanwhile. Returns False when it stopped
        for lack of room, or waits for blocks the cluster is paging in: retry it later."""
        w.paged_back = w.started = True
        port = self.port
        dst = port.fast_kind()
        done = max(now, w.done_at)
        blocked = False
        if not w.paged_in:
            w.paged_in = blocked = self._page_in(w.keys)    # retried once the cluster's blocks are here
        protected = self._protected(w, now)
        for key in w.keys:
            src = port.kind_of(key)
            if src is None or src == TierKind.REMOTE:    # the cluster's: paged in above
                continue
            h = port.engine_hash(key)
            held = h is not None and port.engines.holds(h)
            if held:
                # the engine will not load it; if it drops it, it is paged back then (also
                # one in the fastest tier now: its copy there is a first victim meanwhile)
                self._skipped[h] = w.trajectory_id
            if src == dst:
                continue
            if held:
                self.stats.engine_held_skipped += 1
                continue
            nbytes = port.size_of(key)
            if not self._make_room(w, nbytes, now, protected):
                blocked = True
                break
            t0 = time.perf_counter()
            if not port.promote(key):
                blocked = True
                break
            elapsed = time.perf_counter() - t0
            hop = (src, dst)
            bw = self.bandwidth.get(hop, 1e9)
            if self.measure_bandwidth and elapsed > 0:
                self.bandwidth[hop] = bw = 0.8 * bw + 0.2 * (nbytes / elapsed)
            start = max(now, self._link_free.get(hop, now))
            finish = start + nbytes / bw
            self._link_free[hop] = finish
            done = max(done, finish)
            old = self._paged.get(key)
            if old is not None:            # paged back before and evicted since
                self.stats.waste_of(old[1], "evicted before the resume")
            self._paged[key] = (w.trajectory_id, nbytes, finish)
            self.stats.promoted_blocks += 1
            self.stats.promoted_bytes += nbytes
        w.done_at = done
        w.paged_back_at = min(w.paged_back_at, now)
        if self.protect_s > 0:
            self.protect(w, now)
        if blocked:
            self.stats.promotions_blocked += 1
            w.paged_back = False
        return not blocked

    def watches(self, engine_hashes: Sequence[int]) -> bool:
        """Whether a page back left one of ``engine_hashes`` to its engine (any thread:
        reads only; an empty list, which means "maybe everything", answers True)."""
        skipped = self._skipped
        return not engine_hashes or any(h in skipped for h in engine_hashes)

    def dropped_by_engines(self) -> set[str]:
        """Trajectories whose page back left out a block an engine has dropped since
        (every trajectory with such a block when the engines' list is incomplete)."""
        removed, everything = self.port.engines_dropped()
        if everything:
            tids = set(self._skipped.values())
            self._skipped.clear()
            return tids
        tids = set()
        for h in removed:
            tid = self._skipped.pop(h, None)
            if tid is not None:
                tids.add(tid)
        return tids

    def protect(self, w: Wait, now: float) -> None:
        """Hint ``w``'s prefix as needed within ``refresh_s``: kept until renewed."""
        self.sessions.expect(w.trajectory_id, w.keys, now + self.refresh_s, now, hinted_at=now, exact=True)

    def keep_headroom(self, now: float) -> None:
        """Demote blocks of the waits expected last, not paged back yet and not due, until
        ``headroom_fraction`` of the fastest tier is free."""
        port = self.port
        if self.headroom_fraction <= 0 or port.num_tiers() < 2:
            return
        want = self.headroom_fraction * port.fast_capacity_bytes()
        if port.fast_free_bytes() >= want:
            return
        later = sorted((w for w in self.waits.waits() if not w.paged_back and w.page_back_at > now),
                       key=lambda w: self.timeline.expect(w, now), reverse=True)
        for w in later:
            protected = self._protected(w, now, include_self=False)
            for key in reversed(w.keys):
                if port.fast_free_bytes() >= want:
                    return
                if port.in_fast(key) and not protected(key) and port.demote(key):
                    self._demoted(key)

    # ------------------------------------------------------------------ accounting

    def settle(self, w: Wait, used: bool = False) -> None:
        """``w`` ended (``used``: it resumed): its paged-back blocks count as used when
        still in the fastest tier, else as waste."""
        if self._skipped:
            for key in w.keys:
                h = self.port.engine_hash(key)
                if h is not None and self._skipped.get(h) == w.trajectory_id:
                    del self._skipped[h]
        for key in w.keys:
            rec = self._paged.get(key)
            if rec is None or rec[0] != w.trajectory_id:
                continue
            del self._paged[key]
            if used and self.port.in_fast(key):
                self.stats.used_bytes += rec[1]
            else:
                self.stats.waste_of(rec[1], "evicted before the resume" if used else "never resumed")

    def settle_all(self, waits: Iterable[Wait]) -> None:
        """End of a run: ``waits`` never resumed; every block paged back is waste."""
        for w in waits:
            self.settle(w)
        for rec in self._paged.values():
            self.stats.waste_of(rec[1], "never resumed")
        self._paged.clear()

    # ------------------------------------------------------------------ internals

    def _protected(self, w: Wait, now: float, include_self: bool = True) -> Callable[[bytes], bool]:
        """Keys that moving blocks for ``w`` must not evict: running trajectories', those
        paged back and not used yet, and those of trajectories expected to resume no later
        than ``w`` (``w``'s own unless ``include_self`` is false); none that an engine holds."""
        keep: set[bytes] = set()
        for keys in self.waits.running_keys():
            keep.update(keys)
        expect = self.timeline.expect
        mine = expect(w, now)
        for other in self.waits.waits():
            if other is w:
                if include_self:
                    keep.update(other.keys)
            elif expect(other, now) <= mine:
                keep.update(other.keys)
        keep.update(self._paged)          # paged back and not used yet: no ping-pong
        if self.port.engines is None:
            return keep.__contains__
        held = self.port.engine_holds     # an engine's copy serves it: never kept for it
        return lambda key: key in keep and not held(key)

    def _make_room(self, w: Wait, nbytes: int, now: float, protected: Callable[[bytes], bool]) -> bool:
        port = self.port
        if port.fast_fits(nbytes):
            return True
        need_in = self._distance(w, now)
        if need_in is None:
            # no predicted distances (LRU etc.): first the blocks of trajectories expected
            # to resume later than w (by a margin), not paged back yet, farthest first,
            # tail first
            expect = self.timeline.expect
            mine = expect(w, now)
            need_in = max(mine - now, 0.0)
            later = sorted((o for o in self.waits.waits()
                            if o is not w and not o.paged_back and expect(o, now) > mine + self.margin_s),
                           key=lambda o: expect(o, now), reverse=True)
            for o in later:
                for key in reversed(o.keys):
                    if port.fast_fits(nbytes):
                        return True
                    if port.in_fast(key) and not protected(key) and port.demote(key):
                        self._demoted(key)
        # the tier policy's choice among unprotected blocks, if needed later than w
        return port.make_room(nbytes, protected, need_in, now, self._demoted)

    def _distance(self, w: Wait, now: float) -> float | None:
        """Seconds until ``w``'s prefix is needed on the fastest tier policy's scale
        (``next_use``: its tail block's predicted distance); None without one."""
        d = self.port.distance(w.keys[-1], now) if w.keys else None
        return None if d is None else d * self.victim_margin

    def _demoted(self, key: bytes) -> None:
        self.stats.demoted_blocks += 1
        rec = self._paged.pop(key, None)
        if rec is not None:
            self.stats.waste_of(rec[1], "displaced by another promotion")

    def _page_in(self, keys: Sequence[bytes]) -> bool:
        """Ask for blocks held only in the cluster (the trajectory ran on another node) to
        be paged into the host arena, in the background (the caller holds the scheduler's
        lock); the (REMOTE, HOST) hop's bandwidth is measured. True when some were asked
        for: the page back is then retried once they are here."""
        hop = (TierKind.REMOTE, TierKind.HOST)

        def measured(paged: set[bytes], seconds: float) -> None:
            nbytes = sum(self.port.size_of(k) for k in paged)
            if self.measure_bandwidth and nbytes and seconds > 0:
                with self._lock:
                    self.bandwidth[hop] = 0.8 * self.bandwidth.get(hop, 1e9) + 0.2 * (nbytes / seconds)
        return self.port.page_in(keys, measured)
