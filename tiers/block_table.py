"""The shared block table: where each block of the shared host arena lies, readable by
same-node clients without a round trip to the daemon.

The daemon's host tier (:class:`tiers.host.HostTier` with ``shared``) keeps, beside its
arena, a hash table in a memfd of its own: one entry per committed block, published when the
block is committed and retired before its space is freed. A client maps it read-only
(:class:`TableView`), finds a prefix's blocks with a few vectorised numpy passes, copies them
out of the arena, and checks afterwards that nothing it read changed (a seqlock per entry).
No lookup, lease or release crosses the socket; the client tells the daemon which blocks it
read in a frame that waits for no answer, for the eviction policies.

Layout (little-endian 8-byte words; the header is 8 words, every entry 8 words = 64 bytes)::

    header   magic, version, slots log2, probe, state, epoch, arena bytes, flags
    entry    seq, offset, size, state, key (4 words)

- **Hashing**: the home slot of a key is the top ``slots log2`` bits of
  ``x * 0x9E3779B97F4A7C15`` (Fibonacci hashing, Knuth TAOCP 6.4), where ``x`` xors the
  key's four words each times an odd constant of :data:`WORD_MIX` (so keys made of one
  repeated word do not all share a slot). A key lies in one of the :data:`PROBE` slots from its home (linear
  probing); a block that finds no free one there is not published and is read by a lease.
  An entry's ``state`` is EMPTY (never used: a probe stops there), LIVE or TOMBSTONE
  (retired; reused by a later block).
- **Seqlock** (Lameter, "Effective synchronization on Linux/NUMA systems", 2005): the
  daemon makes an entry's ``seq`` odd, writes the entry, makes it even again. A client reads
  ``seq``, then the entry, then the block's bytes, then ``seq`` again: the bytes are served
  only when both reads agree and are even. An entry is retired (its ``seq`` moved on) before
  its space is freed, so a copy that may have raced a reuse of the space is always caught.
  This relies on the memory order of x86-64 (loads are not reordered with loads, nor stores
  with stores); elsewhere the table is not offered (:func:`supported`).
- **Readers and deferred reuse** (epoch-based reclamation, Fraser, "Practical lock-freedom",
  2004): each client session also gets a reader page (:data:`READER_SLOTS` words, one per
  reading thread) that it writes the table's ``epoch`` into before a read and 0 after. A
  retired entry's space is tagged with the epoch, the epoch advances, and the space is
  reused only once no reader holds an epoch at or below the tag
  (:meth:`BlockTable.reusable`), or after :data:`STUCK_READER_S` (a stopped client then
  costs only the seqlock's re-read). So a client does not read space that is being reused
  while its read is announced; the seqlock covers the rest.
- **Fences**: a client's announce-then-read and the daemon's retire-then-scan are
  store-then-load sequences, which x86 may reorder; :func:`fence` (a lock taken and
  released: a locked instruction, a full barrier on x86) stands between them.

The table is an accelerator, never the authority: a key not found in it is asked of the
daemon (it may be on NVMe, in a reservation, or unpublished), and a closed table (the
daemon stopped: ``state`` CLOSED) or an ended session is not read.
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import time

import numpy as np

MAGIC = 0x3130_4C42_5456_534B          # b"KSVTBL01" read as a little-endian word
VERSION = 1
HEADER_WORDS = 8
ENTRY_WORDS = 8
H_MAGIC, H_VERSION, H_BITS, H_PROBE, H_STATE, H_EPOCH, H_ARENA, H_FLAGS = range(8)
E_SEQ, E_OFFSET, E_SIZE, E_STATE, E_KEY = 0, 1, 2, 3, 4
EMPTY, LIVE, TOMBSTONE = 0, 1, 2
OPEN, CLOSED = 1, 2
LOOKUPS = 1
"""Flag: the arena's tier is the node's fastest (a lookup found whole here may be answered here)."""

PROBE = 8
"""Slots a key may lie in from its home slot (linear probing)."""
MIN_SLOTS = 1 << 10
MAX_SLOTS = 1 << 21
"""Most entries (128 MiB of table): an arena of small blocks past that has some unpublished."""
SLOT_PER_BYTES = 8 << 10
"""One slot per this many bytes of arena (two per 16 KiB block), within the bounds above."""
READER_SLOTS = 512
"""Reading threads of one client session at once (one 8-byte word each: a 4 KiB page)."""
STUCK_READER_S = 1.0
"""A retired block's space waits at most this long for readers that announced an older epoch
(seconds): a client stopped inside a read (SIGSTOP, a debugger) does not hold space forever."""

_MULT = np.uint64(0x9E3779B97F4A7C15)
WORD_MIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x9FB21C651E98DF25, 0xD6E8FEB86659FD93)
"""Odd multipliers of the key's words before they are xored (MurmurHash3's, SplitMix's)."""
_MIX = np.array(WORD_MIX, dtype=np.uint64)


