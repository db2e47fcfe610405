"""On-disk format of the NVMe tier: folder layout, block files, index values.

Folder (the tier's ``path``)::

    path/LOCK                          flock'ed by the one process that owns the folder
    path/index/data.mdb                LMDB index (see "Index" below); a cache of the headers
    path/index.damaged-<UTC time>/     a damaged index moved aside, kept for inspection
    path/blocks/abc/<key hex>          one block file: 64 lowercase hex digits of the key,
                                       abc being its first three hex digits
    path/blocks/abc/<key hex>.tmp      a block being written: never read, removed at start
    path/spare/<number>                freed block files kept for reuse; they hold no block
    path/quarantine/<name>             files found with a bad header or in the wrong place,
                                       moved aside at start (never deleted by the tier)

Keys appear on disk only as hex, so no key, however hostile, names another path. The
4,096 block folders are made as blocks first land in them: a folder costs one ``mkdir``
in the tier's life (an ext4 ``mkdir`` cost about 0.5 ms of CPU here, and earlier tiers'
two levels, ``blocks/ab/cd/``, made up to 65,536 of them: a new tier paid one for almost
every block). A folder in that earlier layout has its block files moved into this one
when the tier opens (:mod:`tiers.nvme.recover`).

Block file (format version 1), all integers little-endian::

    offset        bytes  field
    0             8      magic  b"KVSBLK\\r\\n"
    8             2      format version (1)
    10            2      flags (0)
    12            4      header bytes H: a multiple of 4096, the payload's file offset
    16            32     key
    48            8      payload size in bytes
    56            4      chunk bytes C: a power of two, a multiple of 4096
    60            4      number of chunks n = ceil(size / C)
    64            8      write time, Unix seconds (float64); orders blocks at recovery
    72            8      reserved (0)
    80            8 * n  xxh3_64 of each payload chunk; chunk i is payload bytes
                         [i*C, min((i+1)*C, size))
    80 + 8n       8      xxh3_64 of header bytes [0, 80 + 8n): the header checksum
    ...           ...    zeros up to H
    H             size   the payload
    H + size      ...    zeros up to a multiple of 4096 (the file is H + ceil4096(size) bytes)

The header makes each file self-describing, so the index can be rebuilt from the files
alone (:mod:`tiers.nvme.recover`), and its per-chunk checksums let a ranged read
(a TP rank reading its KV heads) read and verify only the chunks it serves: every byte
served was verified, and no read needs more than its chunks plus the header. The
payload starts page aligned, so O_DIRECT reads land straight in a page-aligned caller
buffer. ``H = ceil4096(88 + 8n)``: one page up to 501 chunks (blocks up to 7.8 MiB at
the default 16 KiB chunks).

Index: LMDB, key (32 bytes) -> ``<QIId`` (payload size, chunk bytes, 0, write time),
plus :data:`FORMAT_KEY` -> :data:`FORMAT_VALUE`. The checksums live only in the files.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass

import xxhash

PAGE = 4096
"""O_DIRECT unit in bytes: file offsets, lengths and buffer addresses are multiples of
it; block files are whole pages."""

MAGIC = b"KVSBLK\r\n"
FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 16 << 10
"""Default checksum granularity (bytes): a ranged read reads whole chunks."""

KEY_BYTES = 32
"""Block key length (kvstore.common.keys.KEY_BYTES; tiers do not import kvstore)."""

MAX_HEADER_BYTES = 64 << 20
"""Largest header a reader accepts (bytes): 8M chunks."""

FORMAT_KEY = b"\x00kvstore.nvme.format"
FORMAT_VALUE = b"2"
"""Index format marker: index values of this tier (v1 indexes, without the marker, held
xxh3_64 of headerless files)."""

_FIXED = struct.Struct("<8sHHI32sQIIdQ")          # 80 bytes, up to the chunk checksums
_SUM = struct.Struct("<Q")
_INDEX_VALUE = struct.Struct("<QIId")
_HEX = frozenset("0123456789abcdef")
_ZERO_PAGE = bytes(PAGE)


class HeaderError(ValueError):
    """A block file's header is missing, damaged or does not describe the expected block."""


