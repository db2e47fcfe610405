"""Reads: a pinned block read straight into the caller's buffer, whole or by byte ranges.

:meth:`Reads.reader` pins a block for a read in several pieces (a large block streamed
in chunks, :mod:`kvstore.service.get_stream`); :meth:`Reads.read_into` is one read. Each read
goes to the fastest tier holding a good copy; a copy that fails its checksum or its
medium is dropped and counted (``corrupt_blocks``, ``read_errors``) and the next copy is
tried, so a block is served whole and right, or is a miss. A read from a lower tier asks
for a promotion (:meth:`kvstore.store.placement.Placement.promote`) when it ends. With a
cluster, a block held only there is paged into the host arena first
(:meth:`kvstore.cluster.cluster.Cluster.pull`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from tiers import errors as terr
from tiers.base import ByteRanges, TierKind, check_ranges

from kvstore.store.catalogue import Entry
from kvstore.common.errors import CorruptBlock, InvalidRequest
from kvstore.store.placement import Placement
from kvstore.common.types import KEY_BYTES, GetResult
from kvstore.store.writes import check_key

log = logging.getLogger("kvstore.store.reads")


class Reads:
    """The read path of one :class:`~kvstore.store.manager.TierManager`."""

    def __init__(self, placement: Placement):
        self.catalogue = placement.cat
        self.counters = placement.counters
        self.tiers = placement.tiers
        self.placement = self._placement = placement
        self.cluster = None
        """The cluster level (:class:`kvstore.cluster.cluster.Cluster`), set by the manager when a
        remote tier is configured."""

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(payload bytes, index of the fastest tier holding it)``, or None."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            return None if e is None else (e.size, e.tiers[0])

    def page_in(self, keys: Sequence[bytes], prefix: bool = False) -> set[bytes]:
        """Page blocks held only in the cluster into the host arena (no-op without one);
        returns the keys paged in."""
        cluster = self.cluster
        return cluster.pull(keys, prefix=prefix) if cluster is not None else set()

    def reader(self, key: bytes, *, remote: bool = True) -> "BlockReader | None":
        """Open block ``key`` for reading (pinned until :meth:`BlockReader.close`); None on
        a miss. For reads in several pieces (a large block streamed in chunks).
        ``remote``: page the block in from the cluster first when only it holds it
        (False: the caller did, with :meth:`page_in`)."""
        check_key(key)
        if remote:
            self.page_in([key])
        entry = self.catalogue.pin(key)
        if entry is None:
            self.counters.inc("get_misses")
            return None
        with self.catalogue.lock:
            self._placement.touch(entry)
        return BlockReader(self, entry)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> TierKind | None:
        """Read one block (or ``ranges`` of it, concatenated) into writable buffer ``out``.

        Returns the tier it was read from, or None on a miss (also when every stored
        copy failed its checksum: those copies are dropped and counted in
        ``corrupt_blocks``). Raises InvalidRequest for a bad key length, ranges outside
        the block, or an ``out`` that is too small.
        """
        r = self.reader(key)
        if r is None:
            return None
        try:
            return r.read_into(out, ranges)
        except CorruptBlock:
            self.counters.inc("get_misses")
            return None
        finally:
            r.close()

    def get(self, key: bytes, ranges: ByteRanges | None = None) -> GetResult:
        """:meth:`read_into` a new buffer: ``GetResult.data`` is a memoryview of it (compares
        equal to bytes of the same content)."""
        if len(key) == KEY_BYTES:
            self.page_in([key])
        loc = self.locate(key) if len(key) == KEY_BYTES else None
        if loc is None:
            check_key(key)
            self.counters.inc("get_misses")
            return GetResult(key, False)
        try:
            total = check_ranges(ranges, loc[0])
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        out = np.empty(total, dtype=np.uint8)
        tier = self.read_into(key, out, ranges)
        return GetResult(key, True, tier, memoryview(out)) if tier is not None else GetResult(key, False)

    def get_many(self, keys: Iterable[bytes], ranges: ByteRanges | None = None,
                 stop_at_miss: bool = False) -> Iterator[GetResult]:
        """Yield :meth:`get` for each key; with ``stop_at_miss`` stop after the first miss."""
        keys = list(keys)
        self.page_in([k for k in keys if len(k) == KEY_BYTES], prefix=stop_at_miss)   # one batch
        for key in keys:
            result = self.get(key, ranges)
            yield result
            if stop_at_miss and not result.found:
                return



class BlockReader:
    """A pinned block being read, possibly in several pieces (:meth:`Reads.reader`).

    Each :meth:`read_into` reads from the fastest tier holding a good copy; a copy that
    fails its checksum or its medium is dropped (counted) and the next one is tried, so
    pieces of one block may come from different tiers (the copies are identical). A
    lower-tier read asks for a promotion when the reader closes.
    """

    def __init__(self, reads: Reads, entry: Entry):
        self._m = reads
        self.entry = entry
        self.size = entry.size
        self._promote_from: int | None = None
        self._closed = False
        self._counted = False

    def read_into(self, out: Any, ranges: ByteRanges | None = None) -> TierKind:
        """Copy the block (or ``ranges``) into ``out``; returns the tier read from.

        Raises InvalidRequest (bad ranges, ``out`` too small), CorruptBlock when no good
        copy is left (the block is gone from the store).
        """
        m, entry = self._m, self.entry
        try:
            total = check_ranges(ranges, entry.size)
        except terr.InvalidAccess as e:
            raise InvalidRequest(str(e)) from None
        while entry.tiers:
            i = entry.tiers[0]
            tier = m.tiers[i]
            try:
                tier.read_into(entry.key, out, ranges)
            except terr.InvalidAccess as e:
                raise InvalidRequest(str(e)) from None
            except (terr.BlockCorrupt, terr.MediaIOError, terr.BlockNotStored) as e:
                corrupt = isinstance(e, terr.BlockCorrupt)
                log.warning("dropping %s copy of block %s: %s", tier.name, entry.key.hex()[:16], e)
                m.counters.inc("corrupt_blocks" if corrupt else "read_errors")
                with m.catalogue.lock:
                    if i in entry.tiers:
                        m.placement.drop_copy(entry, i, "corrupt" if corrupt else "failed")
                continue
            m.placement.count_read(tier, total, block=not self._counted)   # one read per block, bytes per piece
            self._counted = True
            if i > 0 and m.placement.promote_on_get:
                self._promote_from = i
            return tier.kind
        raise CorruptBlock(f"block {entry.key.hex()[:16]}: no readable copy is left")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._promote_from is not None and self.entry.tiers:
                self._m.placement.promote(self.entry, 0, wait=False)
        finally:
            self._m.catalogue.unpin(self.entry)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


