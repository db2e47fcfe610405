"""Binding the daemon's ``[server] listen`` address: a unix socket it owns, or TCP (TLS).

A unix socket is *claimed* first (:func:`claim_unix_socket`): ``<path>.lock`` is held
with ``flock`` while the daemon serves, so a second daemon on the same path is refused
with a ConfigError, a socket left by a daemon that died is replaced, and a file or
folder at the path is never replaced. The socket is created ``0600`` (only this user
may connect) and removed at exit only if it is still the one this daemon created
(:meth:`UnixSocket.release`). A TCP address is bound with ``SO_REUSEPORT`` off (set by
:func:`kvstore.service.startup.start_server`), so a port in use is refused, not shared.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pathlib
import stat

import grpc

from kvstore.config.node import Config
from kvstore.common.errors import ConfigError


@dataclasses.dataclass
class UnixSocket:
    """A unix socket path owned by this daemon: ``<path>.lock`` is held (flock) while it
    serves, so a second daemon is refused even when the first is stopped or slow, and the
    socket is removed at exit only if it is still the one this daemon created."""

    path: pathlib.Path
    lock_fd: int
    inode: int = 0

    def release(self) -> None:
        try:
            if self.inode and self.path.stat().st_ino == self.inode:
                self.path.unlink()
        except OSError:
            pass
        try:
            os.close(self.lock_fd)   # releases the flock
        except OSError:
            pass


def claim_unix_socket(listen: str) -> UnixSocket:
    """Claim the unix socket path of ``listen`` (``unix:PATH``) for this daemon.
    Raises ConfigError when another daemon holds it or the path is not a socket."""
    path = listen[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    p = pathlib.Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"server.listen: cannot create {str(p.parent)!r}: {e.strerror}") from None
    lock_path = p.with_name(p.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"server.listen: cannot create {str(lock_path)!r}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"server.listen: another daemon is serving on {listen} "
                          f"(it holds {lock_path})") from None
    if os.path.lexists(p):
        st = p.lstat()
        if not stat.S_ISSOCK(st.st_mode):
            os.close(fd)
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
            raise ConfigError(f"server.listen: {str(p)!r} is {kind}, not a socket; refusing to replace it")
        p.unlink()   # a socket left by a daemon that died: nobody holds the lock
    return UnixSocket(p, fd)


def bind(server: grpc.Server, cfg: Config) -> tuple[str, UnixSocket | None]:
    """Bind ``[server] listen``; returns the address and, for unix sockets, the claim.
    Raises ConfigError when the address cannot be bound (in use, not on this machine)."""
    listen = cfg.server.listen
    if listen.startswith("unix:"):
        sock = claim_unix_socket(listen)
        old_umask = os.umask(0o077)  # socket created 0600: only this user may connect
        try:
            port = server.add_insecure_port(f"unix:{sock.path}")
        except RuntimeError as e:
            sock.release()
            raise ConfigError(f"server.listen: cannot bind {listen}: {e}") from None
        finally:
            os.umask(old_umask)
        if port == 0:
            sock.release()
            raise ConfigError(f"server.listen: cannot bind {listen}")
        os.chmod(sock.path, 0o600)
        sock.inode = sock.path.stat().st_ino
        return f"unix:{sock.path}", sock
    s = cfg.server
    try:
        if s.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(pathlib.Path(s.tls_key).read_bytes(), pathlib.Path(s.tls_cert).read_bytes())])
            port = server.add_secure_port(listen, creds)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as e:   # grpc raises when the address is in use (SO_REUSEPORT is off)
        raise ConfigError(f"server.listen: cannot bind {listen}: the port is in use (another kvstore daemon "
                          f"serving it?) or the address is not on this machine ({e})") from None
    if port == 0:
        raise ConfigError(f"server.listen: cannot bind {listen}")
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}", None
