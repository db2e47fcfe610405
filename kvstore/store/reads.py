"""Reads: a pinned block read straight into the caller's buffer, whole or by byte ranges.

:meth:`Reads.reader` pins a block for a read in several pieces (a large block streamed
in chunks, :mod:`kvstore.service.get_stream`); :meth:`Reads.read_into` is one read. Each read
goes to the fastest tier holding a good copy. Only proof drops a copy: one that fails
its checksum or has a malformed header is dropped (counted in ``corrupt_blocks``); one
whose medium fails for this call (EMFILE, EIO, ENOSPC, a timeout) is kept, counted in
``read_errors``, and the next copy is tried. A block is served whole and right, or is a
miss. A read from a lower tier asks for a promotion
(:meth:`kvstore.store.moves.Moves.promote`) when it ends. With a cluster, a block held
only there is paged into the host arena first (:meth:`kvstore.cluster.cluster.Cluster.pull`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from tiers.base import ByteRanges, TierKind

from kvstore.cluster.cluster import Cluster
from kvstore.common.errors import BlockNotFound, CopyMissing, CorruptBlock, TierIOError
from kvstore.common.types import KEY_BYTES, GetResult, LookupResult
from kvstore.store.catalogue import Catalogue, Entry
from kvstore.store.counters import Counters
from kvstore.store.media import TierAdapter, check_ranges
from kvstore.store.moves import Moves
from kvstore.store.placement import Placement
from kvstore.store.writes import check_key

log = logging.getLogger("kvstore.store.reads")


class _RateLimitedLog:
    """A WARNING for the first medium failure, then at most one per ``period_s`` seconds
    with the count since (an exhausted open-file limit fails every read)."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0):
        self._log, self._period = logger, period_s
        self._next = 0.0
        self._quiet = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        quiet, self._quiet, self._next = self._quiet, 0, now + self._period
        if quiet:
            msg += f" (and {quiet} more read failures in the last {self._period:.0f} s)"
        self._log.warning(msg, *args)


_IO_LOG = _RateLimitedLog(log)


