"""The eviction policy interface and its registry (name -> class).

A policy orders the blocks resident in *one* tier; the manager asks it for a victim
when the tier is full and tells it about every insert, hit and removal. Policies are
plain Python (no torch), take time as an argument (``now``, seconds, wall-clock in the
daemon and virtual in the simulator) and never touch data, so the daemon and
``kvstore simulate`` run the same code.

Protocol, as seen from the manager::

    policy.admit(key, nbytes, now)        -> bool: may the block enter this tier?
    policy.insert(key, nbytes, now)       block became resident
    policy.access(key, now)               hit on a resident block
    victim = policy.victim(evictable, incoming=key, now=now)
    policy.evicted(victim)                the manager moved it out because of pressure
    policy.remove(key)                    it left for another reason (delete, move)

On top of that every policy honours blocks *let go* (:meth:`EvictionPolicy.let_go`):
blocks whose session finished or was abandoned (session hints, :mod:`kvstore.agent.sessions`)
are the first victims, in the order let go (within one call: last block first, so a
prefix shrinks from its tail), and a full tier refuses to admit them. A let-go is
advisory and is taken back by evidence: every use of a block (a hit, a put asking for
admission) is counted in a :class:`~kvstore.policy.uses.UseLedger`, each let-go block
carries the number of uses its session explains (its own last request may read it
after the hint), and a block used more often than that is somebody else's too: it is
revived, and admitted like any other. A new session that names it revives it too
(:meth:`EvictionPolicy.revive`).

Subclasses implement the policy proper in ``_insert``, ``_access``, ``_remove``,
``_victim`` (and optionally ``_evicted``, ``_admit``, ``victim_reason``); the public
methods here wrap them.

Every pressure eviction can be reported to a listener (:attr:`EvictionPolicy.listener`,
e.g. :class:`kvstore.service.explain.EvictionLog`) as an :class:`EvictionEvent`, which is what
``kvstore explain`` uses to say why a block is gone.

Subclasses register with :func:`register` and are built from config by
:func:`make_policy`, never by an if/elif chain on names.
"""

from __future__ import annotations

import abc
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

from kvstore.common.errors import ConfigError, KVStoreError
from kvstore.policy.uses import UseLedger

MAX_LET_GO = 1 << 20
"""Keys let go remembered per policy (oldest forgotten first)."""


class NoVictim(KVStoreError):
    """Every resident block is pinned or otherwise not evictable."""


@dataclass(frozen=True)
class EvictionEvent:
    """One block pushed out of one tier by pressure.

    Attributes:
        key: the block (32 bytes).
        tier: the tier's name (``hbm``, ``host``, ``nvme``; ``""`` when not set).
        policy: the policy's registry name.
        reason: why the policy chose it, in words.
        time: seconds, the policy clock (the ``now`` of the victim choice).
    """

    key: bytes
    tier: str
    policy: str
    reason: str
    time: float


