"""How a block is laid out as one object in a cluster store (the remote tier).

A cluster store (Mooncake Store) keeps opaque objects under string names and gives no
checksum of its own that survives a copy between nodes, so every block object carries
a small header of ours in front of the payload::

    offset  size  field
    0       4     magic  b"KVB1"
    4       4     header bytes (64), little-endian u32, so a later format can grow
    8       8     payload bytes, u64
    16      8     xxh3_64 of the payload, u64
    24      32    the block key (32 bytes)
    56      8     zero padding (the payload starts 64-byte aligned)
    64      ...   payload

A reader checks the object's length against the header, the magic, the key (an object
copied under another key's name is caught) and the payload checksum before any byte
is served. Any mismatch raises :class:`tiers.errors.BlockCorrupt`.
"""

from __future__ import annotations

import struct

import xxhash

from tiers.errors import BlockCorrupt, InvalidAccess

MAGIC = b"KVB1"
HEADER_BYTES = 64
KEY_BYTES = 32
_HEAD = struct.Struct("<4sIQQ32s")          # 56 bytes; the rest of the 64 is zero


def object_bytes(nbytes: int) -> int:
    """Bytes of the object that holds a payload of ``nbytes`` bytes."""
    return HEADER_BYTES + nbytes


def check_key(key: bytes) -> None:
    """Raise InvalidAccess unless ``key`` is a 32-byte ``bytes`` block key."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidAccess(f"a block key is {KEY_BYTES} bytes, got {key!r:.80}")


def object_name(prefix: str, key: bytes) -> str:
    """The cluster object name of ``key``: ``prefix`` then 64 lowercase hex digits."""
    check_key(key)
    return prefix + key.hex()


def pack_header(out: memoryview, key: bytes, nbytes: int, checksum: int) -> None:
    """Write the 64-byte header for a payload of ``nbytes`` bytes whose xxh3_64 is
    ``checksum`` into the first 64 bytes of writable byte view ``out``."""
    _HEAD.pack_into(out, 0, MAGIC, HEADER_BYTES, nbytes, checksum, key)
    out[_HEAD.size:HEADER_BYTES] = bytes(HEADER_BYTES - _HEAD.size)


def encode_into(out: memoryview, key: bytes, payload: memoryview) -> int:
    """Lay out header + ``payload`` at the start of ``out``; return the object's bytes."""
    n = payload.nbytes
    out[HEADER_BYTES:HEADER_BYTES + n] = payload
    pack_header(out, key, n, xxhash.xxh3_64_intdigest(payload))
    return HEADER_BYTES + n


def verify(obj: memoryview, key: bytes, expect_nbytes: int | None = None) -> memoryview:
    """Check a fetched object of ``obj.nbytes`` bytes against ``key`` and return a view
    of its payload.

    Args:
        obj: the object's bytes exactly as the store returned them (its length is the
            object's length).
        key: the block key it was fetched under.
        expect_nbytes: payload size the caller believes the block has, or None.

    Raises:
        BlockCorrupt: too short for a header, wrong magic or header size, another key,
            a length that disagrees with the header or with ``expect_nbytes``, or a
            payload whose xxh3_64 differs from the header's.
    """
    name = key.hex()[:16]
    if obj.nbytes < HEADER_BYTES:
        raise BlockCorrupt(f"remote block {name}: object of {obj.nbytes} bytes has no header")
    magic, hbytes, nbytes, checksum, stored_key = _HEAD.unpack_from(obj, 0)
    if magic != MAGIC or hbytes != HEADER_BYTES:
        raise BlockCorrupt(f"remote block {name}: not a kvstore block object (magic {magic!r})")
    if stored_key != key:
        raise BlockCorrupt(f"remote block {name}: object holds block {stored_key.hex()[:16]}")
    if obj.nbytes != HEADER_BYTES + nbytes:
        raise BlockCorrupt(f"remote block {name}: object has {obj.nbytes} bytes, header says "
                           f"{HEADER_BYTES + nbytes} (truncated or padded)")
    if expect_nbytes is not None and nbytes != expect_nbytes:
        raise BlockCorrupt(f"remote block {name}: {nbytes} payload bytes, {expect_nbytes} were stored")
    payload = obj[HEADER_BYTES:HEADER_BYTES + nbytes]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise BlockCorrupt(f"remote block {name}: payload checksum mismatch")
    return payload


__all__ = ["HEADER_BYTES", "KEY_BYTES", "MAGIC", "check_key", "encode_into", "object_bytes", "object_name",
           "pack_header", "verify"]
