"""Same-node reads with no round trip: blocks found in the daemon's shared block table.

A mapping made with hello version 4 may hold the daemon's block table
(:attr:`kvstore.client.arena_mapping.ArenaMapping.table`, :mod:`tiers.block_table`). A
``get_into`` then first finds the longest prefix of its keys there, copies those blocks
straight out of the arena, and keeps what the table still vouches for afterwards (the
entries' seqlocks unchanged, the table open, the session up); the rest, from the first
block not kept, takes a lease as before (:meth:`kvstore.client.arena.ArenaPath.lease_copy`).
A ``lookup`` whose every block is in the table is answered from it when the table says so
(the host arena is the node's fastest tier). Either way the daemon is told in a frame it
does not answer (TOUCH, or a LOOKUP it only records), for its eviction policies and its
statistics: queued on the control channel and written at once when the socket has room for
them (a poll that does not wait, one write), else sent by the client's release thread
(:class:`kvstore.client.lease_releaser.LeaseReleaser`); a read never waits for a note, and a
queue the daemon is too slow to take drops notes (advice), never a read.

What is served is what a lease would have served: a block is read only while its entry is
live, its space is not reused while this client's read is announced in its reader page (or
for :data:`tiers.block_table.STUCK_READER_S` at least), and a copy that may have raced a
reuse fails the seqlock check and is read again by lease.
"""

from __future__ import annotations

from kvstore.common.arena_wire import MAX_FRAME_KEYS
from kvstore.common.types import LookupResult, TierKind

HOST = int(TierKind.HOST)


class _Found:
    """The blocks found in the table, shaped as a lease answer for the arena path's copy."""

    __slots__ = ("offsets", "sizes", "tier_codes")

    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = offsets, sizes
        self.tier_codes = bytes([HOST]) * len(sizes)


def table_copy(arena, copy_out, wake, keys, bufs, ranges, stop_at_miss, sizes, codes) -> int:
    """Copy the longest prefix of ``keys`` found in ``arena``'s block table into ``bufs``
    (``copy_out``: :meth:`kvstore.client.arena.ArenaPath._copy_out`), setting ``sizes`` and
    ``codes`` of the blocks kept, and queue the note of what was read (``wake()``: have it
    sent). Returns the index of the first key left to the lease path (0: nothing read here;
    ``len(keys)``: done, including a ``stop_at_miss`` read that met a block too short for
    ``ranges``)."""
    table = arena.table
    if table is None or not keys or not _ours(arena) or not table.open():
        return 0
    slot = table.enter()
    if slot is None:
        return 0
    try:
        run, slots, seqs, offsets, block_sizes = table.find(keys)
        if not run:
            return 0
        copy_out(arena.array, _Found(offsets.tolist(), block_sizes.tolist()), 0, bufs, ranges, sizes, codes)
        kept = table.valid(slots, seqs)
    finally:
        table.leave(slot)
    if kept and not arena.alive():          # the daemon is gone: its old table proves nothing
        kept = 0
    for i in range(kept, run):
        sizes[i], codes[i] = 0, 0
    if not kept:
        return 0
    _note(arena, wake, keys[:kept], lookup=False)
    if stop_at_miss and 0 in codes[:kept]:  # a block too short for the ranges: a miss, the read ends
        return len(keys)
    return kept


def table_lookup(arena, wake, keys) -> LookupResult | None:
    """``lookup`` of ``keys`` answered from ``arena``'s block table when every block is
    there and the table allows it (:attr:`tiers.block_table.TableView.answers_lookups`);
    None otherwise (the caller asks the daemon)."""
    table = arena.table if arena is not None else None
    if table is None or not keys or not _ours(arena) or not table.open() or not table.answers_lookups:
        return None
    slot = table.enter()
    if slot is None:
        return None
    try:
        run = table.find(keys)[0]
    finally:
        table.leave(slot)
    if run < len(keys) or not arena.alive():
        return None
    _note(arena, wake, keys, lookup=True)
    return LookupResult(run, bytes([HOST]) * run)


def _ours(arena) -> bool:
    """Whether this process may read the table: the one that mapped it (a forked child shares
    the parent's reader page and session; it reads by lease, over its own mapping, instead)."""
    ch = arena.control
    return ch is not None and ch.usable()


def _note(arena, wake, keys, *, lookup: bool) -> None:
    """Queue the note of what was read or looked up in the table and send it now when that
    cannot wait, else have the client's release thread send it (``wake``); dropped when too
    many wait: the read stands either way."""
    ch = arena.control
    for start in range(0, len(keys), MAX_FRAME_KEYS):
        ch.note(keys[start:start + MAX_FRAME_KEYS], lookup=lookup)
    if not ch.try_send_notes():             # the channel busy, or the daemon slow: in the background
        wake()
