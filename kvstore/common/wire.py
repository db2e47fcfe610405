"""Raw frames: block data on gRPC without protobuf copies.

``GetRaw`` and ``PutRaw`` (service ``kvstore.v1.KVStoreData``) carry frames instead of
protobuf messages, so a payload is copied once into the message on the sending side and
once out of it on the receiving side (protobuf adds two more copies per direction).

A frame is one gRPC message::

    b"KVF1" | u32 count                              (8 bytes, little-endian)
    count records of 64 bytes:
        key (32) | u8 flags | u8 tier | u16 zero | u32 zero
        | u64 total_size | u64 offset | u64 length
    the payloads of the records, back to back, in record order

- ``flags``: bit 0 ``FOUND`` (Get: the block is stored), bit 1 ``FAILED`` (Get: the
  block failed while it was being sent; drop what arrived of it), bit 2 ``META`` (Put:
  the payload is the key's ``BlockMeta`` message, for KV events; it precedes the block).
- ``total_size``: bytes of the whole block (or of its requested ranges); ``offset``:
  where this record's payload starts in it; ``length``: payload bytes in this frame.

A block larger than one frame's room is split over several records (one per frame) at
increasing offsets; small blocks share a frame. :func:`frames` packs records so that
no frame exceeds a byte limit, counting the header and every record, also those that
carry no payload (misses).
"""

from __future__ import annotations

import ctypes
import struct
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

MAGIC = b"KVF1"
HEADER = struct.Struct("<4sI")
RECORD = struct.Struct("<32sBBHIQQQ")     # key, flags, tier, 0, 0, total_size, offset, length
RECORD_DTYPE = np.dtype([("key", "S32"), ("flags", "u1"), ("tier", "u1"), ("pad", "<u2"), ("pad2", "<u4"),
                         ("total", "<u8"), ("offset", "<u8"), ("length", "<u8")])
assert RECORD_DTYPE.itemsize == RECORD.size == 64

FOUND = 1
FAILED = 2
META = 4
"""Put: the record's payload is the next block's ``BlockMeta`` (protobuf), not block data."""


class FrameError(ValueError):
    """A frame that does not decode (wrong magic, truncated, lengths that do not add up)."""


@dataclass(frozen=True)
class Record:
    """One record of a frame; ``data`` is a view into the frame (or the payload to send)."""

    key: bytes
    flags: int
    tier: int
    total: int
    offset: int
    data: memoryview

    @property
    def found(self) -> bool:
        return bool(self.flags & FOUND)

    @property
    def failed(self) -> bool:
        return bool(self.flags & FAILED)


def frame_bytes(count: int, payload: int) -> int:
    """Size of a frame with ``count`` records and ``payload`` payload bytes."""
    return HEADER.size + count * RECORD.size + payload


def encode(records: Sequence[tuple[bytes, int, int, int, int, memoryview | bytes]]) -> bytes:
    """One frame from ``(key, flags, tier, total, offset, payload)`` tuples (one copy of
    each payload, into the returned bytes)."""
    parts: list = [HEADER.pack(MAGIC, len(records))]
    pack = RECORD.pack
    for key, flags, tier, total, offset, data in records:
        parts.append(pack(key, flags, tier, 0, 0, total, offset, len(data)))
    parts.extend(r[5] for r in records if len(r[5]))
    return b"".join(parts)


def decode(frame: bytes | memoryview) -> list[Record]:
    """The records of one frame, their data as views into ``frame``. Raises FrameError."""
    view = memoryview(frame)
    if len(view) < HEADER.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than its header")
    magic, count = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r}")
    start = HEADER.size + count * RECORD.size
    if start > len(view):
        raise FrameError(f"frame of {len(view)} bytes cannot hold {count} records")
    recs = np.frombuffer(view, dtype=RECORD_DTYPE, count=count, offset=HEADER.size)
    lengths = recs["length"].tolist()           # Python ints: no 64-bit wrap in the sum
    if sum(lengths) != len(view) - start:
        raise FrameError(f"frame payload is {len(view) - start} bytes, records say {sum(lengths)}")
    out: list[Record] = []
    pos = start
    for rec, n in zip(recs.tolist(), lengths):
        key, flags, tier, _, _, total, offset, _ = rec
        if len(key) < 32:                       # numpy strips trailing NUL bytes of S32
            key = key.ljust(32, b"\0")
        if offset + n > total and not flags & META:
            raise FrameError(f"record [{offset}, {offset + n}) overruns its block of {total} bytes")
        out.append(Record(key, flags, tier, total, offset, view[pos:pos + n]))
        pos += n
    return out


def _bytes_constructor():
    """CPython's ``PyBytes_FromStringAndSize`` (None elsewhere): with a NULL source it
    returns a new bytes object whose contents its creator fills before anyone else sees
    it (the C API's documented way to build bytes in place)."""
    if sys.implementation.name != "cpython" or not hasattr(ctypes, "pythonapi"):
        return None
    fn = ctypes.pythonapi.PyBytes_FromStringAndSize
    fn.restype = ctypes.py_object
    fn.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    return fn


