"""A tiny cache driver for the eviction policy tests (one-byte blocks by default)."""

from __future__ import annotations

from typing import Callable, Iterable


def drive(policy, accesses: Iterable[str], capacity: int, *, size: int = 1, now: float = 0.0,
          pinned: Callable[[bytes], bool] = lambda k: False) -> list[str]:
    """Replay ``accesses`` (single-letter names) through ``policy`` like the manager
    would: a hit is ``access``; a miss evicts ``victim`` blocks until ``size`` fits, then
    ``insert``. Returns the evicted names in order."""
    evicted: list[str] = []
    used = [0]
    resident: set[bytes] = set()
    for i, name in enumerate(accesses):
        key = name.encode()
        t = now + i
        if key in resident:
            policy.access(key, t)
            continue
        if not policy.admit(key, size, t):
            continue
        while used[0] + size > capacity:
            v = policy.victim(lambda k: not pinned(k), incoming=key, now=t)
            policy.evicted(v)
            resident.discard(v)
            used[0] -= size
            evicted.append(v.decode())
        policy.insert(key, size, t)
        resident.add(key)
        used[0] += size
    return evicted

