"""Where a same-node client releases its leases (and sends its block-table notes): in the
background, off the data path.

``get_into`` copies blocks out of the shared arena under a lease and hands the lease id
to a :class:`LeaseReleaser` instead of waiting for a Release call: the id rides on the
next Lease call (``LeaseRequest.release``, or the release list of a LEASE control frame),
or a background thread sends the ids that waited in one Release: a RELEASE control frame
that waits for no answer when the mapping's session serves control frames
(:mod:`kvstore.client.arena_control`), else a gRPC Release call. A lease whose release is
lost ends by its TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import grpc

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.connection import Connection

log = logging.getLogger("kvstore.client")


class LeaseReleaser:
    """Lease ids waiting to be released: carried by the next Lease call, or, after
    ``delay_s`` seconds without one, sent by a thread in one Release call. No gRPC future
    per lease, no wait on the data path.

    Args:
        connection: the daemon's connection (its stub, metadata and timeout).
        delay_s: how long ids wait for a Lease call to carry them (seconds).
        channel: returns the control channel to release on (None: gRPC), or None.
    """

    def __init__(self, connection: Connection, delay_s: float = 0.002,
                 channel: Callable[[], Any] | None = None):
        self.connection = connection
        self.delay_s = delay_s
        self._channel = channel
        self._notes = False
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def add(self, lease_id: str) -> None:
        """Release ``lease_id`` soon, without waiting (starts the thread on first use)."""
        with self._lock:
            self._ids.append(lease_id)
            self._start()
        self._wake.set()

    def notes_waiting(self) -> None:
        """The control channel queued block-table notes: send them soon (with the releases)."""
        with self._lock:
            self._notes = True
            self._start()
        self._wake.set()

    def _start(self) -> None:
        """Start the thread on first use (lock held)."""
        if self._thread is None and not self._stop:     # published once started: close() may join it
            thread = threading.Thread(target=self._run, name="kvstore-client-release", daemon=True)
            thread.start()
            self._thread = thread

    def take(self) -> list[str]:
        """The ids waiting, for a Lease call to carry (they are no longer waiting)."""
        with self._lock:
            ids, self._ids = self._ids, []
            return ids

    def _send(self) -> None:
        ids = self.take()
        c = self.connection
        ch = self._channel() if self._channel is not None else None
        with self._lock:
            notes, self._notes = self._notes, False
        if notes and ch is not None:
            try:
                ch.send_notes(c.timeout)
            except (OSError, errors.KVStoreError) as e:     # advice: dropped
                log.debug("block-table notes on the arena session were not sent: %s", e)
        if not ids:
            return
        if ch is not None:
            try:
                if ch.release(ids, c.timeout, reply=False, wait=True) is not None:
                    return
            except (OSError, errors.KVStoreError) as e:     # the session ended, or it is slow: gRPC
                log.debug("release of %d leases on the arena session failed: %s", len(ids), e)
        try:
            c.stub.Release(pb.ReleaseRequest(lease_ids=ids), timeout=c.timeout, metadata=c.metadata)
        except grpc.RpcError as e:      # the leases end by their TTL
            log.debug("release of %d leases failed: %s", len(ids), e)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                break
            time.sleep(self.delay_s)        # a Lease call coming right after carries them
            self._send()

    def close(self, wait: bool = True) -> None:
        """Stop the thread. With ``wait``, wait for it (at most the call timeout) and send
        the ids still waiting; without (the finalizer of a client dropped unclosed), only
        tell it to stop: it exits at once, and the leases left end by their TTL."""
        self._stop = True
        self._wake.set()
        if not wait:
            return
        if self._thread is not None:
            self._thread.join(timeout=self.connection.timeout)
        self._send()
