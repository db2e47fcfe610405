"""The same-node data plane: the host arena shared with clients by file descriptor.

The host tier's arena is a memfd (:mod:`tiers.memory`). The daemon serves it on a
second unix socket, ``<grpc socket>.arena`` (mode 0600, like the gRPC socket): a client
connects, sends one line (``KVSTORE-ARENA 1 <bearer token or ->``), and receives
``OK <bytes>`` with the memfd attached (SCM_RIGHTS). It maps the arena once and from
then on copies blocks straight between the arena and its own buffers, while gRPC
carries only control (Lease/Release for reads, Reserve/Commit for writes;
:mod:`kvstore.client`).

Security: only processes that can open the 0600 socket (the daemon's user) get the
descriptor, and a configured bearer token is checked (constant time). A mapped client
can read every block in the arena, so the path is refused in multi-tenant configs
(``[server.tenants]``): tenants then use gRPC only, where each sees its own key space.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import socket
import threading

import numpy as np

from .auth import Authenticator

log = logging.getLogger("kvstore.shm")

HELLO = b"KVSTORE-ARENA 1 "
_MAX_LINE = 4096

ARENA_HEADER = "kvstore-arena"
"""gRPC metadata a mapped client sends on Lease, Reserve and Commit: the
:func:`arena_identity` of its mapping. A daemon serving another arena (it restarted
since the client mapped it) refuses the call with a message holding
:data:`ARENA_CHANGED`, so the client never copies from or into a stale mapping."""

ARENA_CHANGED = "the shared arena changed"


def arena_identity(fd: int) -> str:
    """Which memfd an arena is, ``"<st_dev>:<st_ino>"``: the daemon and every client that
    received the descriptor see the same, and a restarted daemon's new memfd differs
    while any client still maps the old one."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


class ArenaServer:
    """Hands the arena memfd to clients that connect to ``path``.

    Args:
        path: the socket path (created mode 0600; replaced if a stale socket is there).
        fd: the arena's memfd; size: its mapped size in bytes.
        auth: checks the bearer token a client sends (None: no token needed).
    Raises OSError when the socket cannot be bound.
    """

    def __init__(self, path: str | os.PathLike, fd: int, size: int, auth: Authenticator | None = None):
        self.path = pathlib.Path(path)
        self.fd = fd
        self.size = size
        self.auth = auth
        self.identity = arena_identity(fd)
        self.handed_out = 0
        self.refused = 0
        if self.path.is_socket():
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
        while not line.endswith(b"\n") and len(line) < _MAX_LINE:
            part = conn.recv(_MAX_LINE - len(line))
            if not part:
                return
            line += part
        if not line.startswith(HELLO):
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
        socket.send_fds(conn, [b"OK %d\n" % self.size], [self.fd])
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


class ArenaMapping:
    """A client's mapping of the daemon's arena: ``array`` is a writable uint8 view;
    ``identity`` names the arena (:func:`arena_identity`).

    Args:
        path: the arena socket (``InfoReply.shm_socket``).
        token: bearer token, if the daemon wants one.
        timeout: seconds to wait for the daemon.
    Raises OSError (cannot connect, refused, bad reply).
    """

    def __init__(self, path: str, token: str = "", timeout: float = 5.0):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(HELLO + (token or "-").encode("ascii") + b"\n")
            msg, fds, _, _ = socket.recv_fds(s, 256, 1)
        if not msg.startswith(b"OK ") or not fds:
            for fd in fds:
                os.close(fd)
            raise OSError(f"the daemon refused the shared arena: {msg.decode('ascii', 'replace').strip()}")
        fd = fds[0]
        try:
            self.identity = arena_identity(fd)
            size = int(msg[3:].strip())
            # MAP_POPULATE maps every page now: a first touch per page later costs a fault
            # on the data path (16k faults per 64 MiB, measured as a third of a put's time)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.view.release()
            self._map.close()
        except BufferError:     # a caller still holds a view; unmapped with the last one
            pass
