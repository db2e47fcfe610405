"""Two-phase copies of blocks between tiers, and promotion: the transfers of a Placement.

:class:`TransferMixin` is mixed into :class:`kvstore.store.placement.Placement`. It owns a
copy's life: phase one pins the block, makes room in the destination and reserves it
(:meth:`~TransferMixin.start_transfer_locked`); phase two copies the bytes through the
:class:`kvstore.store.mover.Mover` (inline, or on the ``(src, dst)`` queue) and commits or
aborts (:meth:`~TransferMixin.run_transfer`); a copy waited on past
``transfer_timeout_s`` is abandoned. Copies are deduplicated per ``(block,
destination)``; :meth:`~TransferMixin.promote` is the one promotion path. It uses the
placement's ``tiers``, ``policies``, ``cat``, ``mover``, ``counters``, ``clock``,
``transfer_timeout_s``, ``_moving``, ``reserve_locked`` and ``add_copy``.
"""

from __future__ import annotations

import logging
import time

from tiers import errors as terr

from kvstore.store.catalogue import Entry
from kvstore.common.errors import TierFull, TierIOError
from kvstore.store.mover import Transfer
from kvstore.policy import NoVictim

log = logging.getLogger("kvstore.store.placement")


class TransferMixin:
    """Block copies between tiers (see the module docstring); the catalogue lock rules of
    :mod:`kvstore.store.placement` apply."""

    def moving(self, key: bytes, dst: int) -> Transfer | None:
        return self._moving.get((key, dst))

    def start_transfer_locked(self, entry: Entry, src: int, dst: int, reason: str) -> Transfer:
        """Phase one of a copy: pin the block, make room in ``dst`` and reserve it.

        Returns the transfer already in flight for ``(key, dst)`` if there is one.
        Raises TierFull / NoVictim when ``dst`` cannot make room, TierIOError when an
        earlier copy of the block to ``dst`` is stuck.
        """
        key = entry.key
        existing = self._moving.get((key, dst))
        if existing is not None:
            if existing.abandoned:
                raise TierIOError(f"an earlier copy of block {key.hex()[:16]} to {self.tiers[dst].name} "
                                  "is stuck (timed out); not retrying until it returns")
            return existing
        if dst in entry.tiers:
            return Transfer.finished(key, src, dst)
        # Registered before room is made: making room may release the lock while it waits
        # on a demotion, and another copy of this block to ``dst`` must join this one.
        t = Transfer(key, src, dst, entry, reason=reason)
        self._moving[(key, dst)] = t
        entry.pins += 1  # the source copy must stay while room is made below and bytes move
        try:
            self.reserve_locked(dst, key, entry.size, incoming=key)
        except BaseException as e:
            self._moving.pop((key, dst), None)
            t.error = e
            t.done.set()
            self.cat.unpin(entry)
            self.cat.changed.notify_all()
            raise
        t.reserved = True
        return t

    def run_transfer(self, t: Transfer, wait: bool) -> None:
        """Phase two: copy the bytes, then commit. Lock held on entry (released while
        waiting). Async: the copy runs on the ``(src, dst)`` queue; with ``wait`` this
        waits up to ``transfer_timeout_s`` (then the transfer is abandoned)."""
        if t.done.is_set():
            return
        if not t.reserved:                # joined a copy still making room: wait for it
            if wait:
                deadline = time.monotonic() + self.transfer_timeout_s
                while not t.done.is_set() and not t.reserved and time.monotonic() < deadline:
                    self.cat.changed.wait(max(0.0, deadline - time.monotonic()))
            if not t.reserved:
                return
        if not self.mover.async_moves:
            self._copy_bytes(t)
            return
        if not t.submitted:
            t.submitted = True
            try:
                self.mover.submit(t.src, t.dst, lambda: self._copy_bytes(t))
            except RuntimeError as e:        # the mover is stopped: the store is closing
                self._finish_locked(t, terr.MediaIOError(str(e)))
                return
        if not wait:
            return
        deadline = time.monotonic() + self.transfer_timeout_s
        while not t.done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon_locked(t)
                return
            self.cat.changed.wait(remaining)

    def _copy_bytes(self, t: Transfer) -> None:
        err: BaseException | None = None
        try:
            self.mover.copy(t.key, t.src, t.dst)
        except BaseException as e:  # noqa: BLE001 - reported through the transfer
            err = e
        with self.cat.lock:
            self._finish_locked(t, err)

    def _finish_locked(self, t: Transfer, err: BaseException | None) -> None:
        self._moving.pop((t.key, t.dst), None)
        dst = self.tiers[t.dst]
        entry = t.entry
        gone = self.cat.raw(t.key) is not entry or entry.deleted     # deleted during the copy
        if err is None and not t.abandoned and not gone:
            try:
                dst.commit(t.key)
            except BaseException as e:  # noqa: BLE001
                err = e
        if err is not None or t.abandoned or gone:
            dst.abort(t.key)
            t.error = err or (terr.MediaIOError(f"transfer exceeded {self.transfer_timeout_s}s")
                              if t.abandoned else terr.MediaError("the block was deleted during the copy"))
            if err is not None or t.abandoned:
                self.counters.inc("transfers_failed")
                log.warning("copy of block %s from %s to %s failed: %s", t.key.hex()[:16],
                            self.tiers[t.src].name, dst.name, t.error)
        else:
            self.policies[t.dst].insert(t.key, entry.size, self.clock())
            self.add_copy(entry, t.dst, t.reason)
            t.ok = True
        if not t.abandoned:
            self.cat.unpin(entry)
        t.done.set()
        self.cat.changed.notify_all()

    def _abandon_locked(self, t: Transfer) -> None:
        if t.abandoned or t.done.is_set():
            return
        t.abandoned = True
        t.error = terr.MediaIOError(f"transfer did not finish in {self.transfer_timeout_s}s")
        self.counters.inc("transfers_timed_out")
        self.cat.unpin(t.entry)

    def copy_locked(self, entry: Entry, src: int, dst: int, reason: str) -> None:
        """Copy a committed block from ``src`` into ``dst`` and wait for it.
        Raises TierFull / NoVictim / TierIOError."""
        t = self.start_transfer_locked(entry, src, dst, reason)
        self.run_transfer(t, wait=True)
        if not t.ok:
            raise TierIOError(f"copy of block {entry.key.hex()[:16]} to {self.tiers[dst].name} failed: {t.error}")

    def promote(self, entry: Entry, to: int, wait: bool) -> Transfer | None:
        """Copy ``entry`` up into tier ``to`` from its fastest copy: THE promotion path
        (after a read, by prefetch, for a lease). Deduplicated: a block already moving
        there joins that transfer. Returns the transfer (None when no room could be made
        without evicting pinned blocks: counted in ``promotions_skipped``)."""
        with self.cat.lock:
            if entry.deleted or to in entry.tiers or not entry.tiers:
                return Transfer.finished(entry.key, to, to)
            existing = self._moving.get((entry.key, to))
            if existing is not None:
                self.counters.inc("promotions_deduplicated")
                t = existing
            else:
                src = entry.tiers[0]
                try:
                    t = self.start_transfer_locked(entry, src, to, "promoted")
                except (TierFull, NoVictim, TierIOError) as e:
                    self.counters.inc("promotions_skipped")
                    log.debug("promotion of %s skipped: %s", entry.key.hex()[:16], e)
                    return None
                self.counters.inc("promotions")
            self.run_transfer(t, wait=wait)
            return t