def supported() -> bool:
    """Whether this machine's memory order makes the table's seqlock sound (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def fence() -> None:
    """A full memory barrier: a new lock taken and released (a locked instruction on x86 orders
    every earlier store before every later load); a new one, as a shared one could be left
    held in a forked child."""
    lock = threading.Lock()
    lock.acquire()
    lock.release()


def default_slots(arena_bytes: int) -> int:
    """Entries for an arena of ``arena_bytes`` bytes: a power of two, one per
    :data:`SLOT_PER_BYTES`, within [:data:`MIN_SLOTS`, :data:`MAX_SLOTS`]."""
    want = max(MIN_SLOTS, min(MAX_SLOTS, arena_bytes // SLOT_PER_BYTES))
    return 1 << (want - 1).bit_length()


def key_words(keys: list[bytes]) -> np.ndarray:
    """``keys`` (32 bytes each) as an ``(n, 4)`` uint64 array."""
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 4)


def home_slots(words: np.ndarray, bits: int) -> np.ndarray:
    """The home slot of each key of ``words`` (``(n, 4)`` uint64) in a table of ``2**bits``."""
    m = words * _MIX                        # wraps modulo 2**64
    x = m[:, 0] ^ m[:, 1] ^ m[:, 2] ^ m[:, 3]
    return ((x * _MULT) >> np.uint64(64 - bits)).astype(np.int64)


def _memfd(name: str, nbytes: int, *, sealed_writes: bool = False) -> tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` that cannot grow or shrink, mapped shared, writable and populated
    here (resident in this process's memory, not in a client's that maps it); with ``sealed_writes``
    no mapping or write made after this one may write it (``F_SEAL_FUTURE_WRITE``, Linux 5.1: a
    client reopening the descriptor read-write through ``/proc`` still cannot write the table)."""
    import fcntl
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        seals = fcntl.F_SEAL_SEAL | (getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10) if sealed_writes else 0)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except OSError:                 # a kernel before 5.1: clients are trusted not to reopen it
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        return fd, m
    except BaseException:
        os.close(fd)
        raise


