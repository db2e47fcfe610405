"""Simulated session hints derived from a trace's future, with controlled errors.

``kvstore simulate --hints MODEL`` gives every request of a Mooncake-format trace the
session hint an agent framework would send with it (:class:`SessionHint`, as if in the
request's ``kv_hints``), computed from what the trace does next:

- **conversation**: a later request whose ids start with all of this request's full
  blocks continues it (``../shared/data/README.md``: a resumed conversation repeats an
  earlier request's ids; the last, partial block changes as tokens are appended);
  conversations are the chains of such continuations (a branch stays in its
  conversation);
- **hint**: *continues*, expected back after the gap to the earliest such later
  request, or *finished* when there is none.

What the simulated framework gets wrong is the model (:class:`HintModel`):

- ``realistic[:sigma=S,wrong=P,notime]``: what a framework can know. The state is
  misjudged with probability ``P`` per request (default 0: a framework knows whether it
  will call the model again); the return time is the true gap times ``exp(N(0, S))``
  drawn per request (default ``S`` = 1.5: tool durations are log-normal with sigma
  about 1.5, so an estimate of one call is off by that much); ``notime``: continuing
  hints carry no ``expected_back_s`` (the daemon's learned gap).
- ``finish-only[:wrong=P]``: only the *finished* hints (nothing while a session
  continues), a continuing request misjudged as finished with probability ``P``.
- ``continue-only[:sigma=S,wrong=P,notime]``: only the *continues* hints.
- ``noisy:P,F`` (**an oracle, a bound, not a framework**): the state flipped with
  probability ``P``, every gap of one conversation multiplied by one factor ``F ** u``,
  ``u`` uniform in ``[-1, 1]`` drawn per conversation. It knows the *exact* time of
  the next request up to one constant factor per conversation, which the hint
  calibration's per-session correction learns back; with ``P = 0, F = 1`` it is
  Belady's next-use time. No agent framework knows that much.

A state misjudged as continuing gets a gap drawn from the trace's true gaps. Every model
takes ``source=NAME`` (the hint source the daemon's trust is kept for). A continuing
hint covers the request's full blocks (what an engine stores); a finished one also the
partial last block. Seeded: the same model and trace give the same hints. A request
whose prompt has no full block gets no hint.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.common.hint_limits import MAX_HINT_S
from kvstore.agent.sessions import SessionHint, SessionState
from kvstore.tools.trace import TRACE_BLOCK_TOKENS, Request

MODELS = ("realistic", "finish-only", "continue-only", "noisy")
MAX_SIGMA = 10.0
"""Largest return-time error sigma of a hint model (a factor e^(10 N(0,1)), beyond any use)."""


@dataclass(frozen=True)
class HintModel:
    """A simulated source of session hints (see the module docstring).

    Attributes:
        kind: one of :data:`MODELS`.
        misjudge: probability in [0, 1] that a request's state is flipped.
        sigma: log-normal return-time error per request (natural-log sd, >= 0).
        factor: the oracle's per-conversation error factor (>= 1; ``noisy`` only).
        per_conversation: ``noisy``: one factor per conversation (False: per request).
        finished: send *finished* hints.
        continues: send *continues* hints.
        times: continuing hints carry ``expected_back_s``.
        seed: the draws' seed.
        source: the hints' declared source.
    """

    kind: str = "realistic"
    misjudge: float = 0.0
    sigma: float = 1.5
    factor: float = 1.0
    per_conversation: bool = True
    finished: bool = True
    continues: bool = True
    times: bool = True
    seed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ValueError(f"hint model must be one of {', '.join(MODELS)}, got {self.kind!r}")
        if not 0.0 <= self.misjudge <= 1.0:
            raise ValueError(f"misjudged-continuation rate must be in [0, 1], got {self.misjudge}")
        if not self.factor >= 1.0 or not math.isfinite(self.factor):
            raise ValueError(f"return-time error factor must be a finite number >= 1, got {self.factor}")
        if not 0.0 <= self.sigma <= MAX_SIGMA:
            raise ValueError(f"return-time error sigma must be a number in [0, {MAX_SIGMA:g}], got {self.sigma}")

    @property
    def label(self) -> str:
        if self.kind == "noisy":
            return f"noisy:{self.misjudge:g},{self.factor:.3g}"
        parts = [f"wrong={self.misjudge:g}"] if self.misjudge else []
        if self.continues:
            parts.append(f"sigma={self.sigma:g}" if self.times else "notime")
        return self.kind + (":" + ",".join(parts) if parts else "")

    def time_error(self, rng: random.Random, conversation: int, factors: dict[int, float]) -> float:
        """The factor of one request's hinted gap (its draws come from ``rng``)."""
        if self.kind == "noisy":
            u = rng.uniform(-1.0, 1.0)
            if self.per_conversation:
                return factors.setdefault(conversation, self.factor ** u)
            return self.factor ** u
        return math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else 1.0


