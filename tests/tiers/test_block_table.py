"""tiers.block_table: publish / retire / find and the seqlock check, probe-window overflow,
reader epochs and deferred reuse (also through the host tier), close, torn entries, the
read-only mapping, the header checks and the sizing rules."""

from __future__ import annotations

import mmap
import os
import time
import types

import numpy as np
import pytest

from tiers import block_table as bt
from tiers.block_table import (E_OFFSET, E_SEQ, E_SIZE, H_MAGIC, H_VERSION, MAX_SLOTS, MIN_SLOTS, PROBE,
                               READER_SLOTS, SLOT_PER_BYTES, BlockTable, TableView, default_slots,
                               home_slots, key_words, readonly_fd, supported)
from tiers.errors import NoRoom
from tiers.host import HostTier

pytestmark = pytest.mark.skipif(not supported(), reason="the block table is offered on x86-64 only")

ARENA = 1 << 20
BLOCK = 64 << 10
RNG_SEED = 20240611


def rand_keys(rng, n):
    return [rng.bytes(32) for _ in range(n)]


def word_key(w: int) -> bytes:
    """A degenerate key: one 8-byte word repeated four times."""
    return w.to_bytes(8, "little") * 4


def one_byte_off(key: bytes, i: int) -> bytes:
    b = bytearray(key)
    b[i] ^= 0x01
    return bytes(b)


def keys_with_home(bits: int, home: int, n: int, seed: int = RNG_SEED) -> list[bytes]:
    """``n`` distinct random keys whose home slot in a table of ``2**bits`` is ``home``."""
    rng = np.random.default_rng(seed)
    raw = rng.bytes(32 * 8192)
    cands = [raw[i:i + 32] for i in range(0, len(raw), 32)]
    homes = home_slots(key_words(cands), bits)
    picked = [k for k, h in zip(cands, homes) if h == home][:n]
    assert len(picked) == n and len(set(picked)) == n
    return picked


class Session:
    """A table, a client's read-only view of it and its reader page (fds closed at the end)."""

    def __init__(self, table: BlockTable, arena_bytes: int = ARENA, name: str = "s1"):
        self.table, self.name = table, name
        self.ro = readonly_fd(table.fd)
        self.rfd = table.open_reader(name)
        self.view = TableView(self.ro, self.rfd, arena_bytes)

    def close(self):
        self.view.close()
        for fd in (self.ro, self.rfd):
            os.close(fd)


@pytest.fixture
def table():
    t = BlockTable(ARENA, slots=64)
    yield t
    if t._header[bt.H_STATE] != bt.CLOSED:               # closed once only (see the close-twice test)
        t.close()


@pytest.fixture
def session(table):
    s = Session(table)
    yield s
    s.close()


# ---------------------------------------------------------------- publish / find


def test_find_returns_the_longest_published_prefix(table, session):
    rng = np.random.default_rng(RNG_SEED)
    keys = rand_keys(rng, 3) + [word_key(0), word_key(0x0101010101010101)]
    placed = [(4096 * (i + 1), 1000 + i) for i in range(len(keys))]
    for k, (off, size) in zip(keys, placed):
        assert table.publish(k, off, size)
    assert table.published == 5 and table.unpublished == 0
    v = session.view

    n, slots, seqs, offsets, sizes = v.find(keys)
    assert n == 5
    assert slots.tolist() == [table._slot_of[k] for k in keys]
    assert seqs.tolist() == [2] * 5                      # fresh slots: written once, even
    assert offsets.tolist() == [p[0] for p in placed]
    assert sizes.tolist() == [p[1] for p in placed]
    assert all(a.dtype == np.int64 for a in (slots, seqs, offsets, sizes))

    missing = rng.bytes(32)
    n, slots, _, offsets, sizes = v.find(keys[:2] + [missing] + keys[2:])
    assert n == 2 and offsets.tolist() == [4096, 8192] and sizes.tolist() == [1000, 1001]
    assert len(slots) == 2
    assert v.find([missing] + keys)[0] == 0
    assert v.find(keys[3:])[3].tolist() == [4 * 4096, 5 * 4096]     # a prefix need not start at 0

    n, slots, seqs, offsets, sizes = v.find([])
    assert n == 0 and all(len(a) == 0 for a in (slots, seqs, offsets, sizes))


