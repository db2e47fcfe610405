"""The one in-memory fake tier of the test suite, with fault hooks and declarable
capabilities (for manager, mover, prefetch and reliability tests).

``MemTier`` keeps committed blocks in a dict and accounts bytes like a real tier. Hooks,
settable at any time:

- ``write_gate``: a ``threading.Event`` that ``write`` waits on (a hung or slow disk; it
  gives up after ``gate_timeout`` s with MediaIOError); ``writing`` is set once a write
  waits there, ``waiting_writes`` counts them;
- ``fail_writes``: ``write`` raises MediaIOError (a failing medium);
- ``read_gate``: a ``threading.Event`` that ``read_into`` waits on (a slow read);
  ``reading`` is set when a read waits there;
- ``corrupt``: keys whose reads raise BlockCorrupt.

``bytes_read`` counts payload bytes read, ``writes`` counts write calls. ``host=True``
declares the ``host`` capability (zero-copy views).
"""

from __future__ import annotations

import threading

from tiers.base import Capabilities, Tier, TierKind, byte_view, check_chunk, check_ranges, output_view
from tiers.errors import BlockCorrupt, BlockExists, BlockNotStored, InvalidAccess, NoRoom, MediaIOError


class MemTier(Tier):
    """A tier in a dict (see the module docstring).

    Args:
        kind: the medium it stands for; ``capacity``: bytes.
        name: defaults to the kind's name.
        host: declare the ``host`` capability.
        volatile: defaults by kind (HBM and host volatile, NVMe not).
    """

    def __init__(self, kind: TierKind, capacity: int, name: str | None = None, *, host: bool = False,
                 volatile: bool | None = None):
        self.kind = kind
        self.name = name or kind.name.lower()
        self.volatile = kind in (TierKind.HBM, TierKind.HOST) if volatile is None else volatile
        self._capacity = capacity
        self._used = 0
        self.data: dict[bytes, bytes] = {}
        self._reserved: dict[bytes, bytearray] = {}
        self._written: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._caps = Capabilities(host=self if host else None)
        self.write_gate: threading.Event | None = None
        self.gate_timeout = 20.0
        self.writing = threading.Event()
        self.fail_writes = False
        self.read_gate: threading.Event | None = None
        self.reading = threading.Event()
        self.corrupt: set[bytes] = set()
        self.writes = 0
        self.bytes_read = 0
        self.waiting_writes = 0
        self.waiting_reads = 0

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: bytes) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)

    def fits(self, nbytes: int) -> bool:
        return self._used + nbytes <= self._capacity

    def size_of(self, key: bytes) -> int:
        try:
            return len(self.data[key])
        except KeyError:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}") from None

    def reserve(self, key: bytes, nbytes: int) -> None:
        with self._lock:
            if key in self.data or key in self._reserved:
                raise BlockExists(f"block {key.hex()[:16]} already present in {self.name}")
            if self._used + nbytes > self._capacity:
                raise NoRoom(f"{self.name}: {nbytes} bytes do not fit ({self._used}/{self._capacity})")
            self._used += nbytes
            self._reserved[key] = bytearray(nbytes)
            self._written[key] = 0

    def _gate(self, gate: threading.Event, flag: threading.Event, counter: str) -> bool:
        flag.set()
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
        try:
            return gate.wait(self.gate_timeout)
        finally:
            with self._lock:
                setattr(self, counter, getattr(self, counter) - 1)

    def write(self, key: bytes, offset: int, data) -> None:
        self.writes += 1
        gate = self.write_gate
        if gate is not None and not self._gate(gate, self.writing, "waiting_writes"):
            raise MediaIOError(f"{self.name}: write of {key.hex()[:16]} hung for {self.gate_timeout}s")
        if self.fail_writes:
            raise MediaIOError(f"{self.name}: injected write failure")
        src = bytes(byte_view(data))
        with self._lock:
            buf = self._reserved.get(key)
            if buf is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            check_chunk(offset, len(src), self._written[key], len(buf))
            buf[offset:offset + len(src)] = src
            self._written[key] = offset + len(src)

    def write_view(self, key: bytes) -> memoryview:
        with self._lock:
            buf = self._reserved.get(key)
            if buf is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            return memoryview(buf)

    def mark_written(self, key: bytes, nbytes: int) -> None:
        with self._lock:
            buf = self._reserved.get(key)
            if buf is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            if not 0 <= nbytes <= len(buf):
                raise InvalidAccess(f"{nbytes} bytes is outside the reserved {len(buf)} bytes")
            self._written[key] = nbytes

    def commit(self, key: bytes) -> None:
        with self._lock:
            buf = self._reserved.get(key)
            if buf is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")
            if self._written[key] != len(buf):
                raise InvalidAccess(f"block {key.hex()[:16]}: {self._written[key]} of {len(buf)} bytes written")
            del self._reserved[key], self._written[key]
            self.data[key] = bytes(buf)

    def abort(self, key: bytes) -> None:
        with self._lock:
            buf = self._reserved.pop(key, None)
            if buf is not None:
                del self._written[key]
                self._used -= len(buf)

    def read_into(self, key: bytes, out, ranges=None) -> int:
        self.size_of(key)
        gate = self.read_gate
        if gate is not None:
            self._gate(gate, self.reading, "waiting_reads")
        data = self.data.get(key)          # after the wait: a block freed meanwhile is gone
        if data is None:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
        if key in self.corrupt:
            raise BlockCorrupt(f"{self.name}: block {key.hex()[:16]} fails its checksum (injected)")
        total = check_ranges(ranges, len(data))
        dst = output_view(out, total)
        pos = 0
        for off, n in (ranges or [(0, len(data))]):
            dst[pos:pos + n] = data[off:off + n]
            pos += n
        self.bytes_read += total
        return total

    def view(self, key: bytes) -> memoryview:
        try:
            return memoryview(self.data[key])
        except KeyError:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}") from None

    def free(self, key: bytes) -> None:
        with self._lock:
            data = self.data.pop(key, None)
            if data is None:
                raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}")
            self._used -= len(data)
