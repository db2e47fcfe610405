"""Tier-to-tier copies: one copy plan per (source, destination) pair, one queue per pair.

The store starts a copy (phase one, under the catalogue lock: the source is pinned,
room is reserved in the destination; :mod:`kvstore.store.transfers`), the
:class:`Mover` moves the bytes with no lock held (phase two), and the store commits.

How the bytes move is looked up once per pair in a registry keyed by (source medium,
destination medium), :data:`COPY_PLANS`, in the shape of vLLM's offloading worker
(handlers registered per medium pair). A tier's media come from its declared
capabilities (:class:`tiers.base.Capabilities`), never from probing attributes
(:func:`media_of`), preferred first; the plan is the first registered pair over the
source's media, then the destination's:

=======================  =============================================================
(source, destination)    copy
=======================  =============================================================
(DEVICE, FILES)          ``dst.write_from_device(src.device_array)`` (HBM -> NVMe, GDS)
(FILES, DEVICE)          ``src.read_into_device(dst.device_array)`` (NVMe -> HBM, GDS)
(HOST, BYTES)            ``dst.write(key, 0, src.view(key))`` (a zero-copy source)
(BYTES, HOST)            ``src.read_into(key, dst.write_view(key))`` (read straight into
                         the reservation: NVMe -> host arena)
(BYTES, BYTES)           through one bounded bounce buffer, in :data:`BOUNCE_BYTES` pieces
=======================  =============================================================

A destination with the ``remote`` capability (the cluster) then gets ``send(key)``: its
network put runs here, on the copy queue without the lock, so the commit that follows
(under the lock) is only bookkeeping. A plan raises store errors
(:func:`kvstore.store.media.translating`).

With ``async_moves`` each pair has its own worker threads (several into or out of a
persistent tier: a disk takes several writes at once, and a page-back keeps several
reads in flight), so a slow NVMe write never delays a host-to-HBM promotion. Without
it (the simulator) copies run inline, deterministically.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from tiers.base import Tier

from kvstore.store.media import translating

log = logging.getLogger("kvstore.store.mover")

BOUNCE_BYTES = 4 << 20
"""Piece size of a copy between two tiers that cannot address each other (bytes)."""

CopyFn = Callable[[bytes], None]
"""``copy(key)``: fill the destination's reservation of ``key`` from the source's copy."""


class Medium(enum.Enum):
    """How a copy reaches a tier's bytes (from :class:`tiers.base.Capabilities`)."""

    DEVICE = "device"       # GPU arrays (``device``: the HBM tier)
    FILES = "files"         # files the GPU reads and writes directly (``device_files``: GDS)
    HOST = "host"           # host memory this process addresses (``host``)
    BYTES = "bytes"         # any tier: ``read_into`` and ``write``


def media_of(tier: Tier) -> tuple[Medium, ...]:
    """The media ``tier`` offers a copy, preferred first; always ends with BYTES."""
    caps = tier.capabilities
    media = [m for m, cap in ((Medium.DEVICE, caps.device), (Medium.FILES, caps.device_files),
                              (Medium.HOST, caps.host)) if cap is not None]
    return (*media, Medium.BYTES)


COPY_PLANS: dict[tuple[Medium, Medium], tuple[str, Callable[[Tier, Tier], CopyFn]]] = {}
"""(source medium, destination medium) -> (plan name, ``make(src, dst) -> copy``)."""


def register(src: Medium, dst: Medium, name: str):
    """Register ``make(src_tier, dst_tier) -> copy`` as the plan of the ``(src, dst)`` pair."""
    def add(make: Callable[[Tier, Tier], CopyFn]) -> Callable[[Tier, Tier], CopyFn]:
        COPY_PLANS[(src, dst)] = (name, make)
        return make
    return add


@register(Medium.DEVICE, Medium.FILES, "device->files")
def _device_to_files(src: Tier, dst: Tier) -> CopyFn:
    dev, files = src.capabilities.device, dst.capabilities.device_files
    return lambda key: files.write_from_device(key, dev.device_array(key))


@register(Medium.FILES, Medium.DEVICE, "files->device")
def _files_to_device(src: Tier, dst: Tier) -> CopyFn:
    files, dev = src.capabilities.device_files, dst.capabilities.device

    def copy(key: bytes) -> None:
        dev.mark_written(key, files.read_into_device(key, dev.device_array(key)))
    return copy


@register(Medium.HOST, Medium.BYTES, "view->write")
def _view_to_write(src: Tier, dst: Tier) -> CopyFn:
    view = src.capabilities.host.view
    return lambda key: dst.write(key, 0, view(key))


@register(Medium.BYTES, Medium.HOST, "read->reservation")
def _read_to_reservation(src: Tier, dst: Tier) -> CopyFn:
    host = dst.capabilities.host

    def copy(key: bytes) -> None:
        host.mark_written(key, src.read_into(key, host.write_view(key)))
    return copy


@register(Medium.BYTES, Medium.BYTES, "bounce")
def _bounce(src: Tier, dst: Tier) -> CopyFn:
    def copy(key: bytes) -> None:
        size = src.size_of(key)
        buf = np.empty(min(size, BOUNCE_BYTES), dtype=np.uint8)
        for off in range(0, size, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, size - off)
            src.read_into(key, buf, [(off, n)])
            dst.write(key, off, buf[:n])
    return copy


def copy_plan(src: Tier, dst: Tier) -> tuple[str, CopyFn]:
    """How blocks move from ``src`` to ``dst``: ``(name, copy(key))`` from :data:`COPY_PLANS`.
    The destination holds a reservation of the block's size; the caller commits. The
    copy raises media errors (:mod:`tiers.errors`)."""
    name, copy = _registered(src, dst)
    remote = dst.capabilities.remote
    if remote is None:
        return name, copy

    def copy_then_send(key: bytes) -> None:
        copy(key)
        remote.send(key)
    return name + "+send", copy_then_send


def _registered(src: Tier, dst: Tier) -> tuple[str, CopyFn]:
    dst_media = media_of(dst)
    for s in media_of(src):
        for d in dst_media:
            plan = COPY_PLANS.get((s, d))
            if plan is not None:
                return plan[0], plan[1](src, dst)
    raise LookupError(f"no copy plan from {src.name} to {dst.name}")   # pragma: no cover - BYTES pairs always


class _Queue:
    """A FIFO of jobs run by ``workers`` daemon threads."""

    def __init__(self, name: str, workers: int = 1):
        self.name = name
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)      # a job queued, or stopping: wakes a worker
        self._idle = threading.Condition(lock)      # nothing queued or running: wakes drain()
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
                    if not self._busy and not self._jobs:
                        self._idle.notify_all()     # the idle workers sleep on: one wake-up per job ended

    def drain(self, deadline: float) -> bool:
        with self._cond:
            while self._jobs or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
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
        disk_workers: copies in flight per pair with a persistent end (NVMe, remote:
            the medium serves several writes, or reads of a page-back, at once, and file
            I/O and checksums run without the GIL); pairs between memories get one worker.
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
            name, copy = copy_plan(self.tiers[src], self.tiers[dst])
            plan = self._plans[(src, dst)] = (name, translating(copy))
        return plan

    def copy(self, key: bytes, src: int, dst: int) -> None:
        """Fill ``dst``'s reservation of ``key`` from its committed copy in ``src``.
        Raises store errors (TierFull, TierIOError, ...: :mod:`kvstore.store.media`)."""
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
                memory = self.tiers[dst].volatile and self.tiers[src].volatile
                workers = 1 if memory else self.disk_workers
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
