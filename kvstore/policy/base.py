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

Subclasses register with :func:`register` and are built from config by
:func:`make_policy`, never by an if/elif chain on names.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping

from ..errors import ConfigError, KVStoreError


class NoVictim(KVStoreError):
    """Every resident block is pinned or otherwise not evictable."""


class EvictionPolicy(abc.ABC):
    """Orders one tier's resident blocks for eviction.

    Args:
        capacity_bytes: the tier's capacity (policies with size-dependent parameters,
            such as ARC's target or S3-FIFO's small queue, derive them from it).
        **params: policy parameters from the TOML config (``[policy] params``).
            Unknown parameters raise ConfigError.
    """

    name: ClassVar[str]
    params_doc: ClassVar[Mapping[str, str]] = {}

    def __init__(self, capacity_bytes: int, **params: Any):
        if params:
            known = ", ".join(sorted(self.params_doc)) or "none"
            raise ConfigError(f"policy {self.name!r}: unknown parameter(s) {sorted(params)} (known: {known})")
        self.capacity_bytes = int(capacity_bytes)

    def admit(self, key: bytes, nbytes: int, now: float) -> bool:
        """Whether a new block may enter this tier at all. Default: always."""
        return True

    @abc.abstractmethod
    def insert(self, key: bytes, nbytes: int, now: float) -> None:
        """``key`` (``nbytes`` bytes) became resident in this tier."""

    @abc.abstractmethod
    def access(self, key: bytes, now: float) -> None:
        """A hit on resident ``key``."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None:
        """``key`` left the tier for a reason other than pressure. No-op if unknown."""

    def evicted(self, key: bytes) -> None:
        """``key`` (returned by :meth:`victim`) was moved out because of pressure."""
        self.remove(key)

    @abc.abstractmethod
    def victim(self, evictable: Callable[[bytes], bool], incoming: bytes | None = None,
               now: float = 0.0) -> bytes:
        """The resident block to evict next.

        Args:
            evictable: False for blocks that must stay (pinned, being written).
            incoming: the key that needs the room, when known (ARC uses it).
            now: current time in seconds.
        Raises:
            NoVictim: no resident block is evictable.
        """

    @abc.abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make ``cls`` selectable by ``cls.name`` in the config."""
    if cls.name in POLICIES:
        raise ValueError(f"eviction policy {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, capacity_bytes: int, params: Mapping[str, Any] | None = None) -> EvictionPolicy:
    """Build the policy registered as ``name``. Raises ConfigError for an unknown name/param."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    return cls(capacity_bytes, **dict(params or {}))
