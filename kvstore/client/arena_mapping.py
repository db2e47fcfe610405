"""A client's mapping of the daemon's shared host arena (the same-node data path).

The daemon hands out the arena's memfd (:mod:`kvstore.common.arena`); this maps it once,
with every page populated, and offers it as a uint8 array for copies straight between
the arena and the client's own buffers.

The hand-out connection stays open for as long as the arena is mapped: it is the
client's *session* with the daemon (hello version 2). Lease, Reserve and Commit name the
session (:attr:`ArenaMapping.metadata`), and when this process ends, however it ends, the
kernel closes the connection and the daemon releases at once what the session held
(:mod:`kvstore.service.liveness`), instead of waiting for the TTLs. With hello version 3
the session also carries the control frames (Lookup, Lease, Release) when the daemon serves
them: :attr:`ArenaMapping.control` (:mod:`kvstore.client.arena_control`). With hello
version 4 the daemon may also hand over its block table and a reader page for the session:
:attr:`ArenaMapping.table` (:class:`tiers.block_table.TableView`), which lets the client find
and copy host blocks with no round trip (:mod:`kvstore.client.table_read`). A daemon that does
not know a version is asked with the one below (4, 3, 2, then 1).
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket

import numpy as np

from kvstore.client.arena_control import ControlChannel
from kvstore.common.arena import (ARENA_HEADER, HELLO, HELLO_CONTROL, HELLO_SESSION, HELLO_TABLE, SESSION_HEADER,
                                  arena_identity)
from kvstore.common.block_table import TableView, supported
from kvstore.common.host_copy import words_enabled

log = logging.getLogger("kvstore.client")
_HUNG_UP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)

MAX_LEASE_TTL_S = 600.0
"""The longest TTL assumed when a daemon does not say (hello version 1)."""
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)      # Linux 5.14


def table_wanted() -> bool:
    """Whether to ask for the daemon's block table: on x86-64, unless the environment says
    ``KVSTORE_BLOCK_TABLE=0`` (every read then takes a lease: for comparisons)."""
    return supported() and os.environ.get("KVSTORE_BLOCK_TABLE", "1") != "0"


def map_arena(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of the arena memfd ``fd`` shared and writable, every page mapped
    now: a first touch per page later would cost a fault on the data path (16k faults per
    64 MiB, measured as a third of a put's time). The mapping asks for huge pages
    (``MADV_HUGEPAGE``) before it is populated (``MADV_POPULATE_READ``, what ``MAP_POPULATE``
    does for a shared mapping, which kernels before 5.14 use instead), so an arena the
    daemon holds in huge pages (:mod:`tiers.memory`) is mapped with 2 MiB entries here too
    where the kernel allows it. Raises OSError."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):       # no transparent huge pages here, or a hugetlb arena
        pass
    try:
        m.madvise(MADV_POPULATE_READ)
    except OSError:
        m.close()
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
    return m


class ArenaMapping:
    """A client's mapping of the daemon's arena: ``array`` is a writable uint8 view;
    ``identity`` names the arena (:func:`arena_identity`); ``session`` the daemon's session
    id for this client ("" when it gave none); ``max_ttl_s`` the longest lease or
    reservation TTL the daemon grants (seconds): it grants no more than this, whatever is
    asked, so the client's safety margins are counted from it.

    Args:
        path: the arena socket (``InfoReply.shm_socket``).
        token: bearer token, if the daemon wants one.
        timeout: seconds to wait for the daemon.
        control: whether to ask for control frames on the session (hello version 3).
    Raises OSError (cannot connect, refused, bad reply).

    ``control`` is the session's :class:`~kvstore.client.arena_control.ControlChannel`, or
    None when the daemon serves no control frames (the client uses gRPC for them);
    ``table`` the daemon's block table (:class:`~tiers.block_table.TableView`), or None when
    it handed none (``table=False``, not x86-64, a tenant's session, an older daemon).
    """

    def __init__(self, path: str, token: str = "", timeout: float = 5.0, *, control: bool = True,
                 table: bool | None = None):
        table = table_wanted() if table is None else table and control
        hellos = (HELLO_TABLE, HELLO_CONTROL, HELLO_SESSION, HELLO)
        self.table = None
        self.last_find = None                           # kept by kvstore.client.table_read
        for hello in hellos[0 if table else 1 if control else 2:]:
            self._conn = self._hello(path, token, timeout, hello)
            try:
                msg, fds, _, _ = socket.recv_fds(self._conn, 256, 3)
            except OSError:
                self._conn.close()
                raise
            if hello is HELLO:
                self._conn.close()                      # version 1 keeps no connection
            if not msg.startswith(b"ERR bad request") or hello is HELLO:
                break
            for fd in fds:                              # a daemon that does not know this version
                os.close(fd)
            self._conn.close()
        if not msg.startswith(b"OK ") or not fds:
            for fd in fds:
                os.close(fd)
            self._conn.close()
            raise OSError(f"the daemon refused the shared arena: {msg.decode('ascii', 'replace').strip()}")
        fd = fds[0]
        try:
            fields = msg[3:].split()
            size = int(fields[0])
            self.session = fields[1].decode("ascii") if len(fields) > 1 and fields[1] != b"-" else ""
            self.max_ttl_s = float(fields[2]) if len(fields) > 2 else MAX_LEASE_TTL_S
            served = (hello in (HELLO_CONTROL, HELLO_TABLE) and len(fields) > 3 and fields[3] == b"1"
                      and bool(self.session))
            self.identity = arena_identity(fd)
            self._map = map_arena(fd, size)
            if served and hello is HELLO_TABLE and len(fields) > 4 and fields[4] == b"1" and len(fds) == 3:
                self.table = self._map_table(fds[1], fds[2], size)
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            self._conn.close()
            raise OSError(f"the daemon's arena reply does not parse: {msg[:80]!r} ({e})") from None
        except BaseException:
            self._conn.close()
            raise
        finally:
            for each in fds:
                os.close(each)
        if not self.session:
            self._conn.close()       # nothing to keep alive
        self.control = ControlChannel(self._conn) if served else None
        if self.control is not None:    # the daemon takes Reserve and Commit frames (the last field)
            at = 5 if hello is HELLO_TABLE else 4
            self.control.puts = len(fields) > at and fields[at] == b"1"
        self.size = size
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        words_enabled()             # the copy loop is chosen with the mapping, not on the first get
        self.view = memoryview(self._map)
        self.metadata = ((ARENA_HEADER, self.identity),) + (((SESSION_HEADER, self.session),)
                                                            if self.session else ())
        """gRPC metadata of Lease, Reserve and Commit: the arena and the session."""

    @staticmethod
    def _map_table(table_fd: int, reader_fd: int, size: int) -> TableView | None:
        """The daemon's block table, or None when it cannot be mapped (every read then
        takes a lease; the daemon is told nothing: the session's reader page stays 0)."""
        try:
            return TableView(table_fd, reader_fd, size)
        except (OSError, ValueError) as e:
            log.info("the daemon's block table cannot be used (%s); reading by lease", e)
            return None

    def alive(self) -> bool:
        """Whether the session connection is still up: the daemon has not closed it (it
        stopped or restarted). One poll that does not wait (a closed peer reads as hang-up)."""
        try:
            poller = select.poll()
            poller.register(self._conn.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
            return not any(ev & _HUNG_UP for _, ev in poller.poll(0))
        except (OSError, ValueError):       # closed here
            return False

    @staticmethod
    def _hello(path: str, token: str, timeout: float, hello: bytes) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(hello + (token or "-").encode("ascii") + b"\n")
        except BaseException:
            s.close()
            raise
        return s

    def close(self) -> None:
        """Unmap the arena and end the session (the daemon releases what it held)."""
        if self.control is not None:
            self.control.lost = True
        if self.table is not None:
            self.table.close()
        self._conn.close()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.view.release()
            self._map.close()
        except BufferError:     # a caller still holds a view; unmapped with the last one
            pass