_NEW_BYTES = _bytes_constructor()
IN_PLACE_MIN = 64 << 10
"""Frames of at least this many bytes are written in place (:class:`OutFrame`); smaller
ones are copied once into bytes (the copy costs less than the set-up)."""


class _Memory:
    """An address and a length as a numpy array's memory; ``owner`` keeps it alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: bytes, address: int, nbytes: int):
        self.owner = owner
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class OutFrame:
    """A frame of ``nbytes`` bytes filled through :attr:`array` and sent as ``bytes``.

    gRPC sends only ``bytes``. On CPython a frame of :data:`IN_PLACE_MIN` bytes or more is
    a new bytes object filled in place (payloads are read straight into the message,
    saving one copy of every byte); elsewhere, and for small frames, :attr:`array` is a
    numpy buffer that :meth:`finish` copies into bytes. Fill every byte before
    :meth:`finish`; after it, :attr:`array` is None and the bytes are never written again.
    """

    __slots__ = ("array", "_bytes")

    def __init__(self, nbytes: int):
        self._bytes: bytes | None = None
        if _NEW_BYTES is not None and nbytes >= IN_PLACE_MIN:
            self._bytes = _NEW_BYTES(None, nbytes)
            address = ctypes.cast(self._bytes, ctypes.c_void_p).value     # its contents
            self.array: np.ndarray | None = np.asarray(_Memory(self._bytes, address, nbytes))
        else:
            self.array = np.empty(nbytes, dtype=np.uint8)

    def write_records(self, records: Sequence[tuple[bytes, int, int, int, int, int]]) -> int:
        """Write the header and ``(key, flags, tier, total, offset, length)`` records at
        the start of the frame; returns where the first payload goes (bytes)."""
        HEADER.pack_into(self.array, 0, MAGIC, len(records))
        pos = HEADER.size
        for key, flags, tier, total, offset, length in records:
            RECORD.pack_into(self.array, pos, key, flags, tier, 0, 0, total, offset, length)
            pos += RECORD.size
        return pos

    def finish(self) -> bytes:
        """The frame's bytes (no copy when written in place)."""
        array, self.array = self.array, None
        if self._bytes is None:
            return array.tobytes()
        frame, self._bytes = self._bytes, None
        return frame


class FrameBuilder:
    """Accumulates records into frames of at most ``limit`` bytes.

    >>> b = FrameBuilder(1 << 16)
    >>> b.room() > 0
    True
    """

    def __init__(self, limit: int):
        if limit < frame_bytes(1, 1):
            raise ValueError(f"frame limit {limit} is below the smallest frame ({frame_bytes(1, 1)} bytes)")
        self.limit = limit
        self._batch: list = []
        self._used = HEADER.size

    def room(self) -> int:
        """Payload bytes one more record may carry in the current frame (may be 0 or less)."""
        return self.limit - self._used - RECORD.size

    def add(self, key: bytes, flags: int, tier: int, total: int, offset: int, data) -> None:
        """Append a record; the caller checked :meth:`room` (or the frame is empty)."""
        self._batch.append((key, flags, tier, total, offset, data))
        self._used += RECORD.size + len(data)

    def __bool__(self) -> bool:
        return bool(self._batch)

    def flush(self) -> bytes | None:
        """The current frame's bytes (None when empty); starts a new frame."""
        if not self._batch:
            return None
        frame = encode(self._batch)
        self._batch, self._used = [], HEADER.size
        return frame


def frames(items: Iterable[tuple[bytes, int, int, int, memoryview | bytes | None]], limit: int,
           chunk: int) -> Iterator[bytes]:
    """Pack blocks into frames of at most ``limit`` bytes.

    ``items`` yields ``(key, flags, tier, total, payload)``: a whole block's payload
    (``None`` or empty for a miss). A payload larger than ``chunk`` bytes, or than the
    room left in a frame, is split into records at increasing offsets; a ``META`` record
    never is (its reader decodes it whole): it starts a new frame when the current one has
    no room for it.
    Raises ValueError when ``limit`` cannot hold one record with one byte of payload, or
    a ``META`` payload whole.
    """
    builder = FrameBuilder(limit)
    for key, flags, tier, total, payload in items:
        data = memoryview(payload).cast("B") if payload is not None and len(payload) else memoryview(b"")
        if flags & META:
            if len(data) > builder.room() and builder:
                yield builder.flush()
            if len(data) > builder.room():
                raise ValueError(f"a META record of {len(data)} bytes does not fit a frame of {limit} bytes")
            builder.add(key, flags, tier, total, 0, data)
            continue
        pos = 0
        while True:
            remaining = len(data) - pos
            room = builder.room()
            if room < (1 if remaining else 0):
                yield builder.flush()
                continue
            n = min(remaining, chunk, room)
            builder.add(key, flags, tier, total, pos, data[pos:pos + n])
            pos += n
            if pos >= len(data):
                break
    last = builder.flush()
    if last is not None:
        yield last