def test_keys_differing_in_one_byte_are_told_apart(table, session):
    base = np.random.default_rng(RNG_SEED + 1).bytes(32)
    assert table.publish(base, 0, 64)
    v = session.view
    for i in range(32):                                  # none of the neighbours is found
        assert v.find([one_byte_off(base, i)])[0] == 0
    assert v.find([base])[3].tolist() == [0]


def test_degenerate_keys_spread_and_are_all_found():
    t = BlockTable(ARENA, slots=1024)
    s = Session(t)
    try:
        words = [word_key(w) for w in range(256)] + [word_key(w << 56) for w in range(1, 64)]
        homes = home_slots(key_words(words), t.bits)
        assert len(set(homes.tolist())) > 150            # repeated-word keys do not pile up on one slot
        near = [one_byte_off(word_key(0x1234), i) for i in range(32)]
        keys = words + near
        for i, k in enumerate(keys):
            assert t.publish(k, 64 * i, 64)
        assert t.unpublished == 0 and t.published == len(keys)
        n, _, _, offsets, _ = s.view.find(keys)
        assert n == len(keys) and offsets.tolist() == [64 * i for i in range(len(keys))]
    finally:
        s.close()
        t.close()


def test_publish_twice_keeps_the_first_entry(table, session):
    k = word_key(7)
    assert table.publish(k, 128, 64)
    assert table.publish(k, 4096, 99)                    # already published: unchanged
    assert table.published == 1
    _, _, seqs, offsets, sizes = session.view.find([k])
    assert offsets.tolist() == [128] and sizes.tolist() == [64] and seqs.tolist() == [2]


# ---------------------------------------------------------------- retire / valid


def test_retire_hides_the_key_and_invalidates_the_run_from_it(table, session):
    rng = np.random.default_rng(RNG_SEED + 2)
    keys = rand_keys(rng, 2) + [word_key(3)] + rand_keys(rng, 1)
    for i, k in enumerate(keys):
        table.publish(k, BLOCK * i, BLOCK)
    v = session.view
    n, slots, seqs, _, _ = v.find(keys)
    assert n == 4 and v.valid(slots, seqs) == 4

    epoch = table.epoch
    assert table.retire(keys[2]) == epoch                # tagged with the epoch before the retire
    assert table.epoch == epoch + 1 and table.published == 3
    assert v.valid(slots, seqs) == 2                     # the first retired block; those before stay
    assert v.valid(slots[:2], seqs[:2]) == 2
    assert v.find(keys)[0] == 2
    assert v.find([keys[2]])[0] == 0
    assert v.find([keys[3]])[0] == 1
    assert table._entries[slots[2], E_SEQ] == 4          # moved on by two: even again

    assert table.retire(keys[2]) is None                 # not published (any more): nothing to wait for
    assert table.retire(rng.bytes(32)) is None
    assert table.epoch == epoch + 1


def test_republish_into_a_tombstone_invalidates_old_seqs(table, session):
    a, b = keys_with_home(table.bits, 5, 2)
    assert table.publish(a, 0, 64)
    v = session.view
    n, slots, seqs, _, _ = v.find([a])
    assert n == 1 and slots.tolist() == [5]
    table.retire(a)
    assert table.publish(b, 4096, 128)
    assert table._slot_of[b] == 5                        # the tombstone is reused
    assert v.valid(slots, seqs) == 0
    assert v.find([a])[0] == 0
    n, slots_b, seqs_b, offsets, sizes = v.find([b])
    assert (n, slots_b.tolist(), seqs_b.tolist(), offsets.tolist(), sizes.tolist()) == (1, [5], [6], [4096], [128])

    # the same key published again into its own tombstone: the seq still moves on
    table.retire(b)
    assert table.publish(b, 8192, 128)
    assert v.valid(slots_b, seqs_b) == 0
    assert v.find([b])[3].tolist() == [8192]


def test_an_entry_being_written_is_not_found(table, session):
    keys = [word_key(1), word_key(2), word_key(3)]
    for i, k in enumerate(keys):
        table.publish(k, 64 * i, 64)
    table._entries[table._slot_of[keys[1]], E_SEQ] += 1  # odd: the daemon is mid-write
    assert session.view.find(keys)[0] == 1


# ---------------------------------------------------------------- probe window


