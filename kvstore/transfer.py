"""Tier-to-tier transfers: one record per copy and one worker queue per (source, destination).

A :class:`Transfer` is created by the manager with the block pinned in its source
tier and room reserved in the destination (phase one, under the manager lock). Its
bytes are copied by the worker thread of the ``(src, dst)`` queue with no lock held
(phase two), and committed under the lock. Separate queues per pair mean a slow
NVMe write never delays a host-to-HBM promotion, and a Get served from where a block
already is never waits on either.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("kvstore.transfer")


@dataclass(eq=False)
class Transfer:
    """One copy of a block from tier index ``src`` to tier index ``dst``.

    ``data`` carries the bytes when the caller already has them (a promotion after a
    read), so the source is not read twice. ``done`` is set when the copy committed
    (``ok``), failed (``error``) or was abandoned after a timeout (``abandoned``:
    its source pin was released early and the destination reservation is dropped
    when the I/O returns).
    """

    key: bytes
    src: int
    dst: int
    entry: Any
    data: bytes | None = None
    ok: bool = False
    error: BaseException | None = None
    abandoned: bool = False
    submitted: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def finished(cls, key: bytes, src: int, dst: int) -> "Transfer":
        """A transfer that has nothing to do (the destination already holds the block)."""
        t = cls(key, src, dst, None, ok=True)
        t.done.set()
        return t


class _Queue:
    """A FIFO of jobs run by one daemon thread."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvstore-transfer-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"transfer queue {self.name} is stopped")
            self._jobs.append(job)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed job must not kill the queue
                log.exception("transfer job on %s failed", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

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
        self._thread.join(max(0.0, deadline - time.monotonic()))


class TransferQueues:
    """Worker queues keyed by ``(src, dst)`` tier indices, created on first use."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], _Queue] = {}
        self._lock = threading.Lock()

    def submit(self, src: int, dst: int, job: Callable[[], None]) -> None:
        with self._lock:
            q = self._queues.get((src, dst))
            if q is None:
                q = self._queues[(src, dst)] = _Queue(f"{src}to{dst}")
        q.submit(job)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queue is empty and idle. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                queues = list(self._queues.values())
            if not all(q.drain(deadline) for q in queues):
                return False
            if all(q.idle() for q in queues):
                return True

    def stop(self, timeout: float = 30.0) -> None:
        """Run what is queued, then stop the worker threads."""
        deadline = time.monotonic() + timeout
        with self._lock:
            queues = list(self._queues.values())
        for q in queues:
            q.stop(deadline)
