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
statistics: queued on the control channel in batches (:data:`kvstore.client.arena_control.NOTE_BATCH_S`),
sent by the client's release thread (:class:`kvstore.client.lease_releaser.LeaseReleaser`), asked
once per batch, or written by a read that finds the batch old enough when the socket has room
(a poll that does not wait, one write); a read never waits for a note, and a queue the daemon
is too slow to take drops notes (advice), never a read. An engine step's load reads the table
too (:class:`kvstore.client.leased_read.LeasedRead`, which reads what the table stops vouching
for by gRPC). Rows found are kept for the next find of a prefix of the same keys (:func:`find`).

What is served is what a lease would have served: a block is read only while its entry is
live, its space is not reused while this client's read is announced in its reader page (or
for :data:`tiers.block_table.STUCK_READER_S` at least), and a copy that may have raced a
reuse fails the seqlock check and is read again by lease.
"""

from __future__ import annotations

from kvstore.common.arena_wire import MAX_FRAME_KEYS
from kvstore.common.types import KEY_BYTES, LookupResult, TierKind

HOST = int(TierKind.HOST)


class _Found:
    """The blocks found in the table, shaped as a lease answer for the arena path's copy."""

    __slots__ = ("offsets", "sizes", "tier_codes")

    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = offsets, sizes
        self.tier_codes = bytes([HOST]) * len(sizes)


class TableRead:
    """The longest prefix of ``keys`` found in ``arena``'s block table, announced in this
    session's reader page until :meth:`end` (the blocks' space is not reused meanwhile, for
    :data:`tiers.block_table.STUCK_READER_S` at least). Made by :meth:`begin`.

    Attributes: ``arena`` (the mapping read), ``run`` (blocks found, from the first),
    ``offsets`` and ``sizes`` (lists of ``run`` ints: each block's bytes in ``arena.array``).
    """

    __slots__ = ("arena", "run", "offsets", "sizes", "_table", "_slot", "_slots", "_seqs")

    def __init__(self, arena, table, slot, run, slots, seqs, offsets, sizes):
        self.arena, self._table, self._slot, self.run = arena, table, slot, run
        self._slots, self._seqs = slots, seqs
        self.offsets, self.sizes = offsets.tolist(), sizes.tolist()

    @classmethod
    def begin(cls, arena, keys) -> "TableRead | None":
        """Announce a read and find ``keys``; None when nothing can be read from the table
        (no table, not this process's, closed, every reader slot taken, the first key absent)."""
        table = getattr(arena, "table", None)
        if table is None or not keys or not _ours(arena) or not table.open():
            return None
        slot = table.enter()
        if slot is None:
            return None
        try:
            run, slots, seqs, offsets, sizes = find(arena, table, keys)
        except BaseException:
            table.leave(slot)
            raise
        if not run:
            table.leave(slot)
            return None
        return cls(arena, table, slot, run, slots, seqs, offsets, sizes)

    def kept(self) -> int:
        """How many of the blocks found (from the first) the table still vouches for now, the
        bytes copied out of them so far being theirs (seqlocks unchanged, the table open,
        the session up: one ``poll``)."""
        kept = self._table.valid(self._slots[:self.run], self._seqs[:self.run])
        return kept if kept and self.arena.alive() else 0

    def end(self) -> None:
        """Leave the reader page (idempotent)."""
        if self._slot is not None:
            self._table.leave(self._slot)
            self._slot = None


def table_copy(arena, copy_out, wake, keys, bufs, ranges, stop_at_miss, sizes, codes) -> int:
    """Copy the longest prefix of ``keys`` found in ``arena``'s block table into ``bufs``
    (``copy_out``: :meth:`kvstore.client.arena.ArenaPath._copy_out`), setting ``sizes`` and
    ``codes`` of the blocks kept, and queue the note of what was read (``wake()``: have it
    sent). Returns the index of the first key left to the lease path (0: nothing read here;
    ``len(keys)``: done, including a ``stop_at_miss`` read that met a block too short for
    ``ranges``)."""
    found = TableRead.begin(arena, keys)
    if found is None:
        return 0
    try:
        copy_out(arena.array, _Found(found.offsets, found.sizes), 0, bufs, ranges, sizes, codes)
        kept = found.kept()
    finally:
        found.end()
    for i in range(kept, found.run):
        sizes[i], codes[i] = 0, 0
    if not kept:
        return 0
    note_reads(arena, wake, keys[:kept])
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
        run = find(arena, table, keys)[0]
    finally:
        table.leave(slot)
    if run < len(keys) or not arena.alive():
        return None
    _note(arena, wake, keys, lookup=True)
    return LookupResult(run, bytes([HOST]) * run)


def find(arena, table, keys):
    """``table.find(keys)`` (read while announced), reusing the rows of the last find over
    ``arena`` when ``keys`` are a prefix of what it found and those rows are unchanged: their
    seqlocks read now, while announced, as they were then, prove the rows live now as a fresh
    find would (an engine's ``lookup`` then ``get_into`` of the same prefix finds it once)."""
    last, n = arena.last_find, len(keys)
    joined = b"".join(keys)                    # a copy: a caller's bytearray key may change later
    if last is not None and last[0] is table and n <= last[2] and joined == last[1][:len(joined)]:
        slots, seqs = last[3][:n], last[4][:n]
        if table.valid(slots, seqs) == n:
            return n, slots, seqs, last[5][:n], last[6][:n]
    found = table.find(keys)
    arena.last_find = (table, joined[:KEY_BYTES * found[0]], *found) if found[0] else None
    return found


def _ours(arena) -> bool:
    """Whether this process may read the table: the one that mapped it (a forked child shares
    the parent's reader page and session; it reads by lease, over its own mapping, instead)."""
    ch = arena.control
    return ch is not None and ch.usable()


def note_reads(arena, wake, keys) -> None:
    """Tell the daemon ``keys`` were read from the table (for its policies; see :func:`_note`)."""
    _note(arena, wake, keys, lookup=False)


def _note(arena, wake, keys, *, lookup: bool) -> None:
    """Queue the note of what was read or looked up in the table and send it now when that
    cannot wait, else have the client's release thread send it (``wake``); dropped when too
    many wait: the read stands either way."""
    ch = arena.control
    for start in range(0, len(keys), MAX_FRAME_KEYS):
        ch.note(keys[start:start + MAX_FRAME_KEYS], lookup=lookup)
    if not ch.try_send_notes():             # the channel busy, or the daemon slow: in the background
        wake()