class Reads:
    """The read path of the store.

    Args:
        tiers: fastest first (:class:`~kvstore.store.media.TierAdapter`).
        catalogue: pins; placement: touches, drops failed copies, counts reads.
        moves: the promotion after a read from a lower tier; counters: ``reads*``, ``get_misses``.
        cluster: the cluster level when a remote tier is configured (page-in), else None.
        promote_on_get: a read from a lower tier asks for a promotion into tier 0.
    """

    def __init__(self, tiers: Sequence[TierAdapter], catalogue: Catalogue, placement: Placement, moves: Moves,
                 counters: Counters, cluster: Cluster | None = None, promote_on_get: bool = True):
        self.catalogue = catalogue
        self.counters = counters
        self.tiers = list(tiers)
        self.placement = placement
        self.moves = moves
        self.cluster = cluster
        self.promote_on_get = promote_on_get
        self._kinds = [int(t.kind) for t in self.tiers]

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(payload bytes, index of the fastest tier holding it)``, or None."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            return None if e is None else (e.size, e.tiers[0])

    def engine_hash(self, key: bytes) -> bytes:
        """The engine's own hash of block ``key`` (``BlockMeta.engine_hash`` of its put; b""
        when the put carried none or the block is not stored)."""
        with self.catalogue.lock:
            e = self.catalogue.get(key)
            meta = None if e is None else e.meta
        return b"" if meta is None else (meta.engine_hash or b"")

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest stored prefix of ``keys`` and the fastest tier of each hit (with a
        cluster, ``REMOTE`` hits after a local miss, within its deadline)."""
        hits = self.catalogue.prefix(keys)
        kinds = self._kinds
        codes = bytes(kinds[i] for i in hits)
        if self.cluster is not None and len(hits) < len(keys):
            codes += self.cluster.lookup_rest(keys[len(hits):])    # the cluster, within a deadline
        self.counters.inc("lookups")
        self.counters.inc("lookup_blocks", len(keys))
        self.counters.inc("lookup_hit_blocks", len(codes))
        return LookupResult(len(codes), codes)

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
            self.placement.touch(entry)
        return BlockReader(self, entry)

    def read_into(self, key: bytes, out: Any, ranges: ByteRanges | None = None) -> TierKind | None:
        """Read one block (or ``ranges`` of it, concatenated) into writable buffer ``out``.

        Returns the tier it was read from, or None on a miss (also when every stored
        copy failed its checksum: those copies are dropped and counted in
        ``corrupt_blocks``; and when every copy's medium failed for this call, e.g. the
        daemon's open-file limit: those copies are kept, counted in ``read_errors``). Raises InvalidRequest for a bad key length, ranges outside
        the block, or an ``out`` that is too small.
        """
        r = self.reader(key)
        if r is None:
            return None
        try:
            return r.read_into(out, ranges)
        except (CorruptBlock, TierIOError):      # no good copy, or none readable now: a miss
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
        total = check_ranges(ranges, loc[0])
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
    fails its checksum is dropped (counted), one whose medium fails is kept (counted), and
    the next one is tried, so pieces of one block may come from different tiers (the
    copies are identical). A lower-tier read asks for a promotion when the reader closes.
    """

    def __init__(self, reads: Reads, entry: Entry):
        self._m = reads
        self.entry = entry
        self.size = entry.size
        self._promote_from: int | None = None
        self._closed = False
        self._counted = False
        self._failed_in: set[int] | None = None    # tiers whose medium failed a read of this block

    def span(self, ranges: ByteRanges | None) -> int:
        """Bytes that ``ranges`` (``(offset, length)`` pairs) select from this block (its
        size when empty). Raises InvalidRequest for a range outside the block."""
        return check_ranges(ranges, self.size)

    def read_into(self, out: Any, ranges: ByteRanges | None = None) -> TierKind:
        """Copy the block (or ``ranges``) into ``out``; returns the tier read from.

        A copy that fails its checksum (CorruptBlock) or that its tier no longer holds is
        dropped; a copy whose medium fails (TierIOError: EMFILE, EIO, ENOSPC, a timeout) is
        kept, counted in ``read_errors``, and the next copy is tried.

        Raises InvalidRequest (bad ranges, ``out`` too small), CorruptBlock when no good
        copy is left (the block is gone from the store), TierIOError when the copies left
        all failed on their media for this call (they stay: a later read may succeed).
        """
        m, entry = self._m, self.entry
        total = check_ranges(ranges, entry.size)
        failed: list[int] | None = None          # tiers whose medium failed for this call
        tiers = entry.tiers
        while tiers:
            if failed is None:
                i = tiers[0]
            else:
                i = next((j for j in tiers if j not in failed), -1)
                if i < 0:
                    break
            tier = m.tiers[i]
            try:
                tier.read_into(entry.key, out, ranges)
            except TierIOError as e:             # EMFILE, EIO, a timeout: not proof; the copy stays
                if self._failed_in is None:
                    self._failed_in = set()
                if i not in self._failed_in:         # once per block and tier, like ``reads``
                    self._failed_in.add(i)
                    m.counters.inc("read_errors")
                _IO_LOG.warning("reading block %s from %s failed (the copy is kept): %s",
                                entry.key.hex()[:16], tier.name, e)
                failed = (failed or []) + [i]
                continue
            except (CorruptBlock, BlockNotFound) as e:
                corrupt = isinstance(e, CorruptBlock) and not isinstance(e, CopyMissing)
                log.warning("dropping %s copy of block %s: %s", tier.name, entry.key.hex()[:16], e)
                m.counters.inc("corrupt_blocks" if corrupt else "copies_missing")
                with m.catalogue.lock:
                    if i in entry.tiers:
                        m.placement.drop_copy(entry, i, "corrupt" if corrupt else "missing")
                continue
            m.placement.count_read(tier, total, block=not self._counted)   # one read per block, bytes per piece
            self._counted = True
            if i > 0 and m.promote_on_get:
                self._promote_from = i
            return tier.kind
        if failed:
            raise TierIOError(f"block {entry.key.hex()[:16]}: every copy failed to read "
                              f"({', '.join(m.tiers[j].name for j in failed)}); the copies are kept")
        raise CorruptBlock(f"block {entry.key.hex()[:16]}: no readable copy is left")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._promote_from is not None and self.entry.tiers:
                self._m.moves.promote(self.entry, 0, wait=False)
        finally:
            self._m.catalogue.unpin(self.entry)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


