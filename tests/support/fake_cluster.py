"""An in-memory cluster store and its remote tier, for tests of the store core's cluster
level (:mod:`kvstore.cluster.cluster`) without Mooncake.

``FakeCluster`` is the shared store (objects by key, first writer wins) with fault hooks:

- ``down``: every call raises MediaIOError at once (a dead master, an open circuit);
- ``stall_s``: every call waits this long (at most its deadline) and then raises
  MediaIOError (a stalled master: the real tier's guard gives up at the deadline);
- ``corrupt``: keys whose copies fail verification: reads raise BlockCorrupt, batch gets
  report a miss and drop the copy (as :class:`tiers.mooncake.MooncakeTier` does).

``FakeRemoteTier`` is one node's view of it: a :class:`tiers.base.Tier` with the
``remote`` capability whose own accounting covers the blocks this node put. ``calls``
counts calls that reached the cluster.
"""

from __future__ import annotations

import threading
import time

from tiers.base import Capabilities, Tier, TierKind, byte_view, check_chunk, check_ranges, output_view
from tiers.errors import BlockCorrupt, BlockExists, BlockNotStored, InvalidAccess, NoRoom, MediaIOError


class FakeCluster:
    """Objects shared by every node's :class:`FakeRemoteTier` (see the module docstring)."""

    def __init__(self, timeout_s: float = 1.0):
        self.objects: dict[bytes, bytes] = {}
        self.corrupt: set[bytes] = set()
        self.down = False
        self.stall_s = 0.0
        self.timeout_s = timeout_s
        self.lock = threading.Lock()

    def check(self, deadline_s: float | None = None) -> None:
        if self.down:
            raise MediaIOError("fake cluster: master unreachable")
        if self.stall_s:
            time.sleep(min(self.stall_s, deadline_s or self.timeout_s))
            raise MediaIOError("fake cluster: no answer within the deadline")


class FakeRemoteTier(Tier):
    kind = TierKind.REMOTE
    volatile = False

    def __init__(self, cluster: FakeCluster, capacity: int = 1 << 30, name: str = "remote"):
        self.cluster = cluster
        self.name = name
        self._capacity = capacity
        self._used = 0
        self.own: dict[bytes, int] = {}
        self._pending: dict[bytes, list] = {}      # key -> [buffer, written, sent]
        self._lock = threading.Lock()
        self.calls = 0

    def _call(self, deadline_s: float | None = None) -> None:
        self.calls += 1
        self.cluster.check(deadline_s)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(remote=self)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: bytes) -> bool:
        return key in self.own

    def __len__(self) -> int:
        return len(self.own)

    def fits(self, nbytes: int) -> bool:
        return self._used + nbytes <= self._capacity

    def reserve(self, key: bytes, nbytes: int) -> None:
        if self.cluster.down:
            raise MediaIOError("fake cluster: not connected")
        with self._lock:
            if key in self.own or key in self._pending:
                raise BlockExists(f"{key.hex()[:16]} already here")
            if self._used + nbytes > self._capacity:
                raise NoRoom(f"{self.name}: {nbytes} bytes do not fit")
            self._pending[key] = [bytearray(nbytes), 0, False]
            self._used += nbytes

    def write(self, key: bytes, offset: int, data) -> None:
        p = self._pending.get(key)
        if p is None:
            raise BlockNotStored(f"{key.hex()[:16]} is not reserved")
        view = byte_view(data)
        check_chunk(offset, view.nbytes, p[1], len(p[0]))
        p[0][offset:offset + view.nbytes] = view
        p[1] += view.nbytes

    def send(self, key: bytes) -> None:
        p = self._pending.get(key)
        if p is None:
            raise BlockNotStored(f"{key.hex()[:16]} is not reserved")
        if p[1] != len(p[0]):
            raise InvalidAccess("not fully written")
        if not p[2]:
            self._call()
            with self.cluster.lock:
                self.cluster.objects.setdefault(key, bytes(p[0]))
            p[2] = True

    def commit(self, key: bytes) -> None:
        self.send(key)
        with self._lock:
            p = self._pending.pop(key)
            self.own[key] = len(p[0])

    def abort(self, key: bytes) -> None:
        with self._lock:
            p = self._pending.pop(key, None)
            if p is not None:
                self._used -= len(p[0])

    def _forget(self, key: bytes) -> None:
        with self._lock:
            n = self.own.pop(key, None)
            if n is not None:
                self._used -= n

    def size_of(self, key: bytes) -> int:
        if key in self.own:
            return self.own[key]
        self._call()
        obj = self.cluster.objects.get(key)
        if obj is None:
            raise BlockNotStored(f"{key.hex()[:16]} is not in the cluster")
        return len(obj)

    def read_into(self, key: bytes, out, ranges=None) -> int:
        self._call()
        obj = self.cluster.objects.get(key)
        if obj is None:
            self._forget(key)
            raise BlockNotStored(f"{key.hex()[:16]} is not in the cluster")
        if key in self.cluster.corrupt:
            raise BlockCorrupt(f"remote block {key.hex()[:16]}: payload checksum mismatch (injected)")
        total = check_ranges(ranges, len(obj))
        dst = output_view(out, total)
        pos = 0
        for off, n in (ranges or [(0, len(obj))]):
            dst[pos:pos + n] = obj[off:off + n]
            pos += n
        return total

    def free(self, key: bytes) -> None:
        self._forget(key)
        with self.cluster.lock:
            self.cluster.objects.pop(key, None)

    def problem(self) -> str | None:
        return "fake cluster unreachable" if self.cluster.down else None

    # RemoteStore

    def call_counters(self):
        return {}

    def exists_many(self, keys, deadline_s=None):
        self._call(deadline_s)
        found = [k in self.cluster.objects for k in keys]
        for k, hit in zip(keys, found):
            if not hit:
                self._forget(k)
        return found

    def sizes_many(self, keys, deadline_s=None):
        self._call(deadline_s)
        return [len(o) if (o := self.cluster.objects.get(k)) is not None else None for k in keys]

    def get_many_into(self, keys, outs):
        self._call()
        got = []
        for key, out in zip(keys, outs):
            obj = self.cluster.objects.get(key)
            view = byte_view(out, writable=True)
            if obj is None or key in self.cluster.corrupt or len(obj) > view.nbytes:
                if obj is not None and key in self.cluster.corrupt:
                    with self.cluster.lock:
                        self.cluster.objects.pop(key, None)      # the bad copy is dropped
                    self._forget(key)
                got.append(None)
                continue
            view[:len(obj)] = obj
            got.append(len(obj))
        return got

    def put_many(self, items):
        self._call()
        out = []
        for key, data in items:
            with self.cluster.lock:
                self.cluster.objects.setdefault(key, bytes(byte_view(data)))
            with self._lock:
                if key not in self.own:
                    self.own[key] = byte_view(data).nbytes
                    self._used += self.own[key]
            out.append(True)
        return out
