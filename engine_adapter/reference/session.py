"""A synthetic multi-turn agent session (system prompt, then turns that each append a tool observation) played on a runner.

Turn ``i``'s prompt is turn ``i-1``'s prompt, the answer generated in turn ``i-1``
and a new tool observation::

    P_1 = S | u_1              P_i = P_{i-1} | o_{i-1} | u_i

(``S``: system prompt, ``o``: generated answer, ``u``: tool observation; random token
ids from a seed). Between turns the engine drops the sequence from its paged cache,
as it would while the agent waits on a tool, so every turn's prefix has to be paged
back from the store or recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine_adapter.reference.runner import Generation, Runner


@dataclass(frozen=True)
class AgentSession:
    """Shape of a synthetic session (token counts) and its seed."""

    turns: int = 6
    system_tokens: int = 96
    observation_tokens: int = 40
    answer_tokens: int = 8
    seed: int = 0

    def system_prompt(self, vocab_size: int) -> list[int]:
        rng = np.random.default_rng([self.seed, 0])
        return rng.integers(0, vocab_size, self.system_tokens).tolist()

    def observation(self, turn: int, vocab_size: int) -> list[int]:
        """Tool observation appended at ``turn`` (1-based)."""
        rng = np.random.default_rng([self.seed, turn])
        return rng.integers(0, vocab_size, self.observation_tokens).tolist()


@dataclass
class TurnRecord:
    """One turn: the run with the store and, when asked for, the recompute baseline.

    Attributes:
        turn: 1-based turn number.
        prompt: the turn's prompt (token ids).
        result: generation with page back and store.
        baseline: generation without the store (full prefill), run just before.
    """

    turn: int
    prompt: list[int]
    result: Generation
    baseline: Generation | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass
class SessionOptions:
    """How to play a session.

    Attributes:
        page_back, store: passed to :meth:`Runner.generate` for the store run.
        baseline: also run each turn without the store first (same process, same prompt).
        flush: wait for the turn's stores before the next turn (every rank).
        after_turn: called with each finished turn's record (after the flush, before
            the next turn): fault injection in tests, printing and a simulated tool
            call in the demo.
    """

    page_back: bool = True
    store: bool = True
    baseline: bool = False
    flush: bool = True
    after_turn: Callable[[TurnRecord], None] | None = None


def play_session(runner: Runner, session: AgentSession, options: SessionOptions | None = None) -> list[TurnRecord]:
    """Play every turn of ``session`` on ``runner`` (on every TP rank alike).

    Returns one :class:`TurnRecord` per turn. The next prompt is built from the
    store run's answer.
    """
    opts = options or SessionOptions()
    vocab = runner.model_cfg.vocab_size
    prompt = session.system_prompt(vocab)
    records = []
    for turn in range(1, session.turns + 1):
        prompt = prompt + session.observation(turn, vocab)
        baseline = None
        if opts.baseline:
            baseline = runner.generate(prompt, session.answer_tokens, page_back=False, store=False)
        result = runner.generate(prompt, session.answer_tokens, page_back=opts.page_back, store=opts.store)
        records.append(TurnRecord(turn, prompt, result, baseline))
        if opts.flush:
            runner.flush()
        if opts.after_turn is not None:
            opts.after_turn(records[-1])
        prompt = prompt + result.tokens
    return records
