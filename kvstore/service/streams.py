"""Bounds of the daemon's streaming calls (``Get``, ``GetRaw``, ``Put``, ``PutRaw``).

gRPC's synchronous server gives a call one thread for as long as it runs, so a client
that trickles a Put, or a reader that never reads its Get, would hold that thread; a few
such clients would hold every thread, and the Lookups, Stats and Leases of all the other
clients would wait until their deadlines. Three bounds keep that from happening:

- **own threads**: streaming calls (and ``PutInline``, the other call carrying block data)
  run on a pool of their own (``[server] max_streams`` threads, :func:`on_pool`), unary
  calls on the other ``workers - max_streams``; a stream beyond ``max_streams`` waits for a
  stream thread, never for a unary call's;
- **idle**: a stream that waits on its client (for the next request message, or for the
  client to read the reply it was sent) longer than ``stream_idle_timeout_s`` is
  cancelled (CANCELLED; its handler is blocked inside gRPC, so only a cancel reaches it);
- **total**: a stream running longer than ``stream_timeout_s`` is ended at its next
  message with DEADLINE_EXCEEDED (:class:`~kvstore.common.errors.StreamTimeout`), the
  message naming the key.

So a stream holds its thread at most ``stream_timeout_s + stream_idle_timeout_s``. An
ended Put aborts its open block (never made visible); blocks it completed stay stored.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from kvstore.common.errors import StreamTimeout

log = logging.getLogger("kvstore.service.server")


HINT_THREADS = 2
"""Threads the agent-hint calls run on (``kvstore.service.server.HINT_METHODS``), beside the
``[server] workers``: a flood of slow hints waits for these, never for the threads of Lookup
and Lease (with ``workers = 8``, two unary threads, it stalled another client's Lookup 5 s)."""


def stream_threads(workers: int, max_streams: int) -> int:
    """The threads of the stream pool for ``[server] workers`` and ``max_streams`` (0:
    ``workers - workers // 4``, at least 1, at most ``workers - 1``)."""
    if max_streams:
        return max_streams
    return max(1, min(workers - 1, workers - workers // 4))


def on_pool(handler: Callable, pool: ThreadPoolExecutor) -> Callable:
    """``handler`` to be run on ``pool`` instead of the server's thread pool (gRPC's
    per-method pool: a handler's ``experimental_thread_pool`` attribute, which
    ``grpc_health``'s servicer uses too). A gRPC without it runs the handler on the server's
    pool: every call still works, streams just share the threads of unary calls."""
    @functools.wraps(handler)
    def run(request, context):
        return handler(request, context)
    run.experimental_thread_pool = pool
    return run


class _Watch:
    """One stream's record: when it started, since when it waits on its client."""

    __slots__ = ("context", "method", "started", "waiting_since", "first", "guard")

    def __init__(self, guard: "StreamGuard", context, method: str):
        self.guard = guard
        self.context = context
        self.method = method
        self.started = guard.clock()
        self.waiting_since: float | None = None
        self.first = False          # waiting for the first request message of the stream

    def _check(self) -> None:
        g = self.guard
        ran = g.clock() - self.started
        if ran > g.max_s:
            g.timed_out += 1
            if g.counters is not None:
                g.counters.inc("streams_timed_out")
            raise StreamTimeout(f"the stream ran {ran:.1f} s, longer than server.stream_timeout_s = {g.max_s:g} s; "
                                "send smaller calls")

    def requests(self, iterator) -> Iterator:
        """``iterator``'s request messages, timing each wait on the client. Raises
        StreamTimeout when the call has run too long."""
        it = iter(iterator)
        self.first = True
        while True:
            self.waiting_since = self.guard.clock()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.waiting_since = None
            self.first = False
            self._check()
            yield item

    def replies(self, iterator) -> Iterator:
        """``iterator``'s reply messages, timing each wait on the client to take one.
        Raises StreamTimeout when the call has run too long (``iterator`` is closed)."""
        it = iter(iterator)
        try:
            for item in it:
                self._check()
                self.waiting_since = self.guard.clock()
                yield item
                self.waiting_since = None
        finally:
            self.waiting_since = None
            close = getattr(it, "close", None)
            if close is not None:
                close()


class StreamGuard:
    """Watches the streams in flight (see the module docstring).

    Args:
        idle_s: the longest wait on the client (seconds) before the call is cancelled.
        first_message_s: the longest wait for a request stream's first message (seconds;
            ``idle_s`` when None or longer): a client sends it as soon as it opens the stream.
        max_s: the longest a call may run (seconds); checked at every message.
        counters: the daemon's counters (``streams_timed_out``, ``streams_idle_cancelled``),
            or None.
        clock: monotonic seconds.
    """

    def __init__(self, idle_s: float, max_s: float = float("inf"), counters=None,
                 clock: Callable[[], float] = time.monotonic, first_message_s: float | None = None):
        self.idle_s = idle_s
        self.first_message_s = idle_s if first_message_s is None else min(first_message_s, idle_s)
        self.max_s = max_s
        self.counters = counters
        self.clock = clock
        self._active: dict[int, _Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cancelled = 0          # streams cancelled for waiting on their client too long
        self.timed_out = 0          # streams ended for running too long

    @contextlib.contextmanager
    def watch(self, context, method: str) -> Iterator[_Watch]:
        """Watch one call while the ``with`` block runs; wrap its messages with the
        :class:`_Watch`'s ``requests`` / ``replies``."""
        w = _Watch(self, context, method)
        with self._lock:
            self._active[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-stream-watchdog", daemon=True)
                self._thread.start()
        try:
            yield w
        finally:
            with self._lock:
                self._active.pop(id(w), None)

    @property
    def active(self) -> int:
        """Streams in flight."""
        return len(self._active)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.first_message_s / 4))
            now = self.clock()
            with self._lock:
                if not self._active:        # ends with the last stream (the next one starts another)
                    self._thread = None
                    return
                stale = [w for w in self._active.values() if w.waiting_since is not None
                         and now - w.waiting_since > (self.first_message_s if w.first else self.idle_s)]
            for w in stale:
                w.waiting_since = None
                if w.first:
                    log.warning("cancelling a %s stream that sent nothing in %g s", w.method, self.first_message_s)
                else:
                    log.warning("cancelling a %s stream that waited on its client for more than %g s", w.method,
                                self.idle_s)
                self.cancelled += 1
                if self.counters is not None:
                    self.counters.inc("streams_idle_cancelled")
                w.context.cancel()
