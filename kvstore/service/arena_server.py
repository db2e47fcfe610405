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
reclaimed when it closes.

Security: only processes that can open the 0600 socket (the daemon's user) get the
descriptor, and a configured bearer token is checked (constant time). A mapped client
can read every block in the arena, so the path is refused in multi-tenant configs
(``[server.tenants]``): tenants then use gRPC only, where each sees its own key space.
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import threading

from kvstore.common.arena import HELLO, HELLO_SESSION, MAX_HELLO_LINE, arena_identity
from kvstore.service.auth import Authenticator
from kvstore.service.listen import check_socket_free
from kvstore.service.liveness import ClientSessions

log = logging.getLogger("kvstore.service.arena_server")


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
    Raises OSError when the socket cannot be bound.
    """

    def __init__(self, path: str | os.PathLike, fd: int, size: int, auth: Authenticator | None = None,
                 sessions: ClientSessions | None = None, max_ttl_s: float = 600.0):
        self.path = pathlib.Path(path)
        self.fd = fd
        self.size = size
        self.auth = auth
        self.sessions = sessions
        self.max_ttl_s = max_ttl_s
        self.identity = arena_identity(fd)
        self.handed_out = 0
        self.refused = 0
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvstore-arena", daemon=True)

    def start(self) -> "ArenaServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                conn.settimeout(2.0)
                self._handle(conn)
            except OSError as e:
                log.debug("arena hand-out failed: %s", e)
            finally:
                conn.close()

    def _handle(self, conn: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n") and len(line) < MAX_HELLO_LINE:
            part = conn.recv(MAX_HELLO_LINE - len(line))
            if not part:
                return
            line += part
        if not line.startswith((HELLO, HELLO_SESSION)):
            self.refused += 1
            conn.sendall(b"ERR bad request\n")
            return
        token = line[len(HELLO):].strip().decode("ascii", "replace")
        if self.auth is not None:
            meta = [("authorization", f"Bearer {token}")] if token != "-" else []
            if self.auth.tenant_for(meta) is None:
                self.refused += 1
                conn.sendall(b"ERR missing or wrong bearer token\n")
                return
        reply = b"OK %d\n" % self.size
        if line.startswith(HELLO_SESSION):
            session = self.sessions.open(conn) if self.sessions is not None else None
            reply = b"OK %d %s %g\n" % (self.size, (session or "-").encode("ascii"), self.max_ttl_s)
        socket.send_fds(conn, [reply], [self.fd])
        self.handed_out += 1

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except OSError:
            pass
