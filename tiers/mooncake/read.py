"""Single-block reads of the Mooncake remote tier (:class:`tiers.mooncake.MooncakeTier`):
the whole object is fetched into the staging buffer and verified (:mod:`tiers.mooncake.object_format`)
before any byte is copied out, so a wrong, truncated or foreign copy is BlockCorrupt,
never wrong KV."""

from __future__ import annotations

from typing import Any

from tiers.buffers import ByteRanges, check_ranges, output_view
from tiers.errors import BlockCorrupt, BlockNotStored, MediaIOError
from tiers.mooncake.client import INVALID_PARAMS, OBJECT_NOT_FOUND, code_name, master_down
from tiers.mooncake.context import RemoteContext
from tiers.mooncake.guard import RemoteTimeout
from tiers.mooncake.object_format import HEADER_BYTES, check_key, object_bytes, verify
from tiers.mooncake.staging import Lease


class BlockReads:
    """``size_of`` and ``read_into`` of one block, over the tier's :class:`RemoteContext`."""

    def __init__(self, ctx: RemoteContext):
        self._ctx = ctx

    def size_of(self, key: bytes) -> int:
        """Payload bytes of a block in the cluster (no call when this node put it).
        Raises BlockNotStored, BlockCorrupt (an object too short for a header), MediaIOError."""
        check_key(key)
        ctx = self._ctx
        n = ctx.ledger.size(key)
        if n is not None:
            return n
        rc = ctx.guard.call(ctx.session().get_size, ctx.object_name(key), judge=master_down)
        if rc == OBJECT_NOT_FOUND:
            raise BlockNotStored(f"{ctx.name}: block {key.hex()[:16]} is not in the cluster")
        if rc < 0:
            raise MediaIOError(f"{ctx.name}: size of {key.hex()[:16]}: {code_name(rc)}")
        if rc < HEADER_BYTES:
            ctx.faults.corrupt += 1
            raise BlockCorrupt(f"{ctx.name}: remote block {key.hex()[:16]} is {rc} bytes, shorter than its header")
        return rc - HEADER_BYTES

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> int:
        """Copy a block (or the concatenation of ``ranges`` of it) from the cluster into
        the start of ``out``; return the bytes copied.

        The whole object is fetched into the staging buffer and verified even when
        ``ranges`` ask for part of it: the checksum covers the whole payload. A block
        this node did not put costs one more call (its size).

        Raises BlockNotStored, InvalidAccess, BlockCorrupt (wrong, truncated or foreign
        copy; the caller drops it with :meth:`MooncakeTier.free`), MediaIOError (master or
        peer down, deadline passed, breaker open)."""
        ctx = self._ctx
        size = self.size_of(key)
        total = check_ranges(ranges, size)
        dst = output_view(out, total)
        obj = object_bytes(size)
        lease = ctx.staging.lease(obj, wait_s=ctx.config.timeout_s)
        # An object longer than ``obj`` fails with INVALID_PARAMS (it cannot be ours).
        rc = self._get_into(lease, obj, ctx.object_name(key))
        if rc == OBJECT_NOT_FOUND:
            ctx.ledger.forget(key)
            raise BlockNotStored(f"{ctx.name}: block {key.hex()[:16]} is not in the cluster")
        if rc == INVALID_PARAMS:
            ctx.faults.corrupt += 1
            raise BlockCorrupt(f"{ctx.name}: remote block {key.hex()[:16]} is longer than its {size} bytes")
        if rc < 0:
            ctx.faults.peer_errors += 1
            raise MediaIOError(f"{ctx.name}: read of {key.hex()[:16]} failed: {code_name(rc)}")
        try:
            try:
                payload = verify(lease.view[:rc], key, size)
            except BlockCorrupt:
                ctx.faults.corrupt += 1
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

    def _get_into(self, lease: Lease, obj: int, name: str) -> int:
        """``get_into`` into ``lease``; on a negative code or an exception the lease is
        released here, on success the caller releases it after verifying."""
        ctx = self._ctx
        try:
            store = ctx.session()
            rc = ctx.guard.call(store.get_into, name, lease.address, obj, deadline_s=ctx.config.deadline_s(obj),
                                judge=master_down, on_abandon=lease.release)
        except RemoteTimeout:
            raise
        except BaseException:
            lease.release()
            raise
        if rc < 0:
            lease.release()
        return rc


__all__ = ["BlockReads"]
