"""Single-block reads of the Mooncake remote tier (:class:`tiers.mooncake.MooncakeTier`):
the whole object is fetched into the staging buffer and verified (:mod:`tiers.mooncake.object_format`)
before any byte is copied out, so a wrong, truncated or foreign copy is BlockCorrupt,
never wrong KV."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiers.base import ByteRanges, check_ranges, output_view
from tiers.errors import BlockCorrupt, BlockNotStored, MediaIOError
from tiers.mooncake.client import INVALID_PARAMS, MASTER_DOWN, OBJECT_NOT_FOUND, code_name
from tiers.mooncake.object_format import HEADER_BYTES, check_key, object_bytes, verify
from tiers.mooncake.guard import RemoteTimeout
from tiers.mooncake.staging import Lease

if TYPE_CHECKING:
    from tiers.mooncake.tier import MooncakeTier


def _master_down(rc: int) -> str | None:
    return f"master unreachable: {code_name(rc)}" if rc in MASTER_DOWN else None


def size_of(tier: "MooncakeTier", key: bytes) -> int:
    """Payload bytes of a block in the cluster (no call when this node put it).
    Raises BlockNotStored, BlockCorrupt (an object too short for a header), MediaIOError."""
    check_key(key)
    n = tier._own.get(key)
    if n is not None:
        return n
    rc = tier._guard.call(tier._session().get_size, tier._name(key), judge=_master_down)
    if rc == OBJECT_NOT_FOUND:
        raise BlockNotStored(f"{tier.name}: block {key.hex()[:16]} is not in the cluster")
    if rc < 0:
        raise MediaIOError(f"{tier.name}: size of {key.hex()[:16]}: {code_name(rc)}")
    if rc < HEADER_BYTES:
        tier._corrupt += 1
        raise BlockCorrupt(f"{tier.name}: remote block {key.hex()[:16]} is {rc} bytes, shorter than its header")
    return rc - HEADER_BYTES


def read_into(tier: "MooncakeTier", key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
    """Copy a block (or the concatenation of ``ranges`` of it) from the cluster into
    the start of ``out``; return the bytes copied.

    The whole object is fetched into the staging buffer and verified even when
    ``ranges`` ask for part of it: the checksum covers the whole payload. A block
    this node did not put costs one more call (its size).

    Raises BlockNotStored, InvalidAccess, BlockCorrupt (wrong, truncated or foreign
    copy; the caller drops it with :meth:`MooncakeTier.free`), MediaIOError (master or
    peer down, deadline passed, breaker open)."""
    size = size_of(tier, key)
    total = check_ranges(ranges, size)
    dst = output_view(out, total)
    obj = object_bytes(size)
    lease = tier._staging.lease(obj, wait_s=tier.config.timeout_s)
    # An object longer than ``obj`` fails with INVALID_PARAMS (it cannot be ours).
    rc = _read_call(tier, lease, obj, tier._name(key))
    if rc == OBJECT_NOT_FOUND:
        tier._forget(key)
        raise BlockNotStored(f"{tier.name}: block {key.hex()[:16]} is not in the cluster")
    if rc == INVALID_PARAMS:
        tier._corrupt += 1
        raise BlockCorrupt(f"{tier.name}: remote block {key.hex()[:16]} is longer than its {size} bytes")
    if rc < 0:
        tier._peer_errors += 1
        raise MediaIOError(f"{tier.name}: read of {key.hex()[:16]} failed: {code_name(rc)}")
    try:
        try:
            payload = verify(lease.view[:rc], key, size)
        except BlockCorrupt:
            tier._corrupt += 1
            raise
        if not ranges:
            dst[:] = payload
        else:
            pos = 0
            for off, length in ranges:
                dst[pos:pos + length] = payload[off:off + length]
                pos += length
        return total
    finally:
        lease.release()


def _read_call(tier: "MooncakeTier", lease: Lease, obj: int, name: str) -> int:
    """``get_into`` into ``lease``; on a negative code or an exception the lease is
    released here, on success the caller releases it after verifying."""
    try:
        store = tier._session()
        rc = tier._guard.call(store.get_into, name, lease.address, obj, deadline_s=tier.config.deadline_s(obj),
                              judge=_master_down, on_abandon=lease.release)
    except RemoteTimeout:
        raise
    except BaseException:
        lease.release()
        raise
    if rc < 0:
        lease.release()
    return rc


__all__ = ["read_into", "size_of"]
