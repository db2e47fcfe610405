"""A client's mapping of the daemon's shared host arena (the same-node data path).

The daemon hands out the arena's memfd (:mod:`kvstore.common.arena`); this maps it once,
with every page populated, and offers it as a uint8 array for copies straight between
the arena and the client's own buffers.
"""

from __future__ import annotations

import mmap
import os
import socket

import numpy as np

from kvstore.common.arena import HELLO, arena_identity


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
