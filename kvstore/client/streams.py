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
anyway): the stuck stream above ends at once. A reader left waiting on such a call is lost; the pool
starts another for the next call (at most :data:`MAX_READERS`; past that, calls wait
for a reader within their deadline).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc

GRACE_S = 1.0
"""Seconds past a stream's deadline that the client waits for gRPC to end it before it
cancels the call itself and gives up on it."""

MAX_READERS = 32
"""Reader threads of one client at most (readers are reused; one stays behind for each
call whose stream never ended)."""

_END = object()


class StreamEnded(Exception):
    """The caller's deadline passed before the stream ended (the call was cancelled)."""


class StreamReaders:
    """Reader threads for response streams (see the module docstring).

    Args:
        name: the threads' name prefix.
    """

    def __init__(self, name: str = "kvstore-stream"):
        self._name = name
        self._pool = ThreadPoolExecutor(max_workers=MAX_READERS, thread_name_prefix=name)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False

    def read(self, call, timeout: float | None) -> Iterator:
        """The messages of ``call`` (a gRPC response stream, already started with deadline
        ``timeout`` seconds), in order. Raises what the call raises
        (:class:`grpc.RpcError`; an error status as soon as it comes, even while a message
        is still awaited), and :class:`StreamEnded` when no message or end came
        within ``timeout`` + :data:`GRACE_S` seconds of this call (the call is then
        cancelled). Stopping the iteration early cancels the call."""
        due = None if timeout is None else time.monotonic() + timeout + GRACE_S
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        given_up = threading.Event()

        def pump() -> None:
            if given_up.is_set():
                return
            try:
                for message in call:
                    inbox.put(message)
                    if given_up.is_set():
                        return
                inbox.put(_END)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
                inbox.put(e)
        def ended(c) -> None:           # on gRPC's thread when the call has its status
            if c.code() is not grpc.StatusCode.OK:
                inbox.put(c)            # failed: nothing after it matters; raise it now
        try:
            with self._lock:
                if self._closed:
                    raise ValueError("the client is closed")
                if self._pid != os.getpid():     # a forked child: the pool's threads stayed behind
                    self._pool = ThreadPoolExecutor(max_workers=MAX_READERS, thread_name_prefix=self._name)
                    self._pid = os.getpid()
                self._pool.submit(pump)
            call.add_done_callback(ended)
        except RuntimeError:            # the pool shut down meanwhile
            raise ValueError("the client is closed") from None
        finished = False
        try:
            while True:
                try:
                    item = inbox.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
                except queue.Empty:
                    raise StreamEnded(f"the stream did not end within its deadline ({timeout:g} s) "
                                      f"and {GRACE_S:g} s more") from None
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                given_up.set()
                call.cancel()

    def close(self) -> None:
        """Stop taking calls; readers still waiting on a call are left to it."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GRACE_S", "MAX_READERS", "StreamEnded", "StreamReaders"]