@pytest.mark.parametrize("home", [9, 60])                # 60: the window wraps past the last slot
def test_probe_overflow_then_tombstone_reuse(table, session, home):
    keys = keys_with_home(table.bits, home, PROBE + 2)
    first, extra = keys[:PROBE], keys[PROBE:]
    for i, k in enumerate(first):
        assert table.publish(k, BLOCK * i, 100 + i)
        assert table._slot_of[k] == (home + i) % 64
    assert not table.publish(extra[0], 0, 64)
    assert table.unpublished == 1 and table.published == PROBE
    assert not table.publish(extra[1], 0, 64)
    assert table.unpublished == 2

    v = session.view
    n, _, _, offsets, sizes = v.find(first)
    assert n == PROBE
    assert offsets.tolist() == [BLOCK * i for i in range(PROBE)]
    assert sizes.tolist() == [100 + i for i in range(PROBE)]
    assert v.find([extra[0]])[0] == 0

    table.retire(first[3])
    assert table.publish(extra[0], 15 * BLOCK, 64)
    assert table._slot_of[extra[0]] == (home + 3) % 64
    assert table.unpublished == 2                        # only failures count
    rest = first[:3] + first[4:]                         # those past the tombstone: probing goes on
    n, _, _, offsets, _ = v.find(rest + [extra[0]])
    assert n == PROBE
    assert offsets.tolist() == [BLOCK * i for i in range(PROBE) if i != 3] + [15 * BLOCK]
    assert v.find([first[3]])[0] == 0
    assert not table.publish(extra[1], 0, 64)            # the window is full again


# ---------------------------------------------------------------- reader epochs


def test_enter_announces_the_epoch_and_holds_space_back(table, session):
    v = session.view
    page = table._readers[session.name][1]
    assert table.oldest_reader() is None and table.reusable(table.epoch)

    slot = v.enter()
    e = table.epoch
    assert page[slot] == e
    assert table.oldest_reader() == e
    assert not table.reusable(e) and not table.reusable(e + 5)   # a tag >= the announced epoch
    assert table.reusable(e - 1)

    table.publish(word_key(9), 0, 64)
    tag = table.retire(word_key(9))
    assert tag == e and not table.reusable(tag)
    late = v.enter()                                     # entered after the retire: newer epoch
    assert page[late] == e + 1 and table.oldest_reader() == e
    v.leave(slot)
    assert page[slot] == 0
    assert table.oldest_reader() == e + 1 and table.reusable(tag)
    v.leave(late)
    assert table.oldest_reader() is None and table.reusable(tag + 100)


def test_oldest_reader_spans_sessions_and_close_reader_drops_a_page(table, session):
    other = Session(table, name="s2")
    try:
        assert table.readers == 2
        a = session.view.enter()
        table.publish(word_key(1), 0, 64)
        table.retire(word_key(1))
        b = other.view.enter()
        assert table.oldest_reader() == table.epoch - 1
        table.close_reader(session.name)                 # its page no longer holds anything back
        assert table.readers == 1
        assert table.oldest_reader() == table.epoch
        table.close_reader(session.name)                 # twice: harmless
        other.view.leave(b)
        assert table.oldest_reader() is None
        session.view.leave(a)
    finally:
        other.close()


def test_enter_returns_none_when_every_reader_slot_is_taken(table, session):
    v = session.view
    slots = [v.enter() for _ in range(READER_SLOTS)]
    assert sorted(slots) == list(range(READER_SLOTS))
    assert v.enter() is None
    v.leave(slots[17])
    assert v.enter() == 17
    for s in slots:
        v.leave(s)
    assert table.oldest_reader() is None


# ---------------------------------------------------------------- through the host tier


@pytest.fixture
def host():
    tier = HostTier(ARENA, shared=True, block_table=True)
    s = Session(tier.block_table, tier.capacity_bytes, name="client")
    yield tier, s
    s.close()
    tier.close()


def put(tier, key, data):
    tier.reserve(key, len(data))
    tier.write(key, 0, data)
    tier.commit(key)


