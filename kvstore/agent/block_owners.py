"""Which session a block belongs to, and whether a session that ended may let it go.

The session table (:mod:`kvstore.agent.sessions`) names blocks per session; this module
keeps, for it:

- the **owner** of each named block: the one session that named it, or "shared" once a
  second session names it (a shared block gets no session's hints and is never let go
  by a session);
- the **uses a session explains**: a request of the session reads its stored prefix,
  the deepest block of its previous naming included, so a use of that block since the
  previous naming is a request of the session and explains one use of every block it
  named before; a block named for the first time explains one (the request the naming
  came with). At most one request is credited per naming: the deepest block may be
  read by others too (a first turn whose stored prefix is only the shared system
  prompt), and crediting all its uses would let a "finished" hint release a block
  plain traffic reads. And a block is credited only when somebody used it since the
  session last named it: an engine whose own cache holds the head of the prefix reads
  only its tail from the store, so a request of the session proves no use of the head
  (crediting it anyway let plain traffic's reads of a shared head pass for the
  session's). A session that sends a hint less often than once per request so explains
  fewer uses than it made: its blocks are kept (never more harm than no hint). Uses
  are counted by the policies
  (:class:`kvstore.policy.uses.UseLedger`, one shared by all of them);
- the **let-go decision** for an ended session's private blocks: only those used no
  more often than the session explains are let go (with that allowance, so that a later
  use by anybody else revives them, :meth:`kvstore.policy.base.EvictionPolicy.let_go`);
  a block used more often is shared with traffic the table does not see (plain
  requests reading a system prompt, another client, a session that sends no hints):
  it keeps its place in the policy's own order.

Not thread-safe on its own: the session table calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvstore.policy import AcceptsNextUse, EvictionPolicy
from kvstore.policy.uses import UseLedger

_SHARED = object()     # owner marker of a key used by two or more sessions


@dataclass
class _Named:
    """The uses of its blocks a session explains."""

    own: dict = field(default_factory=dict)     # key -> uses explained
    at: dict = field(default_factory=dict)      # key -> its uses when last named
    last: bytes | None = None                   # deepest block of the previous naming
    seen: int = 0                               # its uses then


class BlockOwners:
    """Owners of named blocks, uses explained per session, let-go decisions.

    Args:
        policies: every tier's eviction policy; they get one shared :attr:`uses`.
        max_keys: keys whose owner is remembered (the least recently named forgotten).
        own_request_s: a use this soon after an end hint, one more than the session
            explains, is its own last request (a hint sent with the request, before its
            reads and puts), not somebody else's (seconds).
    """

    def __init__(self, policies: Sequence[EvictionPolicy], max_keys: int = 4_000_000,
                 own_request_s: float = 5.0):
        self.policies = list(policies)
        self._next_use = [p for p in self.policies if isinstance(p, AcceptsNextUse)]
        self.max_keys = max_keys
        self.own_request_s = own_request_s
        self.uses = UseLedger()
        for p in self.policies:
            p.share_uses(self.uses)
        self._owner: OrderedDict[bytes, object] = OrderedDict()    # key -> sid or _SHARED
        self._named: dict[str, _Named] = {}

    def private(self, sid: str, keys: Iterable[bytes]) -> list[bytes]:
        """Those of ``keys`` that ``sid`` alone uses, in order."""
        owner = self._owner
        return [k for k in keys if owner.get(k) == sid]

    def name(self, sid: str, keys: Sequence[bytes]) -> None:
        """A hint or tool call of ``sid`` named ``keys`` (prefix order): count the uses
        it explains (module docstring)."""
        if not keys:
            return
        n = self._named.get(sid)
        if n is None:
            n = self._named[sid] = _Named()
        count = self.uses.count
        done = min(count(n.last) - n.seen, 1) if n.last is not None else 0
        own, at = n.own, n.at
        for k in keys:
            c = count(k)
            if k not in own:
                own[k] = 1
            elif done and c > at[k]:
                own[k] += 1
            at[k] = c
        n.last = keys[-1]
        n.seen = count(n.last)

    def claim(self, sid: str, keys: Iterable[bytes], now: float) -> list[bytes]:
        """Record ``sid`` as a user of ``keys``; returns those private to it. A key
        another session uses becomes shared: it is revived and its hints are cleared."""
        private, became_shared = [], []
        owner = self._owner
        for k in keys:
            o = owner.get(k)
            if o is None or o == sid:
                owner[k] = sid
                owner.move_to_end(k)
                private.append(k)
            elif o is not _SHARED:
                owner[k] = _SHARED
                became_shared.append(k)
        while len(owner) > self.max_keys:
            owner.popitem(last=False)
        if became_shared:
            for p in self.policies:
                p.revive(became_shared)
            for p in self._next_use:
                p.clear_hints(became_shared, now)
        return private

    def let_go(self, sid: str, keys: Sequence[bytes], now: float,
               apply: bool = True) -> tuple[list[bytes], list[int], int]:
        """Let go of those of ``sid``'s ``keys`` that nothing else used; the others
        lose their hints and keep their place. ``apply`` False: decide only (a hint
        not believed). Returns ``(keys let go, the uses each is allowed, kept count)``."""
        n = self._named.get(sid)
        named = n.own if n is not None else {}
        go, allowed, kept = [], [], []
        seen = n.at if n is not None else {}
        for k in keys:
            own = named.pop(k, 1)
            seen.pop(k, None)
            if self.uses.count(k) <= own:
                go.append(k)
                allowed.append(own)
            else:
                kept.append(k)
        if apply:
            for p in self.policies:
                p.let_go(go, allowed, until=now + self.own_request_s)
            self.clear_hints(kept, now)
        return go, allowed, len(kept)

    def came_back(self, sid: str, named_at: float) -> bool:
        """Whether a request of ``sid`` read its prefix after its naming at ``named_at``
        (seconds): the deepest block it named was used since, later than its own request
        (``own_request_s``). A return seen even when it sends no hint."""
        n = self._named.get(sid)
        if n is None or n.last is None or self.uses.count(n.last) <= n.seen:
            return False
        t = self.uses.last_time(n.last)
        return t is not None and t > named_at + self.own_request_s

    def used_again(self, keys: Sequence[bytes], allowed: Sequence[int]) -> bool:
        """Whether any of ``keys`` was used beyond its allowance and the session's own
        last request: somebody came back for blocks said to be done with."""
        count = self.uses.count
        return any(count(k) > a + 1 for k, a in zip(keys, allowed))

    def clear_hints(self, keys: Sequence[bytes], now: float) -> None:
        """Drop the next-use hints of ``keys`` (they fall back to the policies' order)."""
        if keys:
            for p in self._next_use:
                p.clear_hints(keys, now)

    def end(self, sid: str, keys: Iterable[bytes]) -> None:
        """``sid`` ended: forget it as the owner of ``keys`` and the uses it explained."""
        self._named.pop(sid, None)
        for k in keys:
            if self._owner.get(k) == sid:
                del self._owner[k]

    def forget(self, sid: str) -> None:
        """``sid`` is forgotten (its blocks stay owned, nothing is let go)."""
        self._named.pop(sid, None)