class EvictionPolicy(abc.ABC):
    """Orders one tier's resident blocks for eviction.

    Args:
        capacity_bytes: the tier's capacity (policies with size-dependent parameters,
            such as ARC's target or S3-FIFO's small queue, derive them from it).
        **params: policy parameters from the TOML config (``[policy] params``).
            Unknown parameters raise ConfigError.

    Attributes:
        tier_name: the tier it orders (set by the builder; used in eviction events).
        listener: called with an :class:`EvictionEvent` on every pressure eviction.
    """

    name: ClassVar[str]
    params_doc: ClassVar[Mapping[str, str]] = {}

    def __init__(self, capacity_bytes: int, **params: Any):
        if params:
            known = ", ".join(sorted(self.params_doc)) or "none"
            raise ConfigError(f"policy {self.name!r}: unknown parameter(s) {sorted(params)} (known: {known})")
        self.capacity_bytes = int(capacity_bytes)
        self.tier_name = ""
        self.listener: Callable[[EvictionEvent], None] | None = None
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self.uses = UseLedger()                                          # shared by share_uses
        self._let_go: OrderedDict[bytes, int] = OrderedDict()            # resident or not -> uses allowed
        self._let_go_resident: OrderedDict[bytes, None] = OrderedDict()  # eviction order
        self._victim_now = 0.0
        self._now = -math.inf            # the latest time any call gave
        # hints (let_go / revive, next_use's set_next_use) come from RPC or prefetch
        # threads while the manager calls the protocol under its own lock: one lock here
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ blocks let go

    def share_uses(self, ledger: UseLedger) -> None:
        """Count uses in ``ledger`` (one for all the tiers of a manager, so a use seen by
        two tiers counts once and the session table reads the same counts)."""
        with self._lock:
            self.uses = ledger

    def let_go(self, keys: Iterable[bytes], allowances: Iterable[int] | None = None,
               until: float = math.inf) -> None:
        """The sessions using ``keys`` ended: evict them first, refuse them when full.

        ``keys`` in prefix order; they leave last first. Keys not resident here are
        remembered (up to :data:`MAX_LET_GO`) in case they arrive later (a demotion,
        or the put of a finished session's last request).

        Args:
            keys: the blocks, in prefix order.
            allowances: per key, the uses (:attr:`uses`) the ended session explains
                (default: the uses so far); a key already used more often is not let go.
            until: one more use before this time (seconds) is the session's own last
                request (a hint that came with it, before its reads and puts); any other
                use beyond the allowance revives the key.
        """
        with self._lock:
            keys = list(keys)
            allowed = list(allowances) if allowances is not None else [self.uses.count(k) for k in keys]
            for key, allow in zip(reversed(keys), reversed(allowed)):
                if self.uses.count(key) > allow:
                    continue
                self._let_go[key] = [allow, until]
                self._let_go.move_to_end(key)
                if key in self._sizes:
                    self._let_go_resident[key] = None
                    self._let_go_resident.move_to_end(key)
            while len(self._let_go) > MAX_LET_GO:
                old, _ = self._let_go.popitem(last=False)
                self._let_go_resident.pop(old, None)

    def revive(self, keys: Iterable[bytes]) -> None:
        """Undo :meth:`let_go` for ``keys`` (a new session uses them)."""
        with self._lock:
            for key in keys:
                if key in self._let_go:
                    del self._let_go[key]
                    self._let_go_resident.pop(key, None)

    def is_let_go(self, key: bytes) -> bool:
        """Whether ``key`` was let go and nobody but its session used it since."""
        with self._lock:
            return self._still_let_go(key, self._now)

    def _still_let_go(self, key: bytes, now: float) -> bool:
        """Whether ``key`` is let go at ``now``; revives it when used beyond its
        allowance (lock held)."""
        rec = self._let_go.get(key)
        if rec is None:
            return False
        used = self.uses.count(key)
        if used <= rec[0]:
            return True
        if used == rec[0] + 1 and now <= rec[1]:     # the session's own last request
            rec[0], rec[1] = used, -math.inf
            return True
        del self._let_go[key]
        self._let_go_resident.pop(key, None)
        return False

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks this policy tracks as resident."""
        return self._used

    # ------------------------------------------------------------------ protocol (public)

    def admit(self, key: bytes, nbytes: int, now: float) -> bool:
        """Whether a new block may enter this tier at all: not a block let go when the
        tier is full; otherwise the policy's own rule (default: always)."""
        with self._lock:
            self._now = max(self._now, now)
            self.uses.note(key, now, self)              # a put: a use (one per put, over all tiers)
            if self._still_let_go(key, now) and self._used + nbytes > self.capacity_bytes:
                return False
            return self._admit(key, nbytes, now)

    def insert(self, key: bytes, nbytes: int, now: float) -> None:
        """``key`` (``nbytes`` bytes) became resident in this tier."""
        with self._lock:
            if key not in self._sizes:
                self._sizes[key] = nbytes
                self._used += nbytes
                if self._still_let_go(key, now):
                    self._let_go_resident[key] = None
            self._insert(key, nbytes, now)

    def access(self, key: bytes, now: float) -> None:
        """A hit on resident ``key``."""
        self.access_all((key,), now)

    def access_all(self, keys: Sequence[bytes], now: float) -> None:
        """:meth:`access` of each of ``keys`` (resident) at one time, under one lock: the hits
        of a lease or of a block-table read (128 blocks: 0.15 ms one by one)."""
        with self._lock:
            self._now = max(self._now, now)
            self.uses.note_all(keys, now, self)
            let_go, access = self._let_go, self._access
            for key in keys:
                if key in let_go:
                    self._still_let_go(key, now)
                access(key, now)

    def remove(self, key: bytes) -> None:
        """``key`` left the tier for a reason other than pressure. No-op if unknown."""
        with self._lock:
            self._forget(key)
            self._remove(key)

    def evicted(self, key: bytes) -> None:
        """``key`` (returned by :meth:`victim`) was moved out because of pressure."""
        with self._lock:
            if self.listener is not None:
                # the words are what `kvstore explain` prints (kept as they were)
                reason = ("its session ended (released by a session hint)" if key in self._let_go_resident
                          else self.victim_reason(key, self._victim_now))
                self.listener(EvictionEvent(key, self.tier_name, self.name, reason, self._victim_now))
            self._forget(key)
            self._evicted(key)

    def victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None = None,
               now: float = 0.0) -> bytes:
        """The resident block to evict next: one let go if any is evictable, else
        the policy's choice.

        Args:
            evictable: False for blocks that must stay (pinned, being written).
            incoming: the key that needs the room, when known (ARC uses it).
            now: current time in seconds.
        Raises:
            NoVictim: no resident block is evictable.
        """
        with self._lock:
            self._victim_now = now
            self._now = max(self._now, now)
            revived = []
            chosen = None
            for key in self._let_go_resident:
                if self.uses.count(key) > self._let_go[key][0]:
                    revived.append(key)
                elif evictable(key):
                    chosen = key
                    break
            for key in revived:
                if self._still_let_go(key, now) and chosen is None and evictable(key):
                    chosen = key
            return chosen if chosen is not None else self._victim(evictable, incoming, now)

    def _forget(self, key: bytes) -> None:
        n = self._sizes.pop(key, None)
        if n is not None:
            self._used -= n
        self._let_go_resident.pop(key, None)

    # ------------------------------------------------------------------ the policy proper

    def _admit(self, key: bytes, nbytes: int, now: float) -> bool:
        return True

    @abc.abstractmethod
    def _insert(self, key: bytes, nbytes: int, now: float) -> None: ...

    @abc.abstractmethod
    def _access(self, key: bytes, now: float) -> None: ...

    @abc.abstractmethod
    def _remove(self, key: bytes) -> None: ...

    def _evicted(self, key: bytes) -> None:
        self._remove(key)

    @abc.abstractmethod
    def _victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None, now: float) -> bytes: ...

    def victim_reason(self, key: bytes, now: float) -> str:
        """Why :meth:`_victim` chose ``key``, in words (for eviction records)."""
        return f"{self.name} eviction order"

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make ``cls`` selectable by ``cls.name`` in the config."""
    if cls.name in POLICIES:
        raise ValueError(f"eviction policy {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, capacity_bytes: int, params: Mapping[str, Any] | None = None,
                tier_name: str = "") -> EvictionPolicy:
    """Build the policy registered as ``name`` for a tier called ``tier_name``.

    Raises ConfigError for an unknown name or parameter."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    policy = cls(capacity_bytes, **dict(params or {}))
    policy.tier_name = tier_name
    return policy
