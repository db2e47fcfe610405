"""The client's side of the same-node control frames: Lookup, Lease, Release, Reserve and Commit without gRPC.

A mapping made with hello version 3 (:class:`kvstore.client.arena_mapping.ArenaMapping`)
whose daemon answered ``control`` 1 holds a :class:`ControlChannel` on its session
connection; the arena path (:mod:`kvstore.client.arena`) and the client's ``lookup``,
``lease``, ``release`` and zero-copy ``put_from`` use it instead of gRPC (the frames:
:mod:`kvstore.common.arena_wire`; Reserve and Commit only when the daemon says it takes
them, :attr:`ControlChannel.puts`).
One request is on the connection at a time: a call that finds it busy for longer than
:data:`BUSY_WAIT_S` (another thread of the client is waiting for its answer) is told so
(None) and goes by gRPC, so threads never queue behind each other's slow calls. A call that waits past its deadline raises StoreUnavailable;
its answer, when it comes, is skipped by the next call (a late lease answer's lease is
released at once); one whose frame could not be sent in time leaves the channel
unusable (:meth:`ControlChannel.usable`: the calls go by gRPC). A connection that ended (the daemon stopped or restarted, and
with it the session and every lease it held) raises :class:`ControlLost`: the mapping must be
dropped. A channel is used only by the process that made it (not after a fork).
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import threading
import time
from typing import NamedTuple

from kvstore.common import arena_wire as w
from kvstore.common import errors

_BODY = struct.Struct("<BBBBII")        # the header after its length field
_NO_LEASE = bytes(w.LEASE_ID_BYTES)

BUSY_WAIT_S = 0.002
"""How long a call waits for another thread's call on the channel to end before it goes by
gRPC instead (seconds): a release frame holds the channel for one send, a lookup or lease
for one round trip."""


MAX_NOTE_BYTES = 1 << 20
"""Block-table notes queued at most (bytes of frames: about 8,000 of 128 keys); more are
dropped until the queue is sent."""


NOW_NOTE_BYTES = 64 << 10
"""Queued notes up to this many bytes may be sent by a read, when the socket has room (one
write, no wait); more, or a busy channel, go to the release thread."""

NOTE_BATCH_S = 0.002
"""Notes wait this long for the notes of later reads, to go in one write (seconds): each write
wakes the daemon, whose work then competes with the reads for the same cores (a lookup +
``get_into`` of 128 x 32 KiB took 0.55 ms p50 with a write per note, 0.43 ms with none). The
first note of a batch asks the release thread to send it, which it does after its own wait
(:attr:`kvstore.client.lease_releaser.LeaseReleaser.delay_s`, the same 2 ms by default: one
wake per batch, not per read); a read that finds the batch this old writes it itself."""


class ControlLost(OSError):
    """The session connection ended or answered out of protocol: the daemon is gone or
    restarted, the session's leases with it; the mapping must not be used any more."""


class LeaseAnswer:
    """A LEASE answer, with the attribute names of ``LeaseReply``: ``lease_id`` (hex, ""
    when none), ``ttl_seconds``, ``resume_at``, ``complete``, and per block looked at
    ``offsets`` and ``sizes`` (bytes in the arena) and ``tier_codes`` (0: a miss)."""

    __slots__ = ("lease_id", "ttl_seconds", "resume_at", "complete", "offsets", "sizes", "tier_codes")

    def __init__(self, count: int, payload: bytes):
        fixed = w.LEASE_ANSWER.size
        if len(payload) != fixed + 17 * count:
            raise ControlLost(f"a LEASE answer of {len(payload)} bytes for {count} blocks")
        lease_id, self.ttl_seconds, self.resume_at, complete = w.LEASE_ANSWER.unpack_from(payload)
        self.lease_id = "" if lease_id == _NO_LEASE else lease_id.hex()
        self.complete = bool(complete)
        arrays = struct.unpack_from(f"<{2 * count}Q", payload, fixed)
        self.offsets, self.sizes = arrays[:count], arrays[count:]
        self.tier_codes = payload[fixed + 16 * count:]


