"""Response streams read with the client's own deadline.

grpcio's deadline does not always end a response stream. Seen with grpcio 1.85: a
``GetRaw`` stream to a daemon that stopped in the same process (GOAWAY, "Cancelling all
calls") got its UNAVAILABLE status, but its pending receive-metadata and receive-message
operations never completed, so ``next()`` on the call waited for ever: the call had
ended, and no deadline was left to end it (``_MultiThreadedRendezvous._next`` waits for
the message operation, not for the status). A cancel cannot end that wait either.

:class:`StreamReaders` therefore reads a call's messages on a reader thread and hands
them to the caller, who waits for each with the call's own deadline (plus
:data:`GRACE_S`, so that grpcio's deadline ends an ordinary slow call first). When the
deadline passes the caller cancels the call and raises
:class:`~kvstore.common.errors.StoreUnavailable`: a daemon that is gone or stuck costs a
bounded miss, never a stall. A call that ends with an error status raises it as soon as
the status comes (what the stream still had to give would be dropped with the error
anyway): the stuck stream above ends at once. A reader left waiting on such a call is lost (a daemon thread: it
never holds up the process's exit); the next call gets another. A reader reads at most
:data:`READ_AHEAD` messages ahead of its caller, so a slow caller still slows the
daemon's sending as gRPC's flow control did. A new reader gets its first stream handed to
it, so one that cannot start (out of threads) fails that read alone; a forked child starts
with no readers.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from typing import Iterator

import grpc

log = logging.getLogger("kvstore.client")

GRACE_S = 1.0
"""Seconds past a stream's deadline that the client waits for gRPC to end it before it
cancels the call itself and gives up on it."""

READ_AHEAD = 4
"""Messages a reader takes from gRPC ahead of its caller."""

IDLE_S = 30.0
"""Seconds an idle reader thread waits for another stream before it ends."""

_END = object()

_ALL: "weakref.WeakSet[StreamReaders]" = weakref.WeakSet()


class StreamEnded(Exception):
    """The caller's deadline passed before the stream ended (the call was cancelled)."""


class StreamReaders:
    """Reader threads for response streams (see the module docstring): daemon threads,
    reused while they are idle, one more started whenever none is idle.

    Args:
        name: the threads' name prefix; grace_s: :data:`GRACE_S`.
    """

    def __init__(self, name: str = "kvstore-stream", grace_s: float = GRACE_S):
        self._name = name
        self.grace_s = grace_s
        self._started = 0
        self._closed = False
        self._fresh()
        _ALL.add(self)

    @staticmethod
    def after_fork_in_child() -> None:
        """A forked child starts every client's readers afresh: the parent's threads (and
        any lock one of them held at the fork) stayed behind (an ``os.register_at_fork`` hook)."""
        for readers in list(_ALL):
            readers._fresh()

    def _fresh(self) -> None:
        """No reader (at start, and in a forked child: the readers and any lock holder stayed behind)."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0                  # readers waiting for a job that no job is promised to

    def read(self, call, timeout: float | None) -> Iterator:
        """The messages of ``call`` (a gRPC response stream, already started with deadline
        ``timeout`` seconds), in order. Raises what the call raises
        (:class:`grpc.RpcError`; an error status as soon as it comes, even while a message
        is still awaited), ValueError once :meth:`close` was called, and
        :class:`StreamEnded` when no message or end came within ``timeout`` +
        ``grace_s`` seconds of this call (the call is then cancelled). Stopping the
        iteration early cancels the call."""
        due = None if timeout is None else time.monotonic() + timeout + self.grace_s
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        slots = threading.Semaphore(READ_AHEAD)
        given_up = threading.Event()

        def pump() -> None:
            messages = None
            while True:
                while not slots.acquire(timeout=0.5):   # the caller is READ_AHEAD behind
                    if given_up.is_set():
                        return
                if given_up.is_set():
                    return
                try:
                    if messages is None:
                        messages = iter(call)
                    message = next(messages)
                except StopIteration:
                    inbox.put(_END)
                    return
                except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
                    inbox.put(e)
                    return
                inbox.put(message)

        def ended(c) -> None:           # on gRPC's thread when the call has its status
            if c.code() is not grpc.StatusCode.OK:
                inbox.put(c)            # failed: nothing after it matters; raise it now
        finished = False
        try:
            self._submit(pump)
            call.add_done_callback(ended)
            while True:
                try:
                    item = inbox.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
                except queue.Empty:
                    raise StreamEnded(f"the stream did not end within its deadline ({timeout:g} s) "
                                      f"and {self.grace_s:g} s more") from None
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                slots.release()
                yield item
        finally:
            given_up.set()                      # the reader stops taking messages for nobody
            if not finished:
                call.cancel()

    def _submit(self, job) -> None:
        """Hand ``job`` to an idle reader, or to a new one (which takes nothing else first:
        a reader that fails to start leaves no job behind)."""
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            if self._idle:
                self._idle -= 1                 # an idle reader takes it
                self._jobs.put(job)
                return
            self._started += 1
            n = self._started
        threading.Thread(target=self._work, args=(job,), name=f"{self._name}-{n}", daemon=True).start()

    def _work(self, job) -> None:
        while True:
            try:
                job()
            except BaseException:  # noqa: BLE001 - a reader outlives a job that failed
                log.exception("a stream reader's job failed")
            with self._lock:
                if self._closed:
                    return
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=IDLE_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._jobs.empty():
                            self._idle -= 1     # idle and promised nothing: this reader ends
                            return
                    # a job promised to an idle reader is on its way: take it
            if job is None:                     # closed
                return

    def close(self) -> None:
        """Take no more streams; idle readers end (one left waiting on a call stays with it)."""
        with self._lock:
            self._closed = True
            for _ in range(self._idle):
                self._jobs.put(None)
            self._idle = 0


os.register_at_fork(after_in_child=StreamReaders.after_fork_in_child)

__all__ = ["GRACE_S", "READ_AHEAD", "StreamEnded", "StreamReaders"]