def ceil_page(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 4096-byte pages."""
    return (nbytes + PAGE - 1) & ~(PAGE - 1)


def floor_page(nbytes: int) -> int:
    return nbytes & ~(PAGE - 1)


def check_chunk_bytes(chunk_bytes: int) -> int:
    """Validate a chunk size: a power of two of at least 4096 bytes, at most 1 GiB.
    Raises ValueError."""
    if not isinstance(chunk_bytes, int) or chunk_bytes < PAGE or chunk_bytes > 1 << 30 \
            or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes must be a power of two from 4096 to 1 GiB, got {chunk_bytes!r}")
    return chunk_bytes


def num_chunks(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def header_bytes(size: int, chunk_bytes: int) -> int:
    """Header length H in bytes (the payload's file offset) of a ``size``-byte block."""
    return ceil_page(_FIXED.size + _SUM.size * (num_chunks(size, chunk_bytes) + 1))


def file_bytes(size: int, chunk_bytes: int) -> int:
    """Bytes a block file of ``size`` payload bytes has, header included: what the block
    costs in the tier's capacity."""
    return header_bytes(size, chunk_bytes) + ceil_page(size)


def chunk_sums(payload: memoryview, chunk_bytes: int) -> list[int]:
    """xxh3_64 of each ``chunk_bytes`` chunk of ``payload`` (the last may be shorter)."""
    digest = xxhash.xxh3_64_intdigest
    return [digest(payload[i:i + chunk_bytes]) for i in range(0, payload.nbytes, chunk_bytes)]


@dataclass(frozen=True)
class BlockHeader:
    """A decoded block file header.

    Attributes:
        key: the block key (32 bytes).
        size: payload bytes.
        chunk_bytes: checksum granularity C in bytes.
        written_at: write time, Unix seconds.
        sums: xxh3_64 of each chunk (``ceil(size / C)`` integers).
        header_bytes: H, the payload's file offset.
    """

    key: bytes
    size: int
    chunk_bytes: int
    written_at: float
    sums: tuple[int, ...]
    header_bytes: int

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + ceil_page(self.size)


def encode_header(out: memoryview, key: bytes, size: int, chunk_bytes: int, written_at: float,
                  sums: list[int]) -> int:
    """Write the header of a block into the start of ``out`` (zero-padded to H); return H.

    Raises ValueError when ``sums`` does not hold one checksum per chunk or ``out`` is
    shorter than H.
    """
    n = num_chunks(size, chunk_bytes)
    if len(sums) != n:
        raise ValueError(f"{len(sums)} chunk checksums for {n} chunks")
    h = header_bytes(size, chunk_bytes)
    if out.nbytes < h:
        raise ValueError(f"header needs {h} bytes, the buffer has {out.nbytes}")
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, 0, h, key, size, chunk_bytes, n, written_at, 0)
    end = _FIXED.size + _SUM.size * n
    if n:
        _sums_struct(n).pack_into(out, _FIXED.size, *sums)
    _SUM.pack_into(out, end, xxhash.xxh3_64_intdigest(out[:end]))
    end += _SUM.size
    out[end:h] = _ZERO_PAGE[:h - end] if h - end <= PAGE else bytes(h - end)
    return h


@functools.lru_cache(maxsize=64)
def _sums_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def header_length(first: memoryview) -> int:
    """H, read from the first bytes (at least 16) of a block file. Raises HeaderError when
    they do not start a header of this format."""
    if first.nbytes < 16 or bytes(first[:8]) != MAGIC:
        raise HeaderError("no block header (bad magic)")
    version, _, h = struct.unpack_from("<HHI", first, 8)
    if version != FORMAT_VERSION:
        raise HeaderError(f"block format version {version}, this tier reads {FORMAT_VERSION}")
    if h < PAGE or h % PAGE or h > MAX_HEADER_BYTES:
        raise HeaderError(f"bad header length {h}")
    return h


def decode_header(buf: memoryview, expect_key: bytes | None = None) -> BlockHeader:
    """Decode and verify a block header (the file's first H bytes, or more).

    Checks the magic, version, header checksum, geometry and, when given, the key.
    Raises HeaderError saying what is wrong.
    """
    h = header_length(buf)
    if buf.nbytes < h:
        raise HeaderError(f"header truncated: {buf.nbytes} of {h} bytes")
    _, _, _, _, key, size, chunk, n, written_at, _ = _FIXED.unpack_from(buf, 0)
    if chunk < PAGE or chunk & (chunk - 1) or chunk > 1 << 30:
        raise HeaderError(f"bad chunk size {chunk}")
    if n != num_chunks(size, chunk) or header_bytes(size, chunk) != h:
        raise HeaderError(f"header geometry does not add up ({size} bytes, {n} chunks, H={h})")
    end = _FIXED.size + _SUM.size * n
    (stored,) = _SUM.unpack_from(buf, end)
    if xxhash.xxh3_64_intdigest(buf[:end]) != stored:
        raise HeaderError("header checksum mismatch")
    if not math.isfinite(written_at):
        raise HeaderError("bad write time")
    if expect_key is not None and key != expect_key:
        raise HeaderError(f"header names block {key.hex()[:16]}, expected {expect_key.hex()[:16]}")
    sums = _sums_struct(n).unpack_from(buf, _FIXED.size) if n else ()
    return BlockHeader(bytes(key), size, chunk, written_at, sums, h)


def read_header(path: str, key: bytes) -> BlockHeader:
    """Read and verify the header of the block file at ``path`` (not following a symbolic
    link): one page-sized ``pread``, a second only for a header longer than a page.

    Raises HeaderError when the bytes prove the header bad (bad magic, checksum, key,
    geometry; a file shorter than its header), OSError when the file cannot be opened or
    read (ENOENT, ELOOP for a symbolic link, EMFILE, EIO, ...): no proof about the block."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        first = os.pread(fd, PAGE, 0)
        h = header_length(memoryview(first))
        buf = first if h <= len(first) else first + os.pread(fd, h - len(first), len(first))
        return decode_header(memoryview(buf), key)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- index values


class IndexEntry:
    """What the index holds for a block: payload ``size`` and ``chunk_bytes`` (bytes),
    ``written_at`` (Unix seconds); ``header_bytes`` and ``file_bytes`` follow from them.
    Immutable by convention (compared by value)."""

    __slots__ = ("size", "chunk_bytes", "written_at", "header_bytes", "file_bytes")

    def __init__(self, size: int, chunk_bytes: int, written_at: float, header_len: int = 0):
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.written_at = written_at
        self.header_bytes = header_len or header_bytes(size, chunk_bytes)
        self.file_bytes = self.header_bytes + ceil_page(size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IndexEntry) and (self.size, self.chunk_bytes, self.written_at) == \
            (other.size, other.chunk_bytes, other.written_at)

    def __repr__(self) -> str:
        return f"IndexEntry(size={self.size}, chunk_bytes={self.chunk_bytes}, written_at={self.written_at})"

    def pack(self) -> bytes:
        return _INDEX_VALUE.pack(self.size, self.chunk_bytes, 0, self.written_at)

    @classmethod
    def unpack(cls, value: bytes) -> "IndexEntry":
        """Raises ValueError for a value of another length or with impossible fields."""
        if len(value) != _INDEX_VALUE.size:
            raise ValueError(f"index value of {len(value)} bytes")
        size, chunk, _, written_at = _INDEX_VALUE.unpack(value)
        if chunk < PAGE or chunk & (chunk - 1) or chunk > 1 << 30 or size >= 1 << 48 \
                or not math.isfinite(written_at):
            raise ValueError("index value out of range")
        return cls(size, chunk, written_at)

    @classmethod
    def of(cls, header: BlockHeader) -> "IndexEntry":
        return cls(header.size, header.chunk_bytes, header.written_at)


# ---------------------------------------------------------------------- names


FOLDER_DIGITS = 3
"""A block's folder is named by the first this many hex digits of its key."""


def block_path(blocks_dir: str, key: bytes) -> str:
    """Path of a block's file under ``blocks_dir``: ``blocks_dir/abc/<key hex>``."""
    h = key.hex()
    return f"{blocks_dir}{os.sep}{h[:FOLDER_DIGITS]}{os.sep}{h}"


def key_of_name(name: str) -> bytes | None:
    """The key a block file name stands for, or None when it is not a block file name."""
    if len(name) == 2 * KEY_BYTES and set(name) <= _HEX:
        return bytes.fromhex(name)
    return None


__all__ = ["BlockHeader", "DEFAULT_CHUNK_BYTES", "FORMAT_KEY", "FORMAT_VALUE", "FORMAT_VERSION",
           "FOLDER_DIGITS", "HeaderError", "IndexEntry", "KEY_BYTES", "MAGIC", "PAGE", "block_path", "ceil_page",
           "check_chunk_bytes", "chunk_sums", "decode_header", "encode_header", "file_bytes",
           "floor_page", "header_bytes", "header_length", "key_of_name", "num_chunks", "read_header"]
