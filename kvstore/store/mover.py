"""Tier-to-tier copies: one copy plan per (source, destination) pair, one queue per pair.

The manager starts a copy (phase one, under the catalogue lock: the source is pinned,
room is reserved in the destination), the :class:`Mover` moves the bytes with no lock
held (phase two), and the manager commits. How the bytes move is decided once per
pair from the tiers' declared capabilities (:class:`tiers.base.Capabilities`), never
by probing attributes:

=============================================  =========================================
pair (by capability)                           copy
=============================================  =========================================
device source -> device_files destination     ``dst.write_from_device(src.device_array)``
                                               (HBM -> NVMe by GPUDirect Storage)
device_files source -> device destination     ``src.read_into_device(dst.device_array)``
                                               (NVMe -> HBM by GPUDirect Storage)
host source (zero-copy view)                   ``dst.write(key, 0, src.view(key))``
host destination (writable reservation)        ``src.read_into(key, dst.write_view(key))``
                                               (NVMe -> host arena: read straight in)
anything else                                  through one bounded bounce buffer, in
                                               :data:`BOUNCE_BYTES` pieces
=============================================  =========================================

A destination with the ``remote`` capability (the cluster) then gets ``send(key)``: its
network put runs here, on the copy queue without the lock, so the commit that follows
(under the lock) is only bookkeeping.

With ``async_moves`` each pair has its own worker threads (several into a persistent
tier: a disk takes several writes at once), so a slow NVMe write never delays a
host-to-HBM promotion. Without it (the simulator) copies run
inline, deterministically.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from tiers.base import Tier

log = logging.getLogger("kvstore.store.mover")

BOUNCE_BYTES = 4 << 20
"""Piece size of a copy between two tiers that cannot address each other (bytes)."""

CopyFn = Callable[[bytes], None]


@dataclass(eq=False)
class Transfer:
    """One copy of block ``key`` from tier index ``src`` to tier index ``dst``.

    ``entry`` is the source's catalogue entry (pinned while the copy runs). ``done`` is
    set when the copy committed (``ok``), failed (``error``) or was abandoned after a
    timeout (``abandoned``: its pin was released early; the destination reservation is
    dropped when the stuck I/O returns). ``waiters`` counts requests deduplicated onto it.
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
    done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def finished(cls, key: bytes, src: int, dst: int) -> "Transfer":
        """A transfer with nothing to do (the destination already holds the block)."""
        t = cls(key, src, dst, None, ok=True, reserved=True)
        t.done.set()
        return t


def copy_plan(src: Tier, dst: Tier) -> tuple[str, CopyFn]:
    """How blocks move from ``src`` to ``dst``: ``(name, copy(key))``. The destination
    holds a reservation of the block's size; the caller commits."""
    name, copy = _byte_plan(src, dst)
    remote = dst.capabilities.remote
    if remote is None:
        return name, copy

    def copy_then_send(key: bytes) -> None:
        copy(key)
        remote.send(key)
    return name + "+send", copy_then_send


def _byte_plan(src: Tier, dst: Tier) -> tuple[str, CopyFn]:
    sc, dc = src.capabilities, dst.capabilities
    if sc.device is not None and dc.device_files is not None:
        dev, files = sc.device, dc.device_files
        return "device->files", lambda key: files.write_from_device(key, dev.device_array(key))
    if sc.device_files is not None and dc.device is not None:
        files, dev = sc.device_files, dc.device

        def files_to_device(key: bytes) -> None:
            dev.mark_written(key, files.read_into_device(key, dev.device_array(key)))
        return "files->device", files_to_device
    if sc.host is not None:
        view = sc.host.view
        return "view->write", lambda key: dst.write(key, 0, view(key))
    if dc.host is not None:
        host = dc.host

        def read_in_place(key: bytes) -> None:
            host.mark_written(key, src.read_into(key, host.write_view(key)))
        return "read->reservation", read_in_place

    def bounce(key: bytes) -> None:
        size = src.size_of(key)
        buf = np.empty(min(size, BOUNCE_BYTES), dtype=np.uint8)
        for off in range(0, size, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, size - off)
            src.read_into(key, buf, [(off, n)])
            dst.write(key, off, buf[:n])
    return "bounce", bounce


class _Queue:
    """A FIFO of jobs run by ``workers`` daemon threads."""

    def __init__(self, name: str, workers: int = 1):
        self.name = name
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, name=f"kvstore-transfer-{name}-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"transfer queue {self.name} is stopped")
            self._jobs.append(job)
            self._cond.notify()

    def __len__(self) -> int:
        return len(self._jobs) + self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy += 1
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed job must not kill the queue
                log.exception("transfer job on %s failed", self.name)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def drain(self, deadline: float) -> bool:
        with self._cond:
            while self._jobs or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def stop(self, deadline: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Mover:
    """Copies blocks between ``tiers`` (indices into that list).

    Args:
        tiers: the store's tiers, fastest first.
        async_moves: run copies on worker threads per (source, destination) pair.
        disk_workers: copies in flight per pair whose destination is persistent (NVMe,
            remote: the medium serves several writes at once, and file I/O and checksums
            release the GIL); pairs into memory get one worker.
    """

    def __init__(self, tiers: Sequence[Tier], async_moves: bool, disk_workers: int = 4):
        self.tiers = list(tiers)
        self.async_moves = async_moves
        self.disk_workers = disk_workers
        self._plans: dict[tuple[int, int], tuple[str, CopyFn]] = {}
        self._queues: dict[tuple[int, int], _Queue] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def plan(self, src: int, dst: int) -> str:
        """Name of the copy plan of a pair (for logs and tests)."""
        return self._plan(src, dst)[0]

    def _plan(self, src: int, dst: int) -> tuple[str, CopyFn]:
        plan = self._plans.get((src, dst))
        if plan is None:
            plan = self._plans[(src, dst)] = copy_plan(self.tiers[src], self.tiers[dst])
        return plan

    def copy(self, key: bytes, src: int, dst: int) -> None:
        """Fill ``dst``'s reservation of ``key`` from its committed copy in ``src``.
        Raises tier errors (:mod:`tiers.errors`)."""
        self._plan(src, dst)[1](key)

    def submit(self, src: int, dst: int, job: Callable[[], None]) -> None:
        """Run ``job`` on the ``(src, dst)`` queue (inline without ``async_moves``).
        Raises RuntimeError once the mover is stopped."""
        if not self.async_moves:
            job()
            return
        with self._lock:
            if self._stopped:
                raise RuntimeError("the mover is stopped")
            q = self._queues.get((src, dst))
            if q is None:
                workers = 1 if self.tiers[dst].volatile else self.disk_workers
                q = self._queues[(src, dst)] = _Queue(f"{self.tiers[src].name}-to-{self.tiers[dst].name}", workers)
        q.submit(job)

    def backlog(self, src: int, dst: int) -> int:
        """Jobs queued or running on the ``(src, dst)`` queue."""
        q = self._queues.get((src, dst))
        return len(q) if q is not None else 0

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queue is empty and idle. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                queues = list(self._queues.values())
            if not all(q.drain(deadline) for q in queues):
                return False
            if all(len(q) == 0 for q in queues):
                return True

    def stop(self, timeout: float = 30.0) -> None:
        """Run what is queued, then stop the worker threads."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopped = True
            queues = list(self._queues.values())
        for q in queues:
            q.stop(deadline)
