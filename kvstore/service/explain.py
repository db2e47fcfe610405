"""Explain a prefix miss: which block is the first to miss, and why.

Two ways to ask:

- **two prompts** (:func:`explain_pair`): the prompt that was stored and the one that
  missed, each as token ids (with their :class:`~kvstore.common.keys.Namespace`) or as block
  keys. The answer names the first block whose key differs and why: a namespace field
  differs (which), the tokens differ at token N (with a short window of both), the
  per-block extra keys differ, or only keys were given;
- **one prompt and the store's state** (:func:`explain_prompt`, against a
  :class:`StoreView`): the first block not stored, and what the store knows of it:
  evicted (when, from which tier, by which policy, why), refused at admission, or never
  stored (as far as the bounded record reaches).

The store's side is an :class:`EvictionLog`: a bounded record of recent evictions (one
:class:`~kvstore.policy.EvictionEvent` per block and tier; every policy can report to
it as its ``listener``) and admission refusals. The daemon keeps one and answers an
Explain RPC with :func:`explain_prompt` over :class:`LocalStoreView`; ``kvstore
explain`` (:mod:`kvstore.tools.explain_cli`) prints the answer.
"""

from __future__ import annotations

import datetime
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from kvstore.common.keys import BlockKeyer, Namespace
from kvstore.policy import EvictionEvent


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids in a namespace, or block keys (32 bytes each).

    ``extra``: per-block extra keys as for :meth:`BlockKeyer.keys` (one mapping for all
    blocks, or one per block)."""

    tokens: tuple[int, ...] | None = None
    keys: tuple[bytes, ...] | None = None
    namespace: Namespace | None = None
    extra: object = None

    def block_keys(self) -> list[bytes]:
        """The prompt's block keys (computed from the tokens when not given).
        Raises ValueError without keys or tokens and a namespace."""
        if self.keys is not None:
            return list(self.keys)
        if self.tokens is None or self.namespace is None:
            raise ValueError("a prompt needs block keys, or token ids and a namespace")
        return list(BlockKeyer(self.namespace).keys(list(self.tokens), self.extra))


@dataclass(frozen=True)
class Explanation:
    """Why a prompt misses.

    Attributes:
        kind: ``all_hit``, ``prefix`` (one prompt extends the other), ``namespace``,
            ``tokens``, ``extra``, ``keys``, ``evicted``, ``refused``, ``never_stored``.
        block: index of the first block that misses (None for ``all_hit`` and when the
            namespaces differ, as every block differs then).
        text: the answer in one or two sentences.
        token: first differing token (index into the prompt), for ``tokens``.
        window_a, window_b: a few token ids of each prompt around ``token``.
        namespace_field: the namespace field that differs, for ``namespace``.
        eviction: the eviction that removed the block, for ``evicted``.
        earlier: earlier evictions of the block from faster tiers (demotions).
    """

    kind: str
    block: int | None
    text: str
    token: int | None = None
    window_a: tuple[int, ...] = ()
    window_b: tuple[int, ...] = ()
    namespace_field: str | None = None
    eviction: EvictionEvent | None = None
    earlier: tuple[EvictionEvent, ...] = ()


def _namespace_diff(a: Namespace, b: Namespace) -> tuple[str, str] | None:
    for name in ("model", "dtype", "layout", "block_tokens", "tenant"):
        va, vb = getattr(a, name), getattr(b, name)
        if va != vb:
            return name, f"{va!r} vs {vb!r}"
    ea, eb = dict(a.extra), dict(b.extra)
    if ea != eb:
        changed = sorted(k for k in set(ea) | set(eb) if ea.get(k, ...) != eb.get(k, ...))
        return f"extra.{changed[0]}", ", ".join(f"{k}: {ea.get(k, '(absent)')!r} vs {eb.get(k, '(absent)')!r}"
                                              for k in changed)
    return None


def _show(tokens: Sequence[int], decode: Callable[[Sequence[int]], str] | None) -> str:
    return repr(decode(tokens)) if decode is not None else str(list(tokens))


def explain_pair(a: Prompt, b: Prompt, *, window: int = 8,
                 decode: Callable[[Sequence[int]], str] | None = None) -> Explanation:
    """Why prompt ``b`` misses blocks stored for prompt ``a`` (or the reverse: the
    comparison is symmetric).

    Args:
        a, b: the two prompts. With tokens, both need a namespace.
        window: tokens shown on each side of the first difference.
        decode: token ids -> text, to show the windows as text (e.g. a tokenizer's decode).
    Raises:
        ValueError: a prompt with neither keys nor tokens and a namespace.
    """
    if a.namespace is not None and b.namespace is not None:
        diff = _namespace_diff(a.namespace, b.namespace)
        if diff is not None:
            return Explanation("namespace", None, f"namespace field {diff[0]!r} differs ({diff[1]}): "
                               f"every block key differs from block 0", namespace_field=diff[0])
    ka, kb = a.block_keys(), b.block_keys()
    n = min(len(ka), len(kb))
    first = next((i for i in range(n) if ka[i] != kb[i]), None)
    if first is None:
        if len(ka) == len(kb):
            return Explanation("all_hit", None, f"all {n} full blocks are the same: no miss")
        return Explanation("prefix", n, f"the first {n} full blocks are the same; block {n} exists in only "
                                        f"one prompt (the other ends there)")
    if a.tokens is None or b.tokens is None:
        return Explanation("keys", first, f"block {first}: the keys differ (give token ids and the "
                                          f"namespace to see where the tokens differ)")
    bt = (a.namespace or b.namespace).block_tokens
    ta, tb = a.tokens, b.tokens
    lo, hi = first * bt, (first + 1) * bt
    tok = next((i for i in range(lo, min(hi, len(ta), len(tb))) if ta[i] != tb[i]), None)
    if tok is None:
        return Explanation("extra", first, f"block {first}: same tokens, but its extra keys (LoRA, "
                                           f"multimodal hash, salt) differ")
    s, e = max(tok - window, 0), tok + window
    wa, wb = tuple(ta[s:e]), tuple(tb[s:e])
    return Explanation("tokens", first,
                       f"block {first}, tokens differ at token {tok} (position {tok - lo} in the block): "
                       f"{_show(wa, decode)} vs {_show(wb, decode)}",
                       token=tok, window_a=wa, window_b=wb)


# --------------------------------------------------------------------------- store side


class EvictionLog:
    """Bounded record of recent evictions and admission refusals, per block.

    Keeps, for up to ``capacity`` blocks (the least recently recorded forgotten first),
    the last eviction from each tier and the time of the last refusal. Call it with an
    :class:`EvictionEvent` (it is a valid policy ``listener``), or :meth:`record`.
    Thread-safe (the manager records while an Explain RPC reads).
    """

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._events: OrderedDict[bytes, dict[str, EvictionEvent]] = OrderedDict()
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        self.recorded = 0
        self.forgotten = 0
        self._lock = threading.Lock()

    def __call__(self, event: EvictionEvent) -> None:
        self.record(event)

    def record(self, event: EvictionEvent) -> None:
        """One block left one tier because of pressure."""
        with self._lock:
            per_tier = self._events.pop(event.key, None) or {}
            per_tier[event.tier] = event
            self._events[event.key] = per_tier
            self.recorded += 1
            while len(self._events) > self.capacity:
                self._events.popitem(last=False)
                self.forgotten += 1

    def record_refusal(self, key: bytes, time: float) -> None:
        """A put of ``key`` that no tier admitted (seconds)."""
        with self._lock:
            self._refused.pop(key, None)
            self._refused[key] = time
            while len(self._refused) > self.capacity:
                self._refused.popitem(last=False)

    def evictions(self, key: bytes) -> list[EvictionEvent]:
        """The recorded evictions of ``key``, oldest first (one per tier at most)."""
        with self._lock:
            return sorted((self._events.get(key) or {}).values(), key=lambda e: e.time)

    def refused_at(self, key: bytes) -> float | None:
        with self._lock:
            return self._refused.get(key)


class StoreView(Protocol):
    """What :func:`explain_prompt` needs from a store (the daemon implements it)."""

    def hit_blocks(self, keys: Sequence[bytes]) -> int:
        """Length of the longest stored prefix of ``keys``."""

    def evictions(self, key: bytes) -> Sequence[EvictionEvent]:
        """Recorded evictions of ``key``, oldest first."""

    def refused_at(self, key: bytes) -> float | None:
        """When a put of ``key`` was last refused by every tier (seconds), or None."""


class LocalStoreView:
    """A :class:`StoreView` over an in-process tier manager and its :class:`EvictionLog`."""

    def __init__(self, manager, log: EvictionLog):
        self.manager = manager
        self.log = log

    def hit_blocks(self, keys: Sequence[bytes]) -> int:
        return self.manager.lookup(keys).hit_blocks

    def evictions(self, key: bytes) -> Sequence[EvictionEvent]:
        return self.log.evictions(key)

    def refused_at(self, key: bytes) -> float | None:
        return self.log.refused_at(key)


def format_time(t: float) -> str:
    """Unix seconds as UTC ISO 8601; small (virtual) times as seconds."""
    if t > 1e9:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")
    return f"t={t:.3f} s"


def explain_prompt(keys: Sequence[bytes], view: StoreView) -> Explanation:
    """The first block of ``keys`` (a prompt's block keys, in order) the store misses, and why."""
    hit = view.hit_blocks(keys)
    if hit >= len(keys):
        return Explanation("all_hit", None, f"all {len(keys)} blocks are stored: no miss")
    key = keys[hit]
    events = list(view.evictions(key))
    refused = view.refused_at(key)
    if events and (refused is None or events[-1].time >= refused):
        last = events[-1]
        text = (f"block {hit} evicted from {last.tier or 'its tier'} at {format_time(last.time)} by "
                f"{last.policy}: {last.reason}")
        if len(events) > 1:
            text += "; before that from " + ", ".join(f"{e.tier} at {format_time(e.time)} by {e.policy}"
                                                     for e in events[:-1])
        return Explanation("evicted", hit, text, eviction=last, earlier=tuple(events[:-1]))
    if refused is not None:
        return Explanation("refused", hit, f"block {hit} was refused at admission at {format_time(refused)}: "
                                           f"no tier's policy admitted it")
    return Explanation("never_stored", hit, f"block {hit} was never stored (or evicted before the "
                                            f"store's record of recent evictions)")
