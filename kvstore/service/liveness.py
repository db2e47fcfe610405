"""Same-node client sessions: what a client holds is reclaimed as soon as its process is gone.

A client that maps the shared arena keeps the hand-out connection open for as long as it
maps it (:class:`kvstore.client.arena_mapping.ArenaMapping`): the daemon answered the
hand-out with a session id, which the client sends on every Lease, Reserve and Commit
(:data:`kvstore.common.arena.SESSION_HEADER`), and the leases and reservations it is
granted carry that id. When the connection reaches end-of-file (the client closed its
mapping, or its process ended, even by SIGKILL: the kernel closes its descriptors),
:class:`ClientSessions` ends the session: its leases are released and its reservations
aborted at once (:meth:`kvstore.store.manager.TierManager.end_session`), not when their TTL
passes. A Lease or Reserve naming a session that is not open is refused.

One thread watches every open connection (``selectors``); at most :data:`MAX_SESSIONS`
are open at once: past it a client is handed the arena without a session and what it
holds ends by its TTL only. A *served* session (:meth:`ClientSessions.open_served`: a
client that sends control frames on its connection, :mod:`kvstore.service.arena_control`)
has a thread of its own instead, blocked reading that connection; it ends the session the
same way when the connection reaches end-of-file. At most :data:`MAX_SERVED` are served at
once; past it a client gets a watched session and uses gRPC for control.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
from typing import Callable

log = logging.getLogger("kvstore.service.liveness")

MAX_SESSIONS = 4096
"""Most same-node client sessions open at once (one socket each)."""
MAX_SERVED = 256
"""Most of them served at once (one thread each)."""


class ClientSessions:
    """Open sessions and the hand-out connections that keep them alive.

    Args:
        on_open: called with a new session id before it is handed out (the store then
            accepts leases and reservations naming it).
        on_end: ``on_end(id, client_gone)`` once its connection reached end-of-file or
            failed (``client_gone`` True: the store releases what the session holds), or the
            daemon closed it (False: the client may still run), from the watcher thread.
    """

    def __init__(self, on_open: Callable[[str], None], on_end: Callable[[str, bool], None]):
        self._on_open = on_open
        self._on_end = on_end
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list[tuple[socket.socket, str]] = []
        self._open = 0
        self._served: dict[str, tuple[socket.socket, threading.Thread]] = {}
        self.ended = 0
        """Sessions ended so far (their connection closed)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-client-sessions", daemon=True)
        self._thread.start()

    @property
    def open_sessions(self) -> int:
        return self._open

    def open(self, conn: socket.socket) -> str | None:
        """Start a session kept alive by ``conn`` (a hand-out connection; this takes its
        own duplicate of it, so the caller closes ``conn`` as usual). Returns the session
        id, or None when :data:`MAX_SESSIONS` are open (or the watcher stopped)."""
        with self._lock:
            if self._stop.is_set() or self._open >= MAX_SESSIONS:
                return None
            self._open += 1
        session = secrets.token_hex(16)
        try:
            self._on_open(session)
            watched = conn.dup()
            watched.setblocking(False)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise
        with self._lock:
            self._pending.append((watched, session))
        self._wake_w.send(b"x")
        return session

    def open_served(self, conn: socket.socket, serve: Callable[[socket.socket, str], None]) -> str | None:
        """Start a session kept alive by ``conn`` (its own duplicate of it, as :meth:`open`)
        whose connection is read by a thread of its own running ``serve(conn, session)``
        (blocking socket) until it returns; then the connection is closed and the session
        ended. Returns the session id, or None when :data:`MAX_SERVED` are served, the
        sessions are full, or the watcher stopped (the caller may :meth:`open` instead)."""
        with self._lock:
            if self._stop.is_set() or self._open >= MAX_SESSIONS or len(self._served) >= MAX_SERVED:
                return None
            self._open += 1
        session = secrets.token_hex(16)
        try:
            self._on_open(session)
            served = conn.dup()
            served.setblocking(True)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise
        thread = threading.Thread(target=self._serve, args=(served, session, serve), daemon=True,
                                  name=f"kvstore-arena-session-{session[:8]}")
        with self._lock:
            self._served[session] = (served, thread)
        thread.start()
        return session

    @property
    def served_sessions(self) -> int:
        return len(self._served)

    def is_served(self, session: str) -> bool:
        """Whether ``session``'s serving thread still runs (its end is still to come)."""
        with self._lock:
            return session in self._served

    def _serve(self, conn: socket.socket, session: str, serve: Callable[[socket.socket, str], bool | None]) -> None:
        client_gone = True
        try:
            client_gone = serve(conn, session) is not False
        except Exception:  # noqa: BLE001 - the session still ends below
            log.exception("serving client session %s failed", session[:8])
        finally:
            conn.close()
            with self._lock:
                self._served.pop(session, None)
                stopping = self._stop.is_set()
            if not stopping:
                self._end(session, client_gone)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:
                    self._take_pending()
                else:
                    self._poll(key.fileobj, key.data)

    def _take_pending(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            pending, self._pending = self._pending, []
        for conn, session in pending:
            self._selector.register(conn, selectors.EVENT_READ, session)

    def _poll(self, conn: socket.socket, session: str) -> None:
        try:
            if conn.recv(4096):
                return                       # a client sends nothing more; ignored
        except BlockingIOError:
            return
        except OSError:
            pass                             # reset: the client is gone too
        self._selector.unregister(conn)
        conn.close()
        self._end(session)

    def _end(self, session: str, client_gone: bool = True) -> None:
        with self._lock:
            self._open -= 1
        self.ended += 1
        try:
            self._on_end(session, client_gone)   # False: the daemon closed it, the client may still run
        except Exception:  # noqa: BLE001 - keep watching the other sessions
            log.exception("ending client session %s failed", session[:8])

    def stop(self) -> None:
        """Stop watching and close every connection (their sessions are not ended: the
        daemon is stopping)."""
        with self._lock:
            self._stop.set()
            served = list(self._served.values())
        for conn, _ in served:               # their threads' reads return at once
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for _, thread in served:
            thread.join(timeout=5.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        self._wake_w.close()
        with self._lock:
            for conn, _ in self._pending:
                conn.close()
            self._pending = []