def fill(tier, n=ARENA // BLOCK, seed=RNG_SEED):
    rng = np.random.default_rng(seed)
    keys = rand_keys(rng, n - 1) + [word_key(0xAB)]
    for i, k in enumerate(keys):
        put(tier, k, bytes([i]) * BLOCK)
    return keys


def test_host_tier_keeps_a_table_only_when_shared():
    for kw in ({"shared": False, "block_table": True}, {"shared": True, "block_table": False}):
        tier = HostTier(ARENA, **kw)
        try:
            assert tier.block_table is None
        finally:
            tier.close()


def test_host_commit_publishes_with_the_blocks_place(host):
    tier, s = host
    tier.reserve(word_key(1), 100)
    assert s.view.find([word_key(1)])[0] == 0            # a reservation is not published
    tier.abort(word_key(1))
    keys = fill(tier)
    assert tier.block_table.published == len(keys) == 16
    n, _, _, offsets, sizes = s.view.find(keys)
    assert n == 16
    assert offsets.tolist() == [tier.offset_of(k) for k in keys]
    assert sizes.tolist() == [BLOCK] * 16
    seg = tier.segment()
    m = mmap.mmap(seg.fd, seg.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        for i, (off, size) in enumerate(zip(offsets.tolist(), sizes.tolist())):
            assert m[off:off + size] == bytes([i]) * BLOCK
    finally:
        m.close()


def test_host_free_without_readers_reuses_at_once(host):
    tier, s = host
    keys = fill(tier)
    tier.free(keys[0])
    assert tier._retired == [] and tier.used_bytes == ARENA - BLOCK
    assert s.view.find(keys[:1])[0] == 0
    put(tier, word_key(5), b"x" * BLOCK)


def test_host_free_while_a_reader_is_in_waits_for_it(host):
    tier, s = host
    keys = fill(tier)
    v = s.view
    slot = v.enter()
    n, slots, seqs, _, _ = v.find(keys[:4])
    assert n == 4
    tier.free(keys[1])
    assert v.valid(slots, seqs) == 1
    assert len(tier._retired) == 1 and tier.used_bytes == ARENA   # still counted
    assert not tier.fits(BLOCK)
    with pytest.raises(NoRoom):
        tier.reserve(word_key(6), BLOCK)
    assert tier.used_bytes == ARENA

    late = v.enter()                                     # announced after the retire: holds nothing
    v.leave(slot)
    assert tier.fits(BLOCK)
    assert tier._retired == [] and tier.used_bytes == ARENA - BLOCK
    put(tier, word_key(6), b"y" * BLOCK)
    v.leave(late)


def test_host_session_closed_while_inside_releases(host):
    tier, s = host
    keys = fill(tier)
    s.view.enter()
    tier.free(keys[0])
    assert not tier.fits(BLOCK)
    tier.block_table.close_reader(s.name)
    assert tier.fits(BLOCK) and tier.used_bytes == ARENA - BLOCK


def test_host_stuck_reader_is_overridden_after_stuck_reader_s(host, monkeypatch):
    tier, s = host
    keys = fill(tier)
    t0 = 1024.0
    now = [t0]
    monkeypatch.setattr(bt, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    s.view.enter()                                       # never leaves
    tier.free(keys[0])                                   # retired at t0, the reader first seen holding
    now[0] = t0 + bt.STUCK_READER_S * 0.99
    assert not tier.fits(BLOCK) and tier.used_bytes == ARENA
    now[0] = t0 + bt.STUCK_READER_S                      # exactly the limit: no longer held
    assert tier.fits(BLOCK)
    assert tier._retired == [] and tier.used_bytes == ARENA - BLOCK


def test_host_stuck_reader_limit_is_the_tables(host, monkeypatch):
    tier, s = host
    keys = fill(tier)
    s.view.enter()
    tier.free(keys[0])
    assert not tier.fits(BLOCK)
    monkeypatch.setattr(bt, "STUCK_READER_S", 0.0)
    assert tier.fits(BLOCK) and tier.used_bytes == ARENA - BLOCK


def test_host_close_closes_the_table():
    tier = HostTier(ARENA, shared=True, block_table=True)
    s = Session(tier.block_table, tier.capacity_bytes)
    try:
        keys = fill(tier, 2)
        n, slots, seqs, _, _ = s.view.find(keys)
        assert n == 2 and s.view.open()
        tier.close()                                     # once only (see the close-twice test)
        assert not s.view.open() and s.view.valid(slots, seqs) == 0
    finally:
        s.close()


# ---------------------------------------------------------------- close


def test_close_marks_the_table_closed(session):
    table, v = session.table, session.view
    keys = [word_key(1), word_key(2)]
    for i, k in enumerate(keys):
        table.publish(k, 64 * i, 64)
    n, slots, seqs, _, _ = v.find(keys)
    assert n == 2 and v.open() and v.valid(slots, seqs) == 2
    table.close()
    assert not v.open()
    assert v.valid(slots, seqs) == 0
    assert not table.publish(word_key(3), 0, 64) and table.unpublished == 0
    assert table.published == 0 and table.readers == 0
    assert table.retire(keys[0]) is None


def test_close_twice_leaves_other_descriptors_alone():
    t = BlockTable(ARENA, slots=64)
    n = t.fd
    t.close()
    other = os.open("/dev/null", os.O_RDONLY)
    os.dup2(other, n)                                    # an unrelated file now has the table's number
    try:
        t.close()
        assert os.fstat(n).st_ino == os.fstat(other).st_ino    # the unrelated file is still open there
    finally:
        os.close(other)
        try:
            os.close(n)
        except OSError:
            pass


# ---------------------------------------------------------------- torn entries


@pytest.mark.parametrize("offset, size", [(ARENA - 10, 100), (ARENA, 1), (0, 0), (0, ARENA + 1),
                                          ((1 << 64) - 64, 64), (1 << 63, 64)])
def test_an_entry_outside_the_arena_stops_the_run(table, session, offset, size):
    keys = [word_key(1), os.urandom(32), word_key(3)]
    for i, k in enumerate(keys):
        table.publish(k, 4096 * i, 64)
    i = table._slot_of[keys[1]]
    table._entries[i, E_OFFSET] = offset
    table._entries[i, E_SIZE] = size
    n, slots, _, offsets, _ = session.view.find(keys)
    assert n == 1 and offsets.tolist() == [0] and len(slots) == 1


def test_an_entry_ending_at_the_arena_end_is_served(table, session):
    k = os.urandom(32)
    table.publish(k, ARENA - 64, 64)
    assert session.view.find([k])[0] == 1


@pytest.mark.parametrize("offset, size", [(64, (1 << 63) - 1), (1 << 62, 1 << 62)])
def test_an_entry_whose_end_overflows_stops_the_run(table, session, offset, size):
    k = os.urandom(32)
    table.publish(k, 0, 64)
    table._entries[table._slot_of[k], E_OFFSET] = offset
    table._entries[table._slot_of[k], E_SIZE] = size
    assert session.view.find([k])[0] == 0


# ---------------------------------------------------------------- read-only descriptor


def test_the_readonly_descriptor_maps_but_not_writably(table, session):
    table.publish(word_key(4), 640, 64)
    assert session.view.find([word_key(4)])[3].tolist() == [640]    # the view is on readonly_fd
    with pytest.raises(OSError):                          # PermissionError is one
        mmap.mmap(session.ro, table.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(session.ro, b"x")
    m = mmap.mmap(session.ro, table.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        with pytest.raises(TypeError):
            m[0:1] = b"\0"
    finally:
        m.close()


def test_the_readonly_descriptor_cannot_be_reopened_writable(table, session):
    try:
        fd = os.open(f"/proc/self/fd/{session.ro}", os.O_RDWR)
    except OSError:
        return
    try:
        with pytest.raises(OSError):
            mmap.mmap(fd, table.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- header checks


def test_view_refuses_another_arena_size(table):
    ro, rfd = readonly_fd(table.fd), table.open_reader("x")
    try:
        for arena in (ARENA - 64, ARENA + 64, 0):
            with pytest.raises(OSError):
                TableView(ro, rfd, arena)
        TableView(ro, rfd, ARENA).close()
    finally:
        os.close(ro)
        os.close(rfd)


@pytest.mark.parametrize("word, value", [(H_MAGIC, 0), (H_MAGIC, bt.MAGIC ^ 1), (H_VERSION, bt.VERSION + 1),
                                         (bt.H_BITS, 7)])
def test_view_refuses_a_bad_header(table, word, value):
    table._header[word] = value
    ro, rfd = readonly_fd(table.fd), table.open_reader("x")
    try:
        with pytest.raises(OSError):
            TableView(ro, rfd, ARENA)
    finally:
        os.close(ro)
        os.close(rfd)


def test_view_refuses_a_file_too_small_for_a_header(table):
    fd = os.memfd_create("tiny")
    rfd = table.open_reader("x")
    try:
        os.ftruncate(fd, 16)
        with pytest.raises(OSError):
            TableView(fd, rfd, ARENA)
    finally:
        os.close(fd)
        os.close(rfd)


# ---------------------------------------------------------------- sizing, flags


@pytest.mark.parametrize("slots", [100, 32, 0, -64, 96])
def test_bad_slot_counts_are_refused(slots):
    with pytest.raises(ValueError):
        BlockTable(ARENA, slots=slots)


def test_slot_counts_and_default_slots():
    t = BlockTable(ARENA, slots=64)
    try:
        assert t.bits == 6 and t.nbytes == (8 + 64 * 8) * 8
    finally:
        t.close()
    assert default_slots(0) == MIN_SLOTS
    assert default_slots(ARENA) == MIN_SLOTS
    assert default_slots(1 << 30) == 1 << 17             # one slot per 8 KiB
    assert default_slots(3 * 1024 * SLOT_PER_BYTES) == 4096   # rounded up to a power of two
    assert default_slots(1 << 50) == MAX_SLOTS
    for nbytes in [0, 1, 4096, ARENA, 3 << 27, 1 << 30, (1 << 34) + 12345, 1 << 40, 1 << 60]:
        s = default_slots(nbytes)
        assert s & (s - 1) == 0 and MIN_SLOTS <= s <= MAX_SLOTS
        assert s >= min(MAX_SLOTS, nbytes // SLOT_PER_BYTES)
    t = BlockTable(1 << 30)
    try:
        assert t.slots == 1 << 17 and t.bits == 17
    finally:
        t.close()


def test_answer_lookups_is_seen_by_the_view(table, session):
    assert not session.view.answers_lookups
    table.answer_lookups(True)
    assert session.view.answers_lookups
    table.answer_lookups(False)
    assert not session.view.answers_lookups


# ---------------------------------------------------------------- races replayed step by step


class _DaemonActsBetweenReads:
    """A view's entries whose row read (after the seq read, before the second one) first lets
    the daemon retire ``old`` and start publishing another block into the same slot (its seq
    odd, offset and size written, key words not yet)."""

    def __init__(self, real, table, old, slot):
        self.real, self.table, self.old, self.slot, self.reads = real, table, old, slot, 0

    def _daemon_acts(self):
        self.table.retire(self.old)
        e = self.table._entries
        e[self.slot, E_SEQ] += 1
        e[self.slot, E_OFFSET] = 8192
        e[self.slot, E_SIZE] = 65536
        e[self.slot, bt.E_STATE] = bt.LIVE

    def __getitem__(self, index):               # a view reading the seq and the rows by indexing
        self.reads += 1
        if self.reads == 2:
            self._daemon_acts()
        return self.real[index]

    def take(self, index, axis=None):           # ... or the rows by one take, between its seq reads
        self._daemon_acts()
        return self.real.take(index, axis=axis)


def test_a_row_rewritten_between_its_seq_and_its_fields_is_not_found(table, session):
    old = keys_with_home(table.bits, 5, 1)[0]
    table.publish(old, 0, 4096)
    slot = table._slot_of[old]
    session.view._entries = _DaemonActsBetweenReads(session.view._entries, table, old, slot)
    reader = session.view.enter()
    n, _, _, offsets, sizes = session.view.find([old])
    session.view.leave(reader)
    assert (n, offsets.tolist(), sizes.tolist()) == (0, [], [])   # not K's key with another block's size


def test_oldest_reader_while_a_client_announces_and_leaves_never_fails():
    """A client writes its reader page while the daemon scans it: the scan must not fail
    (it once raised ValueError inside free(), losing the block's space for good)."""
    host = HostTier(1 << 20, shared=True, block_table=True)
    fd = host.block_table.open_reader("busy")
    pid = os.fork()
    if pid == 0:                                        # the client: announce, leave, as fast as it can
        try:
            page = np.frombuffer(mmap.mmap(fd, READER_SLOTS * 8), dtype="<u8")
            for _ in range(20_000_000):
                page[0] = 1
                page[0] = 0
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 120
        for i in range(30_000):
            k = i.to_bytes(32, "little")
            while True:                                 # the arena may be all retired space while the
                try:                                    # client (descheduled) holds its epoch: it comes back
                    host.reserve(k, 4096)
                    break
                except NoRoom:
                    assert time.monotonic() < deadline, "retired space never came back"
                    time.sleep(0.001)
            host.mark_written(k, 4096)
            host.commit(k)
            host.free(k)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)
    host.block_table.close_reader("busy")
    assert host.fits(host.capacity_bytes) and not host._retired and host.used_bytes == 0
    host.close()
