"""A read of several byte ranges of the same blocks with each block read or leased once: an
engine step's load, layer by layer, for one store round trip at most (none from the block table).

An engine that pages a prefix back layer by layer wants the same blocks once per layer,
a different pair of byte ranges each time (``docs/block_layout.md``). A ``get_into`` per
layer is a Lease round trip per layer and, when the load is larger than one lease may
hold, pages blocks into the arena again for every layer. :class:`LeasedRead` instead
leases every block once (one Lease: each block pinned in the shared arena, those only on
NVMe promoted into it), copies each *stage* (e.g. one layer's K and V of a TP rank's KV
heads) of every block out of the arena, stage after stage, telling the caller as each
stage is in place (the engine computes layer 0 while later layers are copied), and hands
the lease to the client's background release.

A load larger than one lease may hold (the daemon ends a grant past its ``max_bytes``, a
quarter of the arena by default, or when a promotion finds no room, and says where to
resume: ``LeaseReply.resume_at``) is read in parts: lease a part, copy every stage of its
blocks, release it, lease the next. Each block is leased, so promoted from NVMe, once per
read whatever the number of stages; the round trips are the parts' Leases (and a Release
between two parts, so the next part finds the room the previous one held).

Blocks the arena cannot serve go by gRPC in one ``get`` of every stage they still need,
never one per stage: no arena to map (TCP, a multi-tenant daemon, ``shared_memory=False``),
an arena that grants nothing now (``resume_at`` 0), a lease too old when its copy finished,
a daemon that served a new arena twice during the read.

Every byte served is checked as :meth:`kvstore.client.KVStoreClient.get_into` checks it: a
block not found, or too short for a stage's ranges, is a miss (size 0); a stage copied out
of a lease later than :data:`kvstore.client.arena.SAFE_FRACTION` of its TTL after the Lease
was sent is thrown away (its space may hold other blocks by then) and read by gRPC; a gRPC
reply of another length than asked for is a miss.

Blocks in the daemon's block table (:mod:`kvstore.client.table_read`) take no lease: the
longest prefix of the keys found there is copied straight out of the arena while the read
is announced in the session's reader page; after each stage the table must still vouch for
every block copied (seqlocks unchanged, the table open, the session up), and a block it no
longer vouches for is read by gRPC from that stage on. A step whose blocks are all in the
host arena makes no round trip at all, its stages published as they are copied. Otherwise
every stage of the table's blocks is copied and the table left before the rest is leased
(the lease's promotions may need the space an announced read holds back); the stages are
then published as the last part's are copied.

Built on the client's public ``lease``, ``release``, ``arena`` and ``get``
(:class:`kvstore.client.KVStoreClient`), which :meth:`KVStoreClient.leased_read` hands in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.client.arena import SAFE_FRACTION, ArenaChanged
from kvstore.client.buffers import BlockBuffers
from kvstore.client.checks import check_keys
from kvstore.client.table_read import TableRead, note_reads
from kvstore.common.errors import InvalidRequest
from kvstore.common.host_copy import copy, gather_ranges
from kvstore.common.transport import MAX_KEYS_PER_REQUEST, keys_per_request

log = logging.getLogger("kvstore.client")

_clock = time.monotonic

Publish = Callable[[int, list], None]
"""``publish(stage, sizes)``: stage ``stage`` is in place; ``sizes[i]`` is the bytes copied
for block ``i`` (the stage's bytes, or 0: a miss)."""


@dataclass(frozen=True)
class ReadStage:
    """What one stage copies of every block.

    Attributes:
        ranges: ``(offset, length)`` byte ranges of a block (non-empty; e.g.
            :meth:`engine_adapter.layout.BlockLayout.layer_ranges`), concatenated into
            the block's slot of ``out``.
        out: where the blocks go: one host buffer per key, or one buffer of ``len(keys)``
            equal slots (e.g. shaped ``(len(keys), stage_bytes)``), or one buffer with block
            ``i`` at byte ``offsets[i]`` (numpy arrays, CPU torch tensors, any writable buffer).
        offsets: with one buffer, each block's byte offset in it (a block's slot ends at the
            next larger offset; two equal offsets are refused); None: equal slots.
    """

    ranges: Sequence[tuple[int, int]]
    out: Any
    offsets: Sequence[int] | None = None


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` checked, with touching neighbours merged (the same bytes, concatenated)."""
    out: list[tuple[int, int]] = []
    for off, n in ranges:
        off, n = int(off), int(n)
        if off < 0 or n <= 0:
            raise InvalidRequest(f"byte range ({off}, {n}) must have an offset >= 0 and a length > 0")
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


class LeasedRead:
    """Stages of the blocks ``keys``, each block read from the block table or leased, once
    (see the module docstring).

    Args:
        client: a :class:`kvstore.client.KVStoreClient` (its ``arena``, ``lease``,
            ``release``, ``get``, ``lease_ttl_s`` and ``max_message_bytes``).
        keys: 32-byte block keys.
        stages: :class:`ReadStage` s, in the order they are copied and published.
        timeout: deadline of each store call (seconds; None: the client's).
        release_later: ends a lease without waiting (the client's background release);
            None: a Release call at once.
        notes_waiting: have queued block-table notes sent (the client's background
            release); None: the block table is not read, every block is leased.
    Raises InvalidRequest (a key that is not 32 bytes, no stages, a stage without ranges,
    a buffer too small for a stage's bytes; a stage's buffers that are not C-contiguous or
    overlap, two equal offsets: :class:`~kvstore.client.buffers.BlockBuffers`).

    Attributes (after :meth:`run`): ``sizes[s][i]``, the bytes of stage ``s`` copied for block
    ``i`` (0: a miss); ``leases``, ``releases``, ``gets``: the Lease, Release (between parts)
    and gRPC get calls made; ``parts``: leases granted; ``grpc_blocks``: blocks read by gRPC;
    ``table_blocks``: blocks read from the block table (every stage); ``bytes_copied``.
    """

    def __init__(self, client, keys: Sequence[bytes], stages: Sequence[ReadStage], *,
                 timeout: float | None = None, release_later: Callable[[str], None] | None = None,
                 notes_waiting: Callable[[], None] | None = None):
        self.client = client
        self.keys = check_keys(keys)
        if not stages:
            raise InvalidRequest("a leased read needs at least one stage")
        n = len(self.keys)
        self.timeout = timeout
        self._release_later = release_later or (lambda lease_id: client.release([lease_id], timeout))
        self._notes_waiting = notes_waiting
        self._table: TableRead | None = None
        self._table_stage = 0                       # stages copied out of the table so far
        self._ranges = [_merged(s.ranges) for s in stages]
        if not all(self._ranges):
            raise InvalidRequest("every stage needs at least one byte range")
        self._want = [sum(m for _, m in r) for r in self._ranges]
        self._end = [max(o + m for o, m in r) for r in self._ranges]        # a block shorter is a miss
        self._bufs = [BlockBuffers(stage.out, n, writable=True, offsets=stage.offsets) for stage in stages]
        self._slot_views: list[list[np.ndarray] | None] = [None] * len(stages)
        for bufs, want in zip(self._bufs, self._want):     # every slot checked now; views made when copied
            bufs.check_fit(want)
        self.sizes = [[0] * n for _ in stages]
        self.leases = self.releases = self.gets = self.parts = self.grpc_blocks = self.bytes_copied = 0
        self.table_blocks = 0
        self._published = 0
        self._warned = False
        self._lock: Any = contextlib.nullcontext()  # run's write_lock and cancelled
        self._cancelled: Callable[[], bool] = lambda: False

    def _slots(self, s: int) -> list[np.ndarray]:
        """Each block's slot of stage ``s`` (made on first use)."""
        views = self._slot_views[s]
        if views is None:
            bufs, want = self._bufs[s], self._want[s]
            views = self._slot_views[s] = [bufs.slot(i, want) for i in range(len(self.keys))]
        return views

    @property
    def calls(self) -> int:
        """Store round trips made for the data: Lease, Release between parts, gRPC get."""
        return self.leases + self.releases + self.gets

    def run(self, publish: Publish | None = None, cancelled: Callable[[], bool] | None = None,
            write_lock: Any = None) -> list[list[int]]:
        """Read every stage of every block; returns :attr:`sizes`.

        ``publish(stage, sizes)`` is called once per stage, in stage order, when that stage's
        bytes of every block are in place (from this thread). ``cancelled()`` is asked
        before each Lease and each stage: when true, the read stops there (the stages not
        published yet are never published) and its lease is released.
        ``write_lock`` (a ``threading.Lock``; None: none): every write into the stages'
        buffers is made holding it, after ``cancelled()`` was asked under it. A caller that
        makes ``cancelled()`` true and then takes the lock (and lets go) knows that nothing
        more is written into the buffers: a copy under way has ended, no other starts (an
        engine's own KV cache may then be handed back to it, even while a store call of
        this read is still out). ``publish`` is called without the lock held.
        Raises StoreUnavailable, InvalidRequest, FeatureDisabled (``shared_memory=True``
        without an arena), as the client's calls do; the stages published before stay valid.
        """
        publish = publish or (lambda stage, sizes: None)
        cancelled = cancelled or (lambda: False)
        self._lock = write_lock if write_lock is not None else contextlib.nullcontext()
        self._cancelled = cancelled
        n = len(self.keys)
        arena = self.client.arena() if n else None
        if arena is not None and self._notes_waiting is not None:
            self._table = TableRead.begin(arena, self.keys)
        table = self._table
        try:
            sizes = self._run(arena, publish, cancelled)
        finally:
            if table is not None:
                table.end()
                self.table_blocks = table.run
        if table is not None and table.run:          # the daemon's policies see the hits
            note_reads(table.arena, self._notes_waiting, self.keys[:table.run])
        return sizes

    def _run(self, arena, publish: Publish, cancelled) -> list[list[int]]:
        n, client = len(self.keys), self.client
        need: dict[int, int] = {}                   # block -> first stage it needs by gRPC
        per = keys_per_request(client.max_message_bytes, extra=128, max_keys=MAX_KEYS_PER_REQUEST)
        start, remapped = (self._table.run if self._table is not None else 0), False
        if self._table is not None:                  # (the table is left before any store call)
            for s in range(len(self._ranges)):
                if not self._table_upto(s + 1, need):
                    return self.sizes
                if start == n and not need and not self._publish_upto(s + 1, publish):
                    return self.sizes                 # every block in the table: published as copied
            # left before a Lease: its promotions may need space that this read's announcement
            # holds back; and before a gRPC get of what the table stopped vouching for
            self._table.end()
        while arena is not None and start < n:
            if cancelled():
                return self.sizes
            part = self.keys[start:start + per]
            sent = _clock()
            try:
                reply = client.lease(part, prefix=False, timeout=self.timeout)
            except ArenaChanged:                    # the daemon restarted: its new arena once, else gRPC
                self.leases += 1
                arena = None if remapped else client.arena()
                remapped = True
                continue
            self.leases += 1
            got = len(part) if reply.complete else min(reply.resume_at, len(reply.tier_codes))
            stop = start + got
            last = stop >= n
            try:
                if reply.lease_id:
                    self.parts += 1
                ttl = min(reply.ttl_seconds or client.lease_ttl_s, client.lease_ttl_s, arena.max_ttl_s)
                if not self._copy_part(arena.array, reply, start, stop, sent, ttl * SAFE_FRACTION, need,
                                       publish if last else None, cancelled):
                    return self.sizes
            finally:
                if reply.lease_id:
                    if last or got == 0:
                        self._release_later(reply.lease_id)
                    else:                            # the next part needs the room this one held
                        self.releases += 1
                        client.release([reply.lease_id], self.timeout)
            if got == 0:                             # the arena grants nothing now: gRPC for the rest
                break
            start = stop
        if cancelled():
            return self.sizes
        for i in range(start, n):
            need[i] = 0
        if need and not self._by_grpc(need):
            return self.sizes
        self._publish_upto(len(self._ranges), publish)
        return self.sizes

    def _copy_part(self, src: np.ndarray, reply, start: int, stop: int, sent: float, safe_s: float,
                   need: dict[int, int], publish: Publish | None, cancelled) -> bool:
        """Copy every stage of blocks ``[start, stop)`` out of the lease ``reply``; publish
        each stage after its copy when this is the last part and nothing waits for gRPC.
        Returns False when cancelled."""
        offsets, sizes, codes = reply.offsets, reply.sizes, reply.tier_codes
        for s in range(len(self._ranges)):
            want, end, got = self._want[s], self._end[s], self.sizes[s]
            with self._lock:
                if cancelled():
                    return False
                self._copy_blocks(s, src, [(i, offsets[i - start]) for i in range(start, stop)
                                           if codes[i - start] and sizes[i - start] >= end])
            if _clock() - sent > safe_s:             # the copies may have outlived the lease
                if not self._warned:
                    log.warning("a lease of the shared arena was too old when its copy finished (the client "
                                "stalled); reading those blocks again by gRPC")
                    self._warned = True
                for i in range(start, stop):
                    if codes[i - start]:
                        self._by_grpc_from(i, s, need)
                return True
            self.bytes_copied += want * sum(1 for i in range(start, stop) if got[i])
            if publish is not None and not need and not self._publish_upto(s + 1, publish):
                return False
        return True

    def _table_upto(self, upto: int, need: dict[int, int]) -> bool:
        """Copy the stages before ``upto`` not copied yet of the blocks found in the block
        table; a block the table no longer vouches for after a stage's copy (and every block
        after it) leaves the table read and goes in ``need`` from that stage. Returns False
        when cancelled."""
        table = self._table
        while table is not None and self._table_stage < upto:
            s = self._table_stage
            self._table_stage += 1
            if not table.run:
                if self._cancelled():
                    return False
                continue
            want, end, got = self._want[s], self._end[s], self.sizes[s]
            with self._lock:
                if self._cancelled():
                    return False
                self._copy_blocks(s, table.arena.array, [(i, base) for i, base, size in
                                                         zip(range(table.run), table.offsets, table.sizes)
                                                         if size >= end])    # shorter: a miss
            kept = table.kept()
            for i in range(kept, table.run):          # their bytes of this stage may not be theirs
                self._by_grpc_from(i, s, need)
            self.bytes_copied += want * sum(1 for i in range(kept) if got[i])
            table.run = kept
        return True

    def _copy_blocks(self, s: int, src: np.ndarray, blocks: list[tuple[int, int]]) -> None:
        """Copy stage ``s`` of ``blocks`` (``(i, byte offset of block i in src)``) into their
        slots and set their sizes: blocks laid out alike in the arena and the stage's buffer
        by one copy per range for the lot (:func:`kvstore.common.host_copy.gather_ranges`),
        else range by range."""
        ranges, want, got = self._ranges[s], self._want[s], self.sizes[s]
        slot_at = self._bufs[s].slot_offsets() if len(blocks) > 1 else None
        if slot_at is not None:
            gather_ranges(self._bufs[s].array, [slot_at[i] for i, _ in blocks], src, [b for _, b in blocks], ranges)
        else:
            slots = self._slots(s)
            for i, base in blocks:
                _copy_ranges(slots[i], src, base, ranges)
        for i, _ in blocks:
            got[i] = want

    def _by_grpc_from(self, i: int, s: int, need: dict[int, int]) -> None:
        """Block ``i`` goes by gRPC from stage ``s`` on (what was copied of it since may not be its)."""
        need[i] = s
        for later in range(s, len(self._ranges)):
            self.sizes[later][i] = 0

    def _by_grpc(self, need: dict[int, int]) -> bool:
        """One gRPC get per first stage needed (usually one) of every stage the blocks in
        ``need`` still lack, split into the stages' slots. Returns False when cancelled."""
        by_first: dict[int, list[int]] = {}
        for i, s in sorted(need.items()):
            by_first.setdefault(s, []).append(i)
        for first, blocks in sorted(by_first.items()):
            ranges = _merged([r for rs in self._ranges[first:] for r in rs])
            total = sum(self._want[first:])
            self.gets += 1
            results = self.client.get([self.keys[i] for i in blocks], ranges=ranges, stop_at_miss=False,
                                      timeout=self.timeout)
            self.grpc_blocks += len(blocks)
            with self._lock:
                if self._cancelled():
                    return False
                for i, res in zip(blocks, results):
                    if not res.found or len(res.data) != total:
                        continue                      # a miss, or not the bytes asked for
                    data, pos = np.frombuffer(res.data, dtype=np.uint8), 0
                    for s in range(first, len(self._ranges)):
                        copy(self._slots(s)[i], data[pos:pos + self._want[s]])
                        self.sizes[s][i] = self._want[s]
                        pos += self._want[s]
                    self.bytes_copied += total
        return True

    def _publish_upto(self, upto: int, publish: Publish) -> bool:
        """Publish the stages before ``upto`` not published yet. False when cancelled."""
        while self._published < upto:
            s = self._published
            self._published += 1
            with self._lock:
                if self._cancelled():
                    return False
                self._bufs[s].finish()              # device buffers: their host staging copied back
            publish(s, self.sizes[s])
        return True


def _copy_ranges(dst: np.ndarray, src: np.ndarray, base: int, ranges: list[tuple[int, int]]) -> None:
    """The ``ranges`` of the block at byte ``base`` of ``src``, concatenated into ``dst``."""
    pos = 0
    for off, m in ranges:
        copy(dst[pos:pos + m], src[base + off:base + off + m])
        pos += m
