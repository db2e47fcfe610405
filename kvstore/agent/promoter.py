"""The moving half of the prefetch scheduler: promotion, room making, protection.

:class:`PromotionMixin` is mixed into :class:`kvstore.agent.prefetch.PrefetchScheduler`; it
uses the scheduler's state (``port``, ``_waiting``, ``_active``, ``_promoted``,
``_link_free``, ``bandwidth``, ``stats``, ``sessions``, ``predictor``, options) and its
``_expect`` (expected resume time). Every block move goes through the
:class:`~kvstore.agent.store_port.ManagerPort`.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Callable, Sequence

from tiers.base import TierKind

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.agent.prefetch import _Waiting

_PROMOTE, _REFRESH = 0, 1   # the scheduler's due-queue actions


class PromotionMixin:
    """Promotion of waiting trajectories' prefixes into the fastest tier."""

    def transfer_seconds(self, keys: Sequence[bytes], assume: TierKind | None = None) -> float:
        """Seconds to bring ``keys`` into tier 0 at the current hop bandwidths.

        ``assume``: plan for the worst plausible case, every block (even one in tier 0
        now, which may be demoted while it waits) one hop away in tier ``assume``, or
        where it is when that is slower (NVMe, the cluster).
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

    def _protected(self, w: _Waiting, now: float, include_self: bool = True) -> Callable[[bytes], bool]:
        """Keys that moving blocks for ``w`` must not evict: running trajectories', those
        already promoted, and those of trajectories expected to resume no later than
        ``w`` (``w``'s own unless ``include_self`` is false)."""
        keep: set[bytes] = set()
        for _, keys in self._active.values():
            keep.update(keys)
        mine = self._expect(w, now)
        for other in self._waiting.values():
            if other is w:
                if include_self:
                    keep.update(other.keys)
            elif self._expect(other, now) <= mine:
                keep.update(other.keys)
        keep.update(self._promoted)          # promoted and not used yet: no ping-pong
        return keep.__contains__

    def _make_room(self, w: _Waiting, nbytes: int, now: float, protected: Callable[[bytes], bool]) -> bool:
        port = self.port
        if port.fast_fits(nbytes):
            return True
        need_in = self._distance(w, now)
        if need_in is None:
            # no predicted distances (LRU etc.): first the blocks of trajectories expected
            # to resume later than w (by a margin), not promoted yet, farthest first,
            # tail first
            mine = self._expect(w, now)
            need_in = max(mine - now, 0.0)
            later = sorted((o for o in self._waiting.values()
                            if o is not w and not o.promoted and self._expect(o, now) > mine + self.margin_s),
                           key=lambda o: self._expect(o, now), reverse=True)
            for o in later:
                for key in reversed(o.keys):
                    if port.fast_fits(nbytes):
                        return True
                    if port.in_fast(key) and not protected(key) and port.demote(key):
                        self._demoted(key)
        # the tier policy's choice among unprotected blocks, if needed later than w
        return port.make_room(nbytes, protected, need_in, now, self._demoted)

    def _distance(self, w: _Waiting, now: float) -> float | None:
        """Seconds until ``w``'s prefix is needed on the fastest tier policy's scale
        (``next_use``: its tail block's predicted distance); None without one."""
        d = self.port.distance(w.keys[-1], now) if w.keys else None
        return None if d is None else d * self.victim_margin

    def _demoted(self, key: bytes) -> None:
        self.stats.demoted_blocks += 1
        rec = self._promoted.pop(key, None)
        if rec is not None:
            self.stats.waste_of(rec[1], "displaced by another promotion")

    def _page_in(self, keys: Sequence[bytes]) -> bool:
        """Ask for blocks held only in the cluster (the trajectory ran on another node) to
        be paged into the host arena, in the background (this thread holds the scheduler
        lock); the (REMOTE, HOST) hop's bandwidth is measured. True when some were asked
        for: the promotion is then retried once they are here."""
        hop = (TierKind.REMOTE, TierKind.HOST)

        def measured(paged: set[bytes], seconds: float) -> None:
            nbytes = sum(self.port.size_of(k) for k in paged)
            if self.measure_bandwidth and nbytes and seconds > 0:
                with self._lock:
                    self.bandwidth[hop] = 0.8 * self.bandwidth.get(hop, 1e9) + 0.2 * (nbytes / seconds)
        return self.port.page_in(keys, measured)

    def _promote(self, w: _Waiting, now: float) -> None:
        """Bring ``w``'s blocks into tier 0, head first; retry later if room ran out."""
        w.promoted = w.started = True
        port = self.port
        dst = port.fast_kind()
        done = max(now, w.done_at)
        blocked = False
        if not w.paged_in:
            w.paged_in = blocked = self._page_in(w.keys)    # retried once the cluster's blocks are here
        protected = self._protected(w, now)
        for key in w.keys:                # head first: a partial promotion still hits
            src = port.kind_of(key)
            if src is None or src == dst or src == TierKind.REMOTE:    # the cluster's: paged in above
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
            old = self._promoted.get(key)
            if old is not None:            # promoted before and evicted since
                self.stats.waste_of(old[1], "evicted before the resume")
            self._promoted[key] = (w.trajectory_id, nbytes, finish)
            self.stats.promoted_blocks += 1
            self.stats.promoted_bytes += nbytes
        w.done_at = done
        w.promoted_at = min(w.promoted_at, now)
        if self.protect_s > 0:
            self._protect(w, now)
        if blocked:
            self.stats.promotions_blocked += 1
            w.promoted = False
            heapq.heappush(self._due, (now + self.retry_s, w.seq, w.trajectory_id, _PROMOTE))

    def _protect(self, w: _Waiting, now: float) -> None:
        """Hint ``w``'s prefix as needed within ``refresh_s``: kept until renewed."""
        self.sessions.expect(w.trajectory_id, w.keys, now + self.refresh_s, now, hinted_at=now, exact=True)

    def _keep_headroom(self, now: float) -> None:
        port = self.port
        if port.num_tiers() < 2:
            return
        want = self.headroom_fraction * port.fast_capacity_bytes()
        if port.fast_free_bytes() >= want:
            return
        later = sorted((w for w in self._waiting.values() if not w.promoted and w.promote_at > now),
                       key=lambda w: self._expect(w, now), reverse=True)
        for w in later:
            protected = self._protected(w, now, include_self=False)
            for key in reversed(w.keys):
                if port.fast_free_bytes() >= want:
                    return
                if port.in_fast(key) and not protected(key) and port.demote(key):
                    self._demoted(key)
