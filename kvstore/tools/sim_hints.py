"""Simulated session hints derived from a trace's future, with controlled errors.

``kvstore simulate --hints noisy:P,F`` gives every request of a Mooncake-format trace
the session hint an agent framework would send with it (:class:`SessionHint`, as if
in the request's ``kv_hints``), computed from what the trace does next:

- **conversation**: a later request whose ids start with all of this request's full
  blocks continues it (``../shared/data/README.md``: a resumed conversation repeats an
  earlier request's ids; the last, partial block changes as tokens are appended);
  conversations are the chains of such continuations (a branch stays in its
  conversation);
- **hint**: *continues*, expected back after the gap to the earliest such later
  request, or *finished* when there is none;
- **misjudged continuation**: with probability ``P`` per request (independently) the
  state is flipped: a continuing request is said to be finished, a finished one to
  continue, with a gap drawn from the trace's true gaps;
- **return-time error**: every gap of one conversation is multiplied by one factor
  ``F ** u``, ``u`` uniform in ``[-1, 1]`` drawn per conversation: the hinted time is
  within a factor ``F`` of the truth (log-uniform), the same way for all its turns.

A continuing hint covers the request's full blocks (what an engine stores); a finished
one also covers the partial last block. Seeded: the same spec and trace give the same
hints. A request whose prompt has no full block gets no hint.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.agent.sessions import SessionHint, SessionState
from kvstore.tools.trace import TRACE_BLOCK_TOKENS, Request


@dataclass(frozen=True)
class NoisyHints:
    """``noisy:P,F``: misjudged-continuation rate ``misjudge`` in [0, 1] and return-time
    error factor ``factor`` >= 1 (per conversation, or per request with
    ``per_conversation`` false); ``seed`` for the draws."""

    misjudge: float
    factor: float
    seed: int = 0
    per_conversation: bool = True    # False: a fresh error factor for every request

    def __post_init__(self) -> None:
        if not 0.0 <= self.misjudge <= 1.0:
            raise ValueError(f"misjudged-continuation rate must be in [0, 1], got {self.misjudge}")
        if not self.factor >= 1.0 or not math.isfinite(self.factor):
            raise ValueError(f"return-time error factor must be a finite number >= 1, got {self.factor}")

    @property
    def label(self) -> str:
        return f"noisy:{self.misjudge:g},{self.factor:.3g}"


def _number(text: str) -> float:
    """``0.05``, ``e``, ``e^2``, ``2.5``, ``e**1.5``."""
    t = text.strip().replace("**", "^")
    m = re.fullmatch(r"e(?:\^([0-9.]+))?", t)
    if m:
        return math.e ** float(m.group(1) or 1.0)
    return float(t)


def parse_hints_spec(text: str, seed: int = 0) -> NoisyHints:
    """Parse ``noisy:P,F`` (F may be ``e``, ``e^2``...). Raises ValueError with the format."""
    m = re.fullmatch(r"noisy:([^,]+),(.+)", text.strip())
    if not m:
        raise ValueError(f"hints must look like noisy:P,F (e.g. noisy:0.05,e), got {text!r}")
    try:
        return NoisyHints(_number(m.group(1)), _number(m.group(2)), seed)
    except ValueError as e:
        raise ValueError(f"bad hints spec {text!r}: {e}") from None


def continuations(requests: Sequence[Request], block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple[list[int | None], list[int]]:
    """For each request, the index of the earliest later request that continues it
    (None: none), and its conversation number (index of the conversation's first request).

    A request continues another when its ids start with all of the other's full blocks;
    it joins that one's conversation when the match spans two blocks or more (a single
    shared first block, like the Mooncake trace's system prompt, links no conversations).

    Cost: O(total ids) dict work.
    """
    n = len(requests)
    nxt: list[int | None] = [None] * n
    conv = list(range(n))
    waiting: dict[tuple[int, ...], list[int]] = {}     # full-block prefix -> requests not yet continued
    for j, r in enumerate(requests):
        ids = r.hash_ids
        joined = False
        for k in range(len(ids), 0, -1):
            lst = waiting.pop(tuple(ids[:k]), None)
            if lst is None:
                continue
            for i in lst:
                nxt[i] = j
            if not joined and k >= 2:      # the longest match names the conversation
                conv[j] = conv[lst[-1]]
                joined = True
        nfull = r.input_length // block_tokens
        if nfull >= 1:
            waiting.setdefault(tuple(ids[:nfull]), []).append(j)
    return nxt, conv


def derive(requests: Sequence[Request], times: Sequence[float], spec: NoisyHints,
           keys_of: Callable[[Sequence[int]], list[bytes]],
           block_tokens: int = TRACE_BLOCK_TOKENS) -> list[SessionHint | None]:
    """One hint per request (None: no full block), from the future of ``requests``.

    Args:
        requests: the trace, sorted by time.
        times: each request's (virtual) arrival time in seconds.
        spec: error rates and seed.
        keys_of: trace block ids -> 32-byte keys (the simulator's key function).
    """
    nxt, conv = continuations(requests, block_tokens)
    rng = random.Random(spec.seed)
    gaps = [times[c] - times[i] for i, c in enumerate(nxt) if c is not None]
    factor: dict[int, float] = {}
    out: list[SessionHint | None] = []
    for j, r in enumerate(requests):
        nfull = r.input_length // block_tokens
        flip = rng.random() < spec.misjudge
        u = rng.uniform(-1.0, 1.0)
        f = factor.setdefault(conv[j], spec.factor ** u) if spec.per_conversation else spec.factor ** u
        if nfull < 1:
            out.append(None)
            continue
        c = nxt[j]
        sid = f"conv-{conv[j]}"
        continues = (c is not None) != flip
        if continues:
            gap = (times[c] - times[j]) if c is not None else (rng.choice(gaps) if gaps else 60.0)
            out.append(SessionHint(sid, SessionState.CONTINUES, tuple(keys_of(r.hash_ids[:nfull])),
                                   expected_back_s=max(gap * f, 0.0), time=times[j]))
        else:
            out.append(SessionHint(sid, SessionState.FINISHED, tuple(keys_of(r.hash_ids)), time=times[j]))
    return out
