"""Two-phase copies of blocks between tiers: a copy's life, and the copies in flight.

:class:`Transfers` owns every copy from start to end. Phase one
(:meth:`Transfers.start_locked`, catalogue lock held) pins the block and has room made
and reserved in the destination by the caller's ``reserve`` (the room-making of
:class:`kvstore.store.room.Room`); phase two (:meth:`Transfers.run`) copies the bytes
through the :class:`kvstore.store.mover.Mover` (inline, or on the ``(src, dst)`` queue
with the lock dropped) and commits or aborts; into a disk (a persistent local tier) the
commit runs with the bytes, without the lock (commits in flight then share the flushes
of an fsync'ed tier), and a copy found deleted or timed out afterwards is freed. A
failed promotion is judged as a read: a failed checksum drops the source copy. A copy
waited on past ``transfer_timeout_s`` is abandoned. Copies are deduplicated per ``(block,
destination)``: a second request for the same copy joins the one in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvstore.common.errors import BlockNotFound, CopyMissing, CorruptBlock, KVStoreError, TierIOError
from kvstore.policy import EvictionPolicy
from kvstore.store.catalogue import Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter
from kvstore.store.mover import Mover
from kvstore.store.placement import Placement

log = logging.getLogger("kvstore.store.placement")


@dataclass(eq=False)
class Transfer:
    """One copy of block ``key`` from tier index ``src`` to tier index ``dst``.

    ``entry`` is the source's catalogue entry (pinned while the copy runs). ``done`` is
    set when the copy committed (``ok``), failed (``error``, a store error) or was
    abandoned after a timeout (``abandoned``: its pin was dropped early; the destination
    reservation is dropped when the stuck I/O returns).
    """

    key: bytes
    src: int
    dst: int
    entry: Any
    reason: str = "copy"
    ok: bool = False
    error: BaseException | None = None
    abandoned: bool = False
    reserved: bool = False      # room reserved in ``dst``: the copy may run
    submitted: bool = False
    started: float = field(default_factory=time.monotonic)    # when phase one began (monotonic s)
    done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def finished(cls, key: bytes, src: int, dst: int) -> "Transfer":
        """A transfer with nothing to do (the destination already holds the block)."""
        t = cls(key, src, dst, None, ok=True, reserved=True)
        t.done.set()
        return t


class Transfers:
    """The copies between ``tiers`` in flight (see the module docstring).

    Args:
        tiers: the store's tiers (:class:`~kvstore.store.media.TierAdapter`), fastest first.
        policies: one per tier (a committed copy is inserted into its tier's policy).
        catalogue: its lock guards every transfer's state; placement: records committed copies.
        mover: moves the bytes; counters: ``transfers_failed``, ``transfers_timed_out``.
        clock: the policies' time (seconds).
        transfer_timeout_s: a copy waited on longer than this is abandoned (seconds).
    """

    def __init__(self, tiers: Sequence[TierAdapter], policies: Sequence[EvictionPolicy], catalogue: Catalogue,
                 placement: Placement, mover: Mover, counters: Counters, clock: Callable[[], float],
                 transfer_timeout_s: float):
        self.tiers = list(tiers)
        self.policies = list(policies)
        self.cat = catalogue
        self.placement = placement
        self.mover = mover
        self.counters = counters
        self.clock = clock
        self.transfer_timeout_s = transfer_timeout_s
        self._moving: dict[tuple[bytes, int], Transfer] = {}

    def moving(self, key: bytes, dst: int) -> Transfer | None:
        """The copy of ``key`` into tier ``dst`` in flight, if any (lock held)."""
        return self._moving.get((key, dst))

    def __len__(self) -> int:
        return len(self._moving)

    def start_locked(self, entry: Entry, src: int, dst: int, reason: str,
                     reserve: Callable[[int, bytes, int, bytes], None]) -> Transfer:
        """Phase one of a copy: pin the block, then ``reserve(dst, key, size, key)`` room
        for it in ``dst`` (:meth:`kvstore.store.room.Room.reserve_locked`).

        Returns the transfer already in flight for ``(key, dst)`` if there is one (a
        finished one when ``dst`` holds the block). ``reserve`` may drop the lock while it
        waits on a demotion; it raises TierFull / NoVictim / TierIOError, which this
        raises too. Raises TierIOError when an earlier copy of the block to ``dst`` is stuck.
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
        # Registered before room is made: making room may drop the lock while it waits
        # on a demotion, and another copy of this block to ``dst`` must join this one.
        t = Transfer(key, src, dst, entry, reason=reason)
        self._moving[(key, dst)] = t
        entry.pins += 1  # the source copy must stay while room is made below and bytes move
        try:
            reserve(dst, key, entry.size, key)
        except BaseException as e:
            self._moving.pop((key, dst), None)
            t.error = e
            t.done.set()
            self.cat.unpin(entry)
            self.cat.changed.notify_all()
            raise
        t.reserved = True
        return t

    def run(self, t: Transfer, wait: bool) -> None:
        """Phase two: copy the bytes, then commit. Lock held on entry (dropped while
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
                self._finish_locked(t, TierIOError(str(e)))
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
        committed = False
        dst = self.tiers[t.dst]
        try:
            self.mover.copy(t.key, t.src, t.dst)
            if not dst.volatile and dst.remote is None:
                # A disk's commit (rename, index, and with fsync the flushes) runs without
                # the lock, so commits of the copies in flight share one flush.
                dst.commit(t.key)
                committed = True
        except BaseException as e:  # noqa: BLE001 - reported through the transfer
            err = e
        with self.cat.lock:
            self._finish_locked(t, err, committed)

    def _finish_locked(self, t: Transfer, err: BaseException | None, committed: bool = False) -> None:
        self._moving.pop((t.key, t.dst), None)
        dst = self.tiers[t.dst]
        entry = t.entry
        gone = self.cat.raw(t.key) is not entry or entry.deleted     # deleted during the copy
        if err is None and not t.abandoned and not gone and not committed:
            try:
                dst.commit(t.key)
            except BaseException as e:  # noqa: BLE001
                err = e
        if err is not None or t.abandoned or gone:
            if committed:                    # committed without the lock, then deleted or timed out
                try:
                    dst.free(t.key)
                except KVStoreError as e:
                    log.warning("cannot free the copy of block %s in %s: %s", t.key.hex()[:16], dst.name, e)
            else:
                dst.abort(t.key)
            t.error = err or (TierIOError(f"transfer exceeded {self.transfer_timeout_s}s")
                              if t.abandoned else BlockNotFound("the block was deleted during the copy"))
            if err is not None or t.abandoned:
                self.counters.inc("transfers_failed")
                log.warning("copy of block %s from %s to %s failed: %s", t.key.hex()[:16],
                            self.tiers[t.src].name, dst.name, t.error)
            if t.reason == "promoted" and not gone and self.tiers[t.src].remote is None:
                self._promotion_failed_locked(t, err)
        else:
            self.policies[t.dst].insert(t.key, entry.size, self.clock())
            self.placement.add_copy(entry, t.dst, t.reason)
            t.ok = True
        if not t.abandoned:
            self.cat.unpin(entry)
        t.done.set()
        self.cat.changed.notify_all()

    def _promotion_failed_locked(self, t: Transfer, err: BaseException | None) -> None:
        """A promotion reads its (local) source copy, so its failure is judged as a read's
        (:mod:`kvstore.store.reads`): a failed checksum or malformed header proves the
        copy bad (dropped, ``corrupt_blocks``); a medium failing (TierIOError) proves
        nothing (kept, ``read_errors``)."""
        entry = t.entry
        if isinstance(err, CorruptBlock) and t.src in entry.tiers:
            missing = isinstance(err, CopyMissing)
            log.warning("dropping %s copy of block %s: %s", self.tiers[t.src].name, t.key.hex()[:16], err)
            self.counters.inc("copies_missing" if missing else "corrupt_blocks")
            self.placement.drop_copy(entry, t.src, "missing" if missing else "corrupt")
        elif isinstance(err, TierIOError):
            self.counters.inc("read_errors")

    def _abandon_locked(self, t: Transfer) -> None:
        if t.abandoned or t.done.is_set():
            return
        t.abandoned = True
        t.error = TierIOError(f"transfer did not finish in {self.transfer_timeout_s}s")
        self.counters.inc("transfers_timed_out")
        self.cat.unpin(t.entry)


__all__ = ["Transfer", "Transfers"]
