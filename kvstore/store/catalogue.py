"""The block catalogue: which blocks exist, where, who holds them, and what changed.

One object, one lock. It records per block the tiers holding a committed copy
(:class:`Entry`), the writes in progress (:class:`Claim`: a key being put is claimed
before room is made, so a second put of the same key waits instead of reserving), and
the one pin mechanism of the store:

- a **pin** holds a block while a read or a tier-to-tier copy runs (no TTL: the holder
  always unpins in a ``finally``);
- a **lease** is a set of pins with a TTL and an owner (a tenant), granted to a client
  that reads blocks in place (the shared host arena, or HBM through CUDA IPC). It ends
  by :meth:`Catalogue.release`, when its TTL passes (:meth:`Catalogue.expire`), or when
  the same-node client session it was granted to ends (:meth:`Catalogue.end_session`).

A pinned block is never evicted; a delete of a pinned block hides it at once and its
copies are freed (through the ``on_unpinned`` callback the manager passes in) when the
last pin goes.

Events (:class:`BlockEvent`) report every copy that appears or disappears, with the
reason; listeners (KV events for routers, metrics, the eviction record of
``kvstore explain``, prefetch accounting) subscribe through :class:`EventBus`.

All times are ``time.monotonic`` seconds unless named ``*_unix``.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from tiers.base import TierKind

log = logging.getLogger("kvstore.store.catalogue")


OVERDUE_TTLS = 3.0
"""How many TTLs longer an open session's zero-copy reservation is held past its deadline
(its client may be stalled mid-copy) before it is reclaimed like any other."""


@dataclass(eq=False)
class Entry:
    """Catalogue record of one visible block.

    Attributes:
        key: the block key (the store's internal key).
        size: payload bytes.
        tiers: indices of the tiers holding a committed copy, ascending (fastest first).
        pins: reads, copies and lease holdings in progress.
        deleted: hidden by a delete while pinned; freed when the last pin goes.
        meta: the engine's hash of the block and of its parent (:class:`kvstore.common.types.BlockMeta`
            without token ids), when the put carried them.
    """

    key: bytes
    size: int
    tiers: list[int]
    pins: int = 0
    deleted: bool = False
    meta: Any = None          # BlockMeta (engine hash and parent only) for KV events

    @property
    def fastest(self) -> int:
        return self.tiers[0]


@dataclass(eq=False)
class Claim:
    """A put in progress: room reserved in tier ``tier`` (-1 while room is being made).

    ``deadline`` (monotonic seconds, or None) reclaims a zero-copy reservation that its
    client abandoned; ``owner`` is the tenant that may commit it; ``session`` the same-node
    client session that made it ("": none), which aborts it when the client is gone.
    """

    key: bytes
    size: int
    tier: int = -1
    written: int = 0
    owner: str = ""
    deadline: float | None = None
    meta: Any = None
    session: str = ""
    ttl_s: float = 0.0


@dataclass(eq=False)
class Lease:
    """Pins with a TTL granted to ``owner`` (for same-node client ``session``; "": none).
    ``entries`` may be fewer than asked (misses)."""

    lease_id: str
    owner: str
    entries: list[Entry]
    deadline: float
    session: str = ""


@dataclass(frozen=True)
class BlockEvent:
    """A copy of a block appeared in or left a tier.

    Attributes:
        kind: ``"stored"`` or ``"removed"`` (``"cleared"``: every block left, key empty).
        key: internal block key.
        tier: tier name; ``medium`` its kind.
        size: payload bytes.
        reason: stored: ``put``, ``promoted``, ``demoted``, ``write_through``,
            ``recovered``; removed: ``evicted``, ``deleted``, ``corrupt`` (failed its checksum),
            ``missing`` (its tier no longer held it).
        policy: the eviction policy that chose the victim (evictions only).
        last_copy: removed: the block is gone from the whole store.
        meta: what routers index the block by (:class:`kvstore.common.types.BlockMeta`), when known;
            token ids only on the event of the put itself.
        time_unix: wall-clock seconds, for display.
    """

    kind: str
    key: bytes
    tier: str
    medium: TierKind
    size: int
    reason: str
    policy: str = ""
    last_copy: bool = False
    meta: Any = None
    time_unix: float = field(default_factory=time.time)


class EventBus:
    """Synchronous fan-out of :class:`BlockEvent` to listeners.

    Listeners run in the thread that changed the catalogue, with its lock held: they
    must be quick (append to a bounded queue) and must never call back into the store.
    A listener that raises is logged and kept.
    """

    def __init__(self) -> None:
        self._listeners: list[Callable[[BlockEvent], None]] = []

    def subscribe(self, listener: Callable[[BlockEvent], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[BlockEvent], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def active(self) -> bool:
        return bool(self._listeners)

    def emit(self, event: BlockEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a broken listener must not break the store
                log.exception("block event listener %r failed", listener)


class Catalogue:
    """Entries, claims, pins and leases of the store, under one lock.

    Args:
        on_unpinned: called (lock held) with an entry that was deleted while pinned,
            once its last pin is gone: the manager frees its copies.
        clock: monotonic time source for lease and reservation deadlines (seconds).
    """

    def __init__(self, on_unpinned: Callable[[Entry], None], clock: Callable[[], float] = time.monotonic):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.events = EventBus()
        self.clock = clock
        self._on_unpinned = on_unpinned
        self._entries: dict[bytes, Entry] = {}
        self._claims: dict[bytes, Claim] = {}
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []   # heap of (deadline, lease id)
        self._sessions: dict[str, set[str]] = {}        # open client session -> its lease ids

    # ------------------------------------------------------------------ entries

    def get(self, key: bytes) -> Entry | None:
        """The visible entry of ``key`` (None when absent or deleted)."""
        e = self._entries.get(key)
        return None if e is None or e.deleted else e

    def raw(self, key: bytes) -> Entry | None:
        """The entry of ``key`` even when deleted-but-pinned (lock held)."""
        return self._entries.get(key)

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        with self.lock:
            return sum(1 for e in self._entries.values() if not e.deleted)

    def keys(self) -> list[bytes]:
        """Visible keys (a snapshot)."""
        with self.lock:
            return [k for k, e in self._entries.items() if not e.deleted]

    def prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Fastest tier index of each block of the longest stored prefix of ``keys``."""
        out: list[int] = []
        entries = self._entries
        with self.lock:
            for key in keys:
                e = entries.get(key)
                if e is None or e.deleted:
                    break
                out.append(e.tiers[0])
        return out

    def add(self, key: bytes, size: int, tier: int) -> Entry:
        """A first committed copy of a new block (lock held)."""
        e = Entry(key, size, [tier])
        self._entries[key] = e
        return e

    def add_copy(self, entry: Entry, tier: int) -> None:
        if tier not in entry.tiers:
            entry.tiers.append(tier)
            entry.tiers.sort()

    def drop_copy(self, entry: Entry, tier: int) -> bool:
        """Forget ``entry``'s copy in ``tier`` (lock held); True when it was the last copy
        (the entry is then removed)."""
        if tier in entry.tiers:
            entry.tiers.remove(tier)
        if not entry.tiers:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            return True
        return False

    def forget(self, entry: Entry) -> None:
        """Remove ``entry`` entirely (lock held; its copies are freed by the caller)."""
        entry.tiers.clear()
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        self.changed.notify_all()

    def entries(self) -> Iterable[Entry]:
        """Visible entries (a snapshot list; lock held or not)."""
        with self.lock:
            return [e for e in self._entries.values() if not e.deleted]

    # ------------------------------------------------------------------ claims

    def claim(self, key: bytes) -> Claim | None:
        return self._claims.get(key)

    def add_claim(self, claim: Claim) -> None:
        self._claims[claim.key] = claim

    def end_claim(self, claim: Claim) -> bool:
        """Remove ``claim`` if it is still the key's claim (lock held); True if it was."""
        if self._claims.get(claim.key) is claim:
            del self._claims[claim.key]
            self.changed.notify_all()
            return True
        return False

    def reservations(self, now: float) -> tuple[int, int]:
        """Zero-copy reservations open, and of them those past their deadline (held: open session)."""
        deadlines = [c.deadline for c in list(self._claims.values()) if c.deadline is not None]
        return len(deadlines), sum(d <= now for d in deadlines)

    def expired_claims(self, now: float) -> list[Claim]:
        """Zero-copy reservations whose deadline passed. One of a same-node session still
        open is held :data:`OVERDUE_TTLS` TTLs longer: that client may still be writing its
        room (stalled mid-copy), which must not go to another block meanwhile; it ends
        sooner with a Commit, an abort or the session (:meth:`end_session`)."""
        return [c for c in self._claims.values() if c.deadline is not None and c.deadline <= now
                and not (c.session in self._sessions and now < c.deadline + OVERDUE_TTLS * c.ttl_s)]

    # ------------------------------------------------------------------ pins

    def pin(self, key: bytes) -> Entry | None:
        """Pin the visible block ``key``; None when it is not stored."""
        with self.lock:
            e = self.get(key)
            if e is not None:
                e.pins += 1
            return e

    def pin_entry(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        """Drop one pin; a deleted entry's copies are freed with its last pin."""
        with self.lock:
            entry.pins -= 1
            if entry.pins == 0:
                if entry.deleted:
                    self._on_unpinned(entry)
                self.changed.notify_all()

    # ------------------------------------------------------------------ leases

    def lease(self, entries: Sequence[Entry], ttl_s: float, owner: str, session: str = "") -> Lease:
        """Pin ``entries`` (already pinned once by the caller: the lease takes those pins
        over) for ``ttl_s`` seconds on behalf of ``owner``, in the open client ``session``
        ("": none; see :meth:`session_open`). Lock held."""
        lease = Lease(secrets.token_hex(16), owner, list(entries), self.clock() + ttl_s, session)
        self._leases[lease.lease_id] = lease
        if session:
            self._sessions[session].add(lease.lease_id)
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        if len(self._deadlines) > 2 * len(self._leases) + 1024:   # released leases, dropped lazily
            self._deadlines = [d for d in self._deadlines if d[1] in self._leases]
            heapq.heapify(self._deadlines)
        return lease

    def release(self, lease_id: str, owner: str) -> bool:
        """End a lease early. False when it is unknown, expired, or ``owner``'s not."""
        with self.lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner != owner:
                return False
            del self._leases[lease_id]
            self._unpin_all(lease)
            return True

    # ------------------------------------------------------------------ client sessions

    def open_session(self, session: str) -> None:
        """Accept leases and reservations of same-node client ``session`` until it ends."""
        with self.lock:
            self._sessions.setdefault(session, set())

    def session_open(self, session: str) -> bool:
        return session in self._sessions

    def end_session(self, session: str, client_gone: bool = True) -> tuple[int, list[Claim]]:
        """``session`` ended. Its client gone: its leases end now; returns how many and its
        reservations (the caller aborts them). Ended by the daemon (``client_gone`` False):
        they keep their TTLs (the client may still use the arena); returns ``(0, [])``."""
        with self.lock:
            ended = 0
            leases = self._sessions.pop(session, ())
            claims = [c for c in self._claims.values() if c.session == session]
            if not client_gone:
                for c in claims:
                    c.session = ""          # now ended by its deadline alone
                return 0, []
            for lease_id in leases:
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._unpin_all(lease)
                    ended += 1
            return ended, claims

    def expire(self) -> int:
        """End the leases whose TTL passed; returns how many."""
        now = self.clock()
        ended = 0
        with self.lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._unpin_all(lease)
                    ended += 1
        return ended

    def _unpin_all(self, lease: Lease) -> None:
        """End ``lease``'s pins (lock held): :meth:`unpin` of each entry, waking the waiters
        once for the whole lease."""
        if lease.session in self._sessions:
            self._sessions[lease.session].discard(lease.lease_id)
        unpinned = False
        for e in lease.entries:
            e.pins -= 1
            if e.pins == 0:
                if e.deleted:
                    self._on_unpinned(e)
                unpinned = True
        if unpinned:
            self.changed.notify_all()
        lease.entries = []

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def next_deadline(self) -> float | None:
        """The earliest lease or reservation deadline (monotonic seconds), if any."""
        with self.lock:
            lease = self._deadlines[0][0] if self._deadlines else None
            claims = [c.deadline for c in self._claims.values() if c.deadline is not None]
            times = [t for t in ([lease] if lease is not None else []) + claims]
            return min(times) if times else None