def NoisyHints(misjudge: float, factor: float, seed: int = 0, per_conversation: bool = True) -> HintModel:
    """The oracle ``noisy:P,F`` (a bound: see the module docstring)."""
    return HintModel("noisy", misjudge, 0.0, factor, per_conversation, seed=seed)


def _number(text: str) -> float:
    """``0.05``, ``e``, ``e^2``, ``2.5``, ``e**1.5``."""
    t = text.strip().replace("**", "^")
    m = re.fullmatch(r"e(?:\^([0-9.]+))?", t)
    if m:
        return math.e ** float(m.group(1) or 1.0)
    return float(t)


_FORMATS = ("noisy:P,F (an oracle: e.g. noisy:0.05,e), realistic[:sigma=S,wrong=P,notime], "
            "finish-only[:wrong=P], continue-only[:sigma=S,wrong=P,notime]; any with source=NAME")


def parse_hints_spec(text: str, seed: int = 0) -> HintModel:
    """Parse a hint model (module docstring). Raises ValueError naming the formats."""
    text = text.strip()
    kind, _, rest = text.partition(":")
    try:
        if kind == "noisy":
            m = re.fullmatch(r"([^,]+),(.+)", rest)
            if not m:
                raise ValueError("noisy needs P,F")
            return NoisyHints(_number(m.group(1)), _number(m.group(2)), seed)
        if kind not in MODELS:
            raise ValueError(f"unknown hint model {kind!r}")
        args: dict = {"kind": kind, "seed": seed, "finished": kind != "continue-only",
                      "continues": kind != "finish-only"}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            name, eq, value = item.partition("=")
            if name == "notime" and not eq:
                args["times"] = False
            elif name == "sigma" and eq:
                args["sigma"] = _number(value)
            elif name == "wrong" and eq:
                args["misjudge"] = _number(value)
            elif name == "source" and eq:
                args["source"] = value
            else:
                raise ValueError(f"unknown option {item!r}")
        return HintModel(**args)
    except (ValueError, OverflowError) as e:      # OverflowError: e^1000
        raise ValueError(f"bad hints spec {text!r}: {e} (formats: {_FORMATS})") from None


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


def derive(requests: Sequence[Request], times: Sequence[float], spec: HintModel,
           keys_of: Callable[[Sequence[int]], list[bytes]],
           block_tokens: int = TRACE_BLOCK_TOKENS) -> list[SessionHint | None]:
    """One hint per request (None: no full block, or a state the model does not send),
    from the future of ``requests``.

    Args:
        requests: the trace, sorted by time.
        times: each request's (virtual) arrival time in seconds.
        spec: the hint model (errors, what is sent) and seed.
        keys_of: trace block ids -> 32-byte keys (the simulator's key function).
    """
    nxt, conv = continuations(requests, block_tokens)
    rng = random.Random(spec.seed)
    gaps = [times[c] - times[i] for i, c in enumerate(nxt) if c is not None]
    factors: dict[int, float] = {}
    out: list[SessionHint | None] = []
    for j, r in enumerate(requests):
        nfull = r.input_length // block_tokens
        flip = rng.random() < spec.misjudge
        f = spec.time_error(rng, conv[j], factors)
        c = nxt[j]
        continues = (c is not None) != flip
        if nfull < 1 or not (spec.continues if continues else spec.finished):
            out.append(None)
            continue
        sid = f"conv-{conv[j]}"
        if continues:
            gap = (times[c] - times[j]) if c is not None else (rng.choice(gaps) if gaps else 60.0)
            out.append(SessionHint(sid, SessionState.CONTINUES, tuple(keys_of(r.hash_ids[:nfull])),
                                   expected_back_s=min(max(gap * f, 0.0), MAX_HINT_S) if spec.times else None, time=times[j],
                                   source=spec.source))
        else:
            out.append(SessionHint(sid, SessionState.FINISHED, tuple(keys_of(r.hash_ids)), time=times[j],
                                   source=spec.source))
    return out