def readonly_fd(fd: int) -> int:
    """A new descriptor of memfd ``fd`` opened read-only (a client given it maps the table
    read-only; the table's ``F_SEAL_FUTURE_WRITE`` keeps a reopened one from writing it).
    Raises OSError."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class BlockTable:
    """The daemon's side: publishes and retires the arena's blocks, and hands out reader pages.

    Args:
        arena_bytes: the arena's size (told to clients, which check their mapping against it).
        slots: entries (a power of two of at least 64; default :func:`default_slots`).

    Thread safety: callers serialise :meth:`publish` and :meth:`retire` (the host tier's
    lock); the readers' bookkeeping has a lock of its own. Raises OSError when the memfd
    cannot be made, ValueError for bad ``slots``.
    """

    def __init__(self, arena_bytes: int, slots: int | None = None):
        slots = default_slots(arena_bytes) if slots is None else int(slots)
        if slots < 64 or slots & (slots - 1):
            raise ValueError(f"block table slots must be a power of two of at least 64, got {slots}")
        self.slots = slots
        self.bits = slots.bit_length() - 1
        self.nbytes = (HEADER_WORDS + slots * ENTRY_WORDS) * 8
        self.fd, self._map = _memfd("kvstore-block-table", self.nbytes, sealed_writes=True)
        words = np.frombuffer(self._map, dtype="<u8")
        self._header = words[:HEADER_WORDS]
        self._entries = words[HEADER_WORDS:].reshape(slots, ENTRY_WORDS)
        self._header[[H_MAGIC, H_VERSION, H_BITS, H_PROBE, H_EPOCH, H_ARENA]] = (
            MAGIC, VERSION, self.bits, PROBE, 1, arena_bytes)
        self._header[H_STATE] = OPEN          # last: a table is read only once whole
        self._slot_of: dict[bytes, int] = {}
        self._readers: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        self._readers_lock = threading.Lock()
        self._held_since: dict[str, dict[int, float]] = {}   # session -> epoch -> first seen held
        self.unpublished = 0
        """Blocks committed that found no free entry in their probe window (read by lease)."""

    @property
    def epoch(self) -> int:
        return int(self._header[H_EPOCH])

    @property
    def published(self) -> int:
        return len(self._slot_of)

    def publish(self, key: bytes, offset: int, size: int) -> bool:
        """Make block ``key`` (``size`` bytes at arena ``offset``) findable; False when its
        probe window has no free entry (counted in :attr:`unpublished`)."""
        if key in self._slot_of:
            return True
        if self._header[H_STATE] != OPEN:
            return False
        home = int(home_slots(words := key_words([key]), self.bits)[0])
        e = self._entries
        for p in range(PROBE):
            i = (home + p) & (self.slots - 1)
            if e[i, E_STATE] != LIVE:
                seq = int(e[i, E_SEQ])
                e[i, E_SEQ] = seq + 1                    # odd: being written
                e[i, E_OFFSET:E_KEY] = (offset, size, LIVE)
                e[i, E_KEY:] = words[0]
                e[i, E_SEQ] = seq + 2
                self._slot_of[key] = i
                return True
        self.unpublished += 1
        return False

    def retire(self, key: bytes) -> int | None:
        """Unpublish block ``key`` before its space is freed; returns the epoch its space is
        tagged with (see :meth:`reusable`), or None when it was not published (no client
        can have found it: its space may be reused at once)."""
        i = self._slot_of.pop(key, None)
        if i is None:
            return None
        e = self._entries
        seq = int(e[i, E_SEQ])
        e[i, E_SEQ] = seq + 1
        e[i, E_STATE] = TOMBSTONE                 # the key stays: probes go on past it
        e[i, E_SEQ] = seq + 2
        tag = int(self._header[H_EPOCH])
        self._header[H_EPOCH] = tag + 1
        return tag

    def oldest_reader(self) -> int | None:
        """The oldest epoch a reader announced and still holds, or None when none reads. An
        epoch a session has held for :data:`STUCK_READER_S` (seen so by these scans) counts
        as no reader's: a client stopped inside a read holds space back once, for that long,
        not again for every block freed after (its copies fail the seqlock check)."""
        fence()                                   # the retire's stores before the readers' loads
        now = time.monotonic()
        oldest = None
        with self._readers_lock:
            for session, (_, page) in self._readers.items():
                snap = page.copy()            # one read of the page: a slot may clear meanwhile
                nonzero = snap[snap != 0]
                if not nonzero.size:
                    self._held_since.pop(session, None)
                    continue
                held = set(nonzero.tolist())
                seen = self._held_since.setdefault(session, {})
                for epoch in [e for e in seen if e not in held]:
                    del seen[epoch]
                for epoch in held:
                    if now - seen.setdefault(epoch, now) < STUCK_READER_S:
                        oldest = epoch if oldest is None else min(oldest, epoch)
        return oldest

    def reusable(self, tag: int) -> bool:
        """Whether space retired with epoch ``tag`` may be reused: no reader announced an
        epoch at or below it."""
        oldest = self.oldest_reader()
        return oldest is None or oldest > tag

    def open_reader(self, session: str) -> int:
        """A reader page for client ``session``: returns its memfd (the caller sends it and
        closes it). Raises OSError."""
        fd, m = _memfd("kvstore-block-readers", READER_SLOTS * 8)
        with self._readers_lock:
            self._readers[session] = (m, np.frombuffer(m, dtype="<u8"))
        return fd

    def close_reader(self, session: str) -> None:
        """The session ended: its reader page no longer holds space back."""
        with self._readers_lock:          # its mapping closes with its last array
            self._readers.pop(session, None)
            self._held_since.pop(session, None)

    @property
    def readers(self) -> int:
        return len(self._readers)

    def answer_lookups(self, on: bool) -> None:
        """Say whether clients may answer lookups from the table (:data:`LOOKUPS`): only
        when the arena's tier is the node's fastest."""
        self._header[H_FLAGS] = LOOKUPS if on else 0

    def close(self) -> None:
        """Mark the table closed (clients stop reading it) and drop it here."""
        self._header[H_STATE] = CLOSED
        self._slot_of.clear()
        with self._readers_lock:
            self._readers.clear()
        fd, self.fd = self.fd, -1           # closed once: a second close leaves others' descriptors alone
        if fd >= 0:
            os.close(fd)


class TableView:
    """A client's read-only mapping of the table and its session's reader page.

    Args:
        table_fd: the table's memfd (read-only is enough); reader_fd: the session's reader
            page. Both stay the caller's to close.
        arena_bytes: the size of the arena mapped beside it (checked against the header).
    Raises OSError when either cannot be mapped or the table is not one this client reads.
    """

    def __init__(self, table_fd: int, reader_fd: int, arena_bytes: int):
        size = os.fstat(table_fd).st_size
        if size < HEADER_WORDS * 8:
            raise OSError(f"a block table of {size} bytes")
        self._map = mmap.mmap(table_fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                              prot=mmap.PROT_READ)   # every page mapped now, not at a find's first touch
        words = np.frombuffer(self._map, dtype="<u8")
        self._header = header = words[:HEADER_WORDS]
        bits = int(header[H_BITS])
        if (int(header[H_MAGIC]) != MAGIC or int(header[H_VERSION]) != VERSION or not 6 <= bits <= 30
                or size != (HEADER_WORDS + (ENTRY_WORDS << bits)) * 8 or int(header[H_ARENA]) != arena_bytes):
            raise OSError("the daemon's block table is not one this client reads (magic, version or size)")
        self._entries = words[HEADER_WORDS:].reshape(1 << bits, ENTRY_WORDS)
        self._words = words[HEADER_WORDS:]
        self._bits, self._mask = bits, (1 << bits) - 1
        self._window = np.arange(min(max(int(header[H_PROBE]), 1), 64), dtype=np.int64)
        self._arena_bytes = arena_bytes
        self._reader_map = mmap.mmap(reader_fd, READER_SLOTS * 8, flags=mmap.MAP_SHARED,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._reader = np.frombuffer(self._reader_map, dtype="<u8")
        self._free = list(range(READER_SLOTS - 1, -1, -1))
        self._lock = threading.Lock()

    def open(self) -> bool:
        """Whether the daemon still keeps the table (it marks it closed when it stops)."""
        return int(self._header[H_STATE]) == OPEN

    @property
    def answers_lookups(self) -> bool:
        """Whether a lookup found whole in the table may be answered from it (:data:`LOOKUPS`)."""
        return bool(int(self._header[H_FLAGS]) & LOOKUPS)

    def enter(self) -> int | None:
        """Announce a read: a reader slot holding the table's epoch (pass it to
        :meth:`leave`), or None when every slot is taken (read by lease instead)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self._reader[slot] = self._header[H_EPOCH]
        fence()                                   # announced before any entry is read
        return slot

    def leave(self, slot: int) -> None:
        self._reader[slot] = 0
        with self._lock:
            self._free.append(slot)

    def find(self, keys: list[bytes]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The longest prefix of ``keys`` found in the table: ``(n, slots, seqs, offsets,
        sizes)``, the arrays (int64) of its ``n`` blocks; ``seqs`` are what :meth:`valid`
        checks after the copy. Read between :meth:`enter` and :meth:`leave`."""
        n = len(keys)
        empty = np.zeros(0, dtype=np.int64)
        if not n:
            return 0, empty, empty, empty, empty
        words = key_words(keys)
        probe = self._window
        idx = ((home_slots(words, self._bits)[:, None] + probe) & self._mask).ravel()   # (n * probe)
        words_at = idx * ENTRY_WORDS
        s1 = self._words.take(words_at)           # seq, the entry, seq again (the seqlock)
        got = self._entries.take(idx, axis=0)
        s2 = self._words.take(words_at)
        want = np.repeat(words, len(probe), axis=0)
        match = (got[:, E_STATE] == LIVE) & ((s1 & 1) == 0) & (s1 == s2)
        for w in range(4):                        # column by column: faster than one .all() here
            match &= got[:, E_KEY + w] == want[:, w]
        # the whole probe window at once: a key has at most one live entry (publish), so a
        # match anywhere in its window is that entry
        match = match.reshape(n, len(probe))
        found = match.any(axis=1)
        run = n if found.all() else int(np.argmin(found))
        at = np.arange(run) * len(probe) + match[:run].argmax(axis=1)
        slot, seq, rows = idx[at], s1[at].astype(np.int64), got[at, E_OFFSET:]
        offsets, sizes = rows[:run, E_OFFSET - 1], rows[:run, E_SIZE - 1]
        arena = np.uint64(self._arena_bytes)
        inside = (sizes > 0) & (sizes <= arena) & (offsets <= arena - np.minimum(sizes, arena))   # no overflow
        if not inside.all():                      # a torn entry: stop before it (the lease path reads it)
            run = int(np.flatnonzero(~inside)[0])
        return (run, slot[:run].astype(np.int64), seq[:run], offsets[:run].astype(np.int64),
                sizes[:run].astype(np.int64))

    def valid(self, slots: np.ndarray, seqs: np.ndarray) -> int:
        """How many of the blocks found (from the first) are still as found, their bytes
        copied meanwhile being theirs: the entries' ``seq`` unchanged, the table open."""
        now = self._entries[slots, E_SEQ].astype(np.int64)
        if not self.open():
            return 0
        changed = np.flatnonzero(now != seqs)
        return int(changed[0]) if changed.size else len(slots)

    def close(self) -> None:
        for m in (self._map, self._reader_map):
            try:
                m.close()
            except BufferError:                   # an array still views it; unmapped with it
                pass