class ReserveAnswer(NamedTuple):
    """A RESERVE answer, with the attribute names of ``ReserveReply``: per block its arena
    ``offsets`` (bytes) and ``status`` (``ReserveStatus`` codes), and the first refusal's ``detail``."""

    offsets: tuple[int, ...]
    status: bytes
    detail: str


class CommitAnswer(NamedTuple):
    """A COMMIT answer, with the attribute names of ``CommitReply``."""

    committed: int
    bytes_committed: int


class ControlChannel:
    """Control frames on a session connection ``sock`` (a connected unix socket that the
    caller keeps open and closes)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._seq = 0
        self._owed: collections.deque[int] = collections.deque()    # requests whose answer is to come
        self._buf = bytearray(64 << 10)
        self._have = 0
        self.lost = False
        self.puts = False
        """The daemon takes a zero-copy put's Reserve and Commit as frames (set by the mapping)."""
        self._notes: list[bytes] = []
        self._notes_bytes = 0
        self._notes_lock = threading.Lock()
        self._notes_at = 0.0                # when the first note queued was queued (monotonic s)
        self._flush_asked = False           # the release thread asked to send the queue, not done yet
        self.notes_dropped = 0
        """Notes dropped because :data:`MAX_NOTE_BYTES` were waiting (the daemon was slow)."""

    def usable(self) -> bool:
        """Whether calls may be made (the connection is up, and this is the process that made it)."""
        return not self.lost and os.getpid() == self._pid

    def lookup(self, keys: list[bytes], timeout: float) -> tuple[int, bytes] | None:
        """``(hit blocks, tier codes)`` of the longest stored prefix of ``keys`` (at most
        :data:`~kvstore.common.arena_wire.MAX_FRAME_KEYS`), or None when the channel is busy.
        Raises ControlLost, StoreUnavailable (no answer within ``timeout`` s), the store
        error the daemon answered."""
        got = self._call(lambda seq: w.lookup_frame(seq, keys), w.LOOKUP, timeout)
        if got is None:
            return None
        count, payload = got
        if len(payload) != count:
            raise self._broken(f"a LOOKUP answer of {len(payload)} bytes for {count} blocks")
        return count, payload

    def lease(self, keys: list[bytes], ttl_s: float, prefix: bool, max_bytes: int, release: list[str],
              timeout: float) -> LeaseAnswer | None:
        """Lease ``keys`` (at most :data:`~kvstore.common.arena_wire.MAX_FRAME_KEYS`) for
        ``ttl_s`` seconds after releasing the leases ``release`` (ids that are not store
        lease ids are skipped: they name no lease); None when the channel is busy (nothing
        was sent). Raises as :meth:`lookup`."""
        ids = [b for b in map(w.lease_id_bytes, release) if b is not None][:w.MAX_FRAME_RELEASES]
        got = self._call(lambda seq: w.lease_frame(seq, keys, ttl_s, max_bytes, prefix, ids), w.LEASE, timeout)
        if got is None:
            return None
        try:
            return LeaseAnswer(*got)
        except (ControlLost, struct.error) as e:
            raise self._broken(str(e)) from None

    def release(self, lease_ids: list[str], timeout: float, *, reply: bool = True,
                wait: bool = False) -> int | None:
        """Release ``lease_ids``; returns how many were live (0 without ``reply``: the
        daemon sends no answer), or None when the channel is busy (``wait``: wait for it,
        at most ``timeout`` s). Raises as :meth:`lookup`."""
        ids = [b for b in map(w.lease_id_bytes, lease_ids) if b is not None]
        total = 0
        for start in range(0, len(ids), w.MAX_FRAME_RELEASES):
            part = ids[start:start + w.MAX_FRAME_RELEASES]
            got = self._call(lambda seq: w.release_frame(seq, part, reply), w.RELEASE, timeout, reply=reply,
                             wait=wait)
            if got is None:
                return None if start == 0 else total
            total += got[0]
        return total

    def reserve(self, keys: list[bytes], sizes: list[int], ttl_s: float, metas: list[bytes] | None,
                timeout: float) -> ReserveAnswer | None:
        """Reserve arena room for ``keys`` (at most :data:`~kvstore.common.arena_wire.MAX_FRAME_KEYS`)
        of ``sizes`` bytes for ``ttl_s`` seconds (``metas``: serialized ``BlockMeta`` per
        key, or None); None when the channel is busy (nothing was sent). Raises as :meth:`lookup`."""
        got = self._call(lambda seq: w.reserve_frame(seq, keys, sizes, ttl_s, metas), w.RESERVE, timeout)
        if got is None:
            return None
        count, payload = got
        if count != len(keys) or len(payload) < 9 * count:
            raise self._broken(f"a RESERVE answer of {len(payload)} bytes for {count} of {len(keys)} blocks")
        return ReserveAnswer(struct.unpack_from(f"<{count}Q", payload), payload[8 * count:9 * count],
                             bytes(payload[9 * count:]).decode("utf-8", "replace"))

    def commit(self, keys: list[bytes], abort: bool, timeout: float) -> CommitAnswer | None:
        """Commit (``abort``: drop) the reservations of ``keys``; None when the channel is
        busy (nothing was sent). Raises as :meth:`lookup` (BlockNotFound: a reservation
        ended, none committed)."""
        got = self._call(lambda seq: w.commit_frame(seq, keys, abort), w.COMMIT, timeout)
        if got is None:
            return None
        count, payload = got
        if len(payload) != w.COMMIT_ANSWER.size:
            raise self._broken(f"a COMMIT answer of {len(payload)} bytes")
        return CommitAnswer(count, w.COMMIT_ANSWER.unpack(payload)[0])

    def note(self, keys: list[bytes], *, lookup: bool = False) -> bool:
        """Queue a frame the daemon does not answer saying that ``keys`` (at most
        :data:`~kvstore.common.arena_wire.MAX_FRAME_KEYS`) were read from the block table
        (TOUCH: the eviction policies see the hits) or, with ``lookup``, looked up there (a
        LOOKUP it only records); :meth:`try_send_notes` sends the queue when that cannot
        wait, :meth:`send_notes` in any case (the client's release thread). False when
        :data:`MAX_NOTE_BYTES` wait already (the note is dropped: it is advice)."""
        frame = w.lookup_frame(0, keys, reply=False) if lookup else w.touch_frame(0, keys)
        with self._notes_lock:
            if self._notes_bytes + len(frame) > MAX_NOTE_BYTES:
                self.notes_dropped += 1
                return False
            if not self._notes:
                self._notes_at = time.monotonic()
            self._notes.append(frame)
            self._notes_bytes += len(frame)
        return True

    def try_send_notes(self) -> bool:
        """Send the queued notes now if they have waited :data:`NOTE_BATCH_S` and that cannot
        wait: the channel free (no other call on it), at most :data:`NOW_NOTE_BYTES` queued,
        and the socket with room for them (a poll that does not wait; the kernel then takes
        them whole). True when the caller need do nothing more: none left queued, or the
        release thread already asked to send them; False: the caller asks it (:meth:`send_notes`),
        once per batch."""
        if not self._notes:
            return True
        if time.monotonic() - self._notes_at >= NOTE_BATCH_S and self._write_notes():
            return True
        with self._notes_lock:              # the flag is cleared when that thread takes the queue
            asked, self._flush_asked = self._flush_asked, True
        return asked

    def _write_notes(self) -> bool:
        """The queue written now, in one write that does not wait; False when it cannot be."""
        if not self.usable() or self._notes_bytes > NOW_NOTE_BYTES or not self._lock.acquire(blocking=False):
            return False
        try:
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLOUT)
            if not poller.poll(0):
                return False
            with self._notes_lock:
                notes, self._notes, self._notes_bytes = self._notes, [], 0
            try:
                self._sock.sendall(b"".join(notes))
            except OSError:                 # part of a frame may be out: the stream is lost
                self.lost = True
                return True
            return True
        finally:
            self._lock.release()

    def send_notes(self, timeout: float) -> int:
        """Send the queued notes in one write (waiting for the channel, at most ``timeout``
        s); returns how many. Raises ControlLost, StoreUnavailable."""
        with self._notes_lock:
            notes, self._notes, self._notes_bytes, self._flush_asked = self._notes, [], 0, False
        if notes and self._call(lambda seq: b"".join(notes), w.TOUCH, timeout, reply=False, wait=True) is None:
            return 0
        return len(notes)

    # ------------------------------------------------------------------ one request

    def _call(self, frame, op: int, timeout: float, *, reply: bool = True, wait: bool = False):
        if not self._lock.acquire(timeout=timeout if wait else BUSY_WAIT_S):
            return None
        try:
            if not self.usable():
                raise ControlLost("the arena session connection ended")
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            seq = self._seq
            deadline = time.monotonic() + timeout
            try:
                self._sock.settimeout(timeout)
                self._sock.sendall(frame(seq))
            except socket.timeout:          # part of a frame may be out: the stream is lost
                self.lost = True
                raise errors.StoreUnavailable(f"the daemon took no same-node control frame in {timeout:g} s; "
                                              "using gRPC") from None
            except OSError as e:
                self.lost = True
                raise ControlLost(f"the arena session connection failed: {e}") from None
            if not reply:
                return 0, b""
            try:
                self._owed.append(seq)
                while True:
                    got_op, got_seq, count, payload = self._read(deadline)
                    if not self._owed or got_seq != self._owed[0]:
                        raise self._broken(f"an answer to request {got_seq}, expected {self._owed[0] if self._owed else None}")
                    self._owed.popleft()
                    if got_seq == seq:
                        break
                    self._late(got_op, count, payload)    # an answer its call no longer waits for
            except socket.timeout:
                raise errors.StoreUnavailable(f"the daemon did not answer a same-node control call in "
                                              f"{timeout:g} s") from None
            except ControlLost:
                self.lost = True
                raise
            except OSError as e:
                self.lost = True
                raise ControlLost(f"the arena session connection failed: {e}") from None
        finally:
            self._lock.release()
        if got_op == w.ERROR:
            raise w.decode_error(payload)
        if got_op != op | w.REPLY:
            raise self._broken(f"answer op {got_op:#x} to request op {op}")
        return count, payload

    def _late(self, op: int, count: int, payload: bytes) -> None:
        """An answer whose call gave up: a lease it granted is released at once (a frame that
        waits for no answer, so the answers stay in step)."""
        if op == w.LEASE | w.REPLY and len(payload) >= w.LEASE_ANSWER.size:
            lease_id = payload[:w.LEASE_ID_BYTES]
            if lease_id != _NO_LEASE:
                self._sock.sendall(w.release_frame(0, [lease_id], reply=False))

    def _read(self, deadline: float) -> tuple[int, int, int, bytes]:
        while True:
            if self._have >= w.LENGTH.size:
                length = w.LENGTH.unpack_from(self._buf)[0]
                if not w.HEADER_BYTES - w.LENGTH.size <= length <= w.MAX_FRAME_BYTES:
                    raise self._broken(f"an answer frame of {length} bytes")
                total = w.LENGTH.size + length
                if self._have >= total:
                    frame = bytes(self._buf[w.LENGTH.size:total])
                    rest = self._have - total
                    if rest:
                        self._buf[:rest] = self._buf[total:self._have]
                    self._have = rest
                    op, _, _, _, seq, count = _BODY.unpack_from(frame)
                    return op, seq, count, frame[_BODY.size:]
                if total > len(self._buf):
                    self._buf.extend(bytes(total - len(self._buf)))
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self._sock.settimeout(left)
            with memoryview(self._buf) as view:
                n = self._sock.recv_into(view[self._have:])
            if n == 0:
                raise ControlLost("the daemon closed the arena session (it stopped or restarted)")
            self._have += n

    def _broken(self, what: str) -> ControlLost:
        self.lost = True
        return ControlLost(f"the arena session is out of step: {what}")
