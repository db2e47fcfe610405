"""Binding the daemon's ``[server] listen`` address: a unix socket it owns, or TCP (TLS).

A unix socket is *claimed* first (:func:`claim_unix_socket`): ``<path>.lock`` is held
with ``flock`` while the daemon serves, so a second daemon on the same path is refused
with a ConfigError; a socket some process still serves (it accepts a connection: a
daemon of another kind that holds no lock) is never replaced (:func:`check_socket_free`),
a socket nobody serves (left by a process that died) is, and a file or folder at the
path never is. The socket is created ``0600`` (only this user may connect) and removed
at exit only if it is still the one this daemon created (:meth:`UnixSocket.release`).

A TCP address is bound with ``SO_REUSEPORT`` off (set by
:func:`kvstore.service.startup.start_server`), so a port in use is refused, not shared.
gRPC binds every address a host name stands for and starts when *one* of them binds
(``localhost`` is ``127.0.0.1`` and ``::1``): a daemon on ``localhost:P`` would start beside
one on ``127.0.0.1:P`` and clients would be split by how they spell the address. So each
address the host means (:func:`addresses_of`) is bound once by a probe first, and the
daemon refuses to start when any of them is in use (:func:`check_port_free`).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import ipaddress
import os
import pathlib
import socket
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
        try:
            check_socket_free(p)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"server.listen: {e}") from None
        p.unlink()   # a socket nobody serves (left by a process that died): replaced
    return UnixSocket(p, fd)


def check_socket_free(path: str | os.PathLike) -> None:
    """Raise OSError when a process serves the unix socket at ``path``: it accepts a
    connection, or it cannot be told (connecting is not allowed). Returns when nothing
    is there or the socket is stale (nobody listens: a process that made it died), so
    it may be replaced."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return                           # stale, or gone already
        except OSError as e:
            raise OSError(f"cannot tell whether a process serves the socket {os.fspath(path)!r} "
                          f"({e.strerror or e}); refusing to replace it") from None
    raise OSError(f"another process serves the socket {os.fspath(path)!r} (it accepted a connection); "
                  "refusing to replace it: stop that process or choose another path")


def addresses_of(host: str, port: int) -> list[tuple]:
    """Every socket address TCP ``host`` stands for on ``port`` (``(family, sockaddr)``
    pairs, no repeats): what the resolver gives, and for ``localhost`` both loopback
    addresses, as gRPC binds both. Raises OSError when the name does not resolve."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"host {host!r} does not resolve ({e.strerror})") from None
    out = [(family, sockaddr[:2]) for family, _, _, _, sockaddr in infos]
    if host.lower() == "localhost":
        out += [(socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port))]
    seen, unique = set(), []
    for family, sockaddr in out:
        ident = (family, str(ipaddress.ip_address(sockaddr[0])), sockaddr[1])
        if ident not in seen:
            seen.add(ident)
            unique.append((family, sockaddr))
    return unique


def check_port_free(listen: str, key: str = "server.listen") -> None:
    """Refuse (ConfigError naming ``key``) a TCP ``listen`` address (``HOST:PORT``) when any
    address its host stands for (:func:`addresses_of`) is in use on its port, or is not on
    this machine. Port 0 or ``*`` (any free port) is not probed. An address family this machine
    lacks (no IPv6 loopback) is skipped: nobody can serve it."""
    host, _, port_text = listen.rpartition(":")
    if not port_text.isdigit() or int(port_text) == 0:
        return                                   # any free port ("0", ZMQ's "*"): nothing to probe
    port = int(port_text)
    try:
        resolved = addresses_of(host, port)
    except OSError as e:
        raise ConfigError(f"{key}: cannot bind {listen}: {e}") from None
    for family, sockaddr in resolved:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:                          # no such family here (IPv6 off)
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as gRPC binds (dual stack)
            try:
                probe.bind(sockaddr)
            except OSError as e:
                shown = f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"{key}: cannot bind {listen}: the port is in use on {shown} "
                                      f"(another kvstore daemon serving it, spelt another way?)") from None
                if e.errno == errno.EADDRNOTAVAIL and host.strip("[]").lower() == "localhost" and \
                        family == socket.AF_INET6:
                    continue                     # no IPv6 loopback on this machine
                raise ConfigError(f"{key}: cannot bind {listen}: {shown} is not an address of this "
                                  f"machine ({e.strerror or e})") from None


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
    check_port_free(listen)
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
