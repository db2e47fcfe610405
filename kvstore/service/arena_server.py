"""The same-node data plane: the host arena shared with clients by file descriptor.

The host tier's arena is a memfd (:mod:`tiers.memory`). The daemon serves it on a
second unix socket, ``<grpc socket>.arena`` (mode 0600, like the gRPC socket): a client
connects, sends one line (``KVSTORE-ARENA 1 <bearer token or ->``), and receives
``OK <bytes>`` with the memfd attached (SCM_RIGHTS). It maps the arena once and from
then on copies blocks straight between the arena and its own buffers, while gRPC
carries only control (Lease/Release for reads, Reserve/Commit for writes;
:mod:`kvstore.client`). A client that says hello version 2 (``KVSTORE-ARENA 2``) gets
``OK <bytes> <session> <longest lease TTL>`` and keeps the connection open: it is the
client's session (:mod:`kvstore.service.liveness`), and what the session holds is
reclaimed when it closes. Hello version 3 (``KVSTORE-ARENA 3``) gets
``OK <bytes> <session> <longest lease TTL> <control>``: with ``control`` 1 the session has a
thread of its own that answers Lookup, Lease and Release frames on the connection
(:mod:`kvstore.service.arena_control`), so a same-node read makes no gRPC call (a last
field, ``1``, says Reserve and Commit are taken there too, so a zero-copy put makes none
either); ``0`` when
the daemon serves no control frames (none configured, or :data:`~kvstore.service.liveness.MAX_SERVED`
sessions served already).

Security: only processes that can open the 0600 socket (the daemon's user) get the
descriptor, and a configured bearer token is checked (constant time). A mapped client
can read every block in the arena, so the path is refused in multi-tenant configs
(``[server.tenants]``): tenants then use gRPC only, where each sees its own key space.

Hand-outs are served concurrently by one thread (non-blocking sockets and a selector): a
peer that sends its hello slowly, or never, delays nobody else, and is dropped when its
whole hello has not arrived within :data:`HELLO_DEADLINE_S`. At most
:data:`MAX_PENDING` connections wait for their hello at once (beyond that the oldest is
dropped), so slow peers cannot exhaust the daemon's descriptors.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import selectors
import socket
import threading
import time

from kvstore.common.arena import HELLO, HELLO_CONTROL, HELLO_SESSION, HELLO_TABLE, MAX_HELLO_LINE, arena_identity
from kvstore.service.arena_control import ArenaControl
from kvstore.service.auth import SHARED, Authenticator, KeySpace
from kvstore.service.listen import check_socket_free
from kvstore.service.liveness import ClientSessions
from tiers.block_table import BlockTable, readonly_fd

log = logging.getLogger("kvstore.service.arena_server")

HELLO_DEADLINE_S = 2.0
"""Seconds a client has to send its whole hello line after connecting."""
MAX_PENDING = 256
"""Connections waiting for their hello at once."""


class _Pending:
    """A connection whose hello line is still arriving."""

    __slots__ = ("conn", "deadline", "line")

    def __init__(self, conn: socket.socket, deadline: float):
        self.conn = conn
        self.deadline = deadline
        self.line = b""


class ArenaServer:
    """Hands the arena memfd to clients that connect to ``path``.

    Args:
        path: the socket path (created mode 0600; a stale socket there is replaced, one
            another process serves is not: OSError).
        fd: the arena's memfd; size: its mapped size in bytes.
        auth: checks the bearer token a client sends (None: no token needed).
        sessions: opens a session per version-2 client (None: none are opened).
        max_ttl_s: the longest lease or reservation TTL the daemon grants (seconds), told
            to version-2 clients.
        hello_deadline_s: seconds a client has to send its whole hello line.
        control: answers the control frames of version-3 sessions (None: version-3
            clients are told ``control`` 0).
        table: the arena's block table, handed to version-4 sessions of the shared key
            space that are served control frames (None, or a tenant's session: told
            ``table`` 0; the table holds the store's keys, which are a tenant's only after
            its name is mixed in). The caller closes each
            session's reader page when the session ends (:meth:`BlockTable.close_reader`).
    Raises OSError when the socket cannot be bound.
    """

    def __init__(self, path: str | os.PathLike, fd: int, size: int, auth: Authenticator | None = None,
                 sessions: ClientSessions | None = None, max_ttl_s: float = 600.0,
                 hello_deadline_s: float = HELLO_DEADLINE_S, control: ArenaControl | None = None,
                 table: BlockTable | None = None):
        self.path = pathlib.Path(path)
        self.fd = fd
        self.size = size
        self.auth = auth
        self.sessions = sessions
        self.max_ttl_s = max_ttl_s
        self.hello_deadline_s = hello_deadline_s
        self.control = control
        self.table = table
        self.identity = arena_identity(fd)
        self.handed_out = 0
        self.refused = 0
        self.timed_out = 0          # peers dropped for not sending their hello in time
        if self.path.is_socket():
            check_socket_free(self.path)     # OSError when another process serves it: never replaced
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._inode = self.path.stat().st_ino
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._stop = threading.Event()
        self._pending: dict[socket.socket, _Pending] = {}    # in arrival order
        self._thread = threading.Thread(target=self._serve, name="kvstore-arena", daemon=True)

    def start(self) -> "ArenaServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.1):
                    if key.fileobj is self._sock:
                        self._accept(sel)
                    else:
                        self._read(sel, self._pending.get(key.fileobj))
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    self.timed_out += 1
                    log.info("arena hand-out: dropped a peer that sent no whole hello in %g s", self.hello_deadline_s)
                    self._close(sel, p)
        finally:
            for p in list(self._pending.values()):
                self._close(sel, p)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:             # closed by stop(), or out of descriptors: try on the next round
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._close(sel, next(iter(self._pending.values())))
            p = self._pending[conn] = _Pending(conn, time.monotonic() + self.hello_deadline_s)
            sel.register(conn, selectors.EVENT_READ)
            self._read(sel, p)          # the hello is often there already

    def _read(self, sel: selectors.BaseSelector, p: _Pending | None) -> None:
        if p is None:
            return
        try:
            part = p.conn.recv(MAX_HELLO_LINE - len(p.line))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("arena hand-out failed: %s", e)
            self._close(sel, p)
            return
        p.line += part
        if part and not p.line.endswith(b"\n") and len(p.line) < MAX_HELLO_LINE:
            return                      # more to come
        try:
            if part:
                self._answer(p.conn, p.line)
        except OSError as e:            # the peer went, or its buffer is full: it may connect again
            log.debug("arena hand-out failed: %s", e)
        finally:
            self._close(sel, p)

    def _answer(self, conn: socket.socket, line: bytes) -> None:
        if not line.startswith((HELLO, HELLO_SESSION, HELLO_CONTROL, HELLO_TABLE)):
            self.refused += 1
            conn.send(b"ERR bad request\n")
            return
        token = line[len(HELLO):].strip().decode("ascii", "replace")
        space = SHARED
        if self.auth is not None:
            meta = [("authorization", f"Bearer {token}")] if token != "-" else []
            tenant = self.auth.tenant_for(meta)
            if tenant is None:
                self.refused += 1
                conn.send(b"ERR missing or wrong bearer token\n")
                return
            space = KeySpace(tenant)
        reply = b"OK %d\n" % self.size
        fds = [self.fd]
        extra: list[int] = []
        try:
            if line.startswith((HELLO_SESSION, HELLO_CONTROL, HELLO_TABLE)):
                session = served = None
                controlled = line.startswith((HELLO_CONTROL, HELLO_TABLE))
                if self.sessions is not None and self.control is not None and controlled:
                    session = served = self.sessions.open_served(conn, functools.partial(self.control.serve,
                                                                                         space=space))
                if session is None and self.sessions is not None:
                    session = self.sessions.open(conn)
                reply = b"OK %d %s %g" % (self.size, (session or "-").encode("ascii"), self.max_ttl_s)
                if controlled:
                    reply += b" %d" % bool(served)
                if line.startswith(HELLO_TABLE):
                    if served and self.table is not None and space.shared:   # a tenant's keys are not the table's
                        extra = self._table_fds(served)
                    reply += b" %d" % bool(extra)
                if controlled:                         # Reserve and Commit as frames too: the last field
                    reply += b" %d" % bool(served)
                reply += b"\n"
            socket.send_fds(conn, [reply], fds + extra)
        finally:
            for fd in extra:
                os.close(fd)
        self.handed_out += 1

    def _table_fds(self, session: str) -> list[int]:
        """The block table (read-only) and a reader page for ``session``; [] when either
        cannot be made (the session then reads by lease)."""
        try:
            table = readonly_fd(self.table.fd)
        except OSError as e:
            log.warning("arena hand-out: cannot reopen the block table read-only (%s); leases only", e)
            return []
        try:
            reader = self.table.open_reader(session)
        except OSError as e:
            os.close(table)
            log.warning("arena hand-out: no reader page for a session (%s); leases only", e)
            return []
        if not self.sessions.is_served(session):    # it ended meanwhile: its end may have run first
            self.table.close_reader(session)
            os.close(reader)
            os.close(table)
            return []
        return [table, reader]

    def _close(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        self._pending.pop(p.conn, None)
        try:
            sel.unregister(p.conn)
        except (KeyError, ValueError):
            pass
        p.conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except OSError:
            pass
