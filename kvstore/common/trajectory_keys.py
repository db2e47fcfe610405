"""Block keys of an agent trajectory's successive prompts, reusing the previous turn's chain.

An agent turn's prompt is the previous turn's prompt plus a small delta (a model message,
a tool observation, a user message), so every block before
the first changed token has the key it had last turn. :class:`TrajectoryKeyer` remembers
a trajectory's last prompt and keys, finds the longest common prefix of the new prompt
with one vectorised comparison, and hashes only the blocks after it. The keys are those
of :meth:`kvstore.common.keys.BlockKeyer.keys`, bit for bit (the same chain, the same encoding);
only the work differs. This is the incremental per-request block hashing of vLLM's
prefix caching, carried across the turns of one trajectory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstore.common.keys import (
    BlockKey,
    BlockKeyer,
    ExtraArg,
    block_extra_codes,
    common_prefix_tokens,
    token_array,
)

DEFAULT_MAX_BLOCKS = 1 << 15
"""Blocks remembered per trajectory by default (512k tokens at 16 tokens per block)."""


def _common_codes(a: bytes | list[bytes], b: bytes | list[bytes], limit: int) -> int:
    """How many leading blocks (at most ``limit``) have equal encoded extra keys."""
    if isinstance(a, bytes) and isinstance(b, bytes):
        return limit if a == b else 0
    xs = [a] * limit if isinstance(a, bytes) else a[:limit]
    ys = [b] * limit if isinstance(b, bytes) else b[:limit]
    if xs == ys:
        return limit
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x != y:
            return i
    return limit


class TrajectoryKeyer:
    """Chained block keys of one trajectory's prompts, hashing only what changed.

    Each :meth:`keys` call compares the new prompt with the one remembered from the
    previous call and reuses the keys of the full blocks that lie inside their longest
    common prefix and whose extra keys are unchanged; the chain is then continued from
    the last reused key. A prompt that diverges inside a block rehashes that block; a
    shorter prompt reuses only its own blocks; a new extra key on block ``i`` rehashes
    from ``i`` on.

    Memory is bounded by ``max_blocks``: at most that many blocks are remembered
    (``4 * block_tokens`` bytes of token ids plus one 32-byte key, about 100 bytes with
    its Python object, per block). A longer prompt is still keyed in full; its blocks past
    the bound are hashed again on the next turn.

    Not thread-safe: keep one per trajectory and call it from one thread at a time.

    Args:
        keyer: the namespace's :class:`~kvstore.common.keys.BlockKeyer`.
        max_blocks: most blocks remembered (> 0).

    Attributes:
        reused_blocks: blocks of the last call whose keys came from the previous turn.
        hashed_blocks: blocks of the last call that were hashed.

    >>> from kvstore.common.keys import BlockKeyer, Namespace
    >>> keyer = BlockKeyer(Namespace("tiny", "float32", "layer.kv.head.token.dim/v1", block_tokens=4))
    >>> turns = TrajectoryKeyer(keyer)
    >>> _ = turns.keys(list(range(10)))
    >>> turns.keys(list(range(14))) == keyer.keys(list(range(14))), turns.reused_blocks, turns.hashed_blocks
    (True, 2, 1)
    """

    def __init__(self, keyer: BlockKeyer, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if not isinstance(max_blocks, int) or max_blocks <= 0:
            raise ValueError(f"max_blocks must be a positive int, got {max_blocks!r}")
        self.keyer = keyer
        self.max_blocks = max_blocks
        self.reused_blocks = 0
        self.hashed_blocks = 0
        self._tokens = np.empty(0, dtype="<u4")    # remembered token ids; capacity >= the blocks' tokens
        self._keys: list[BlockKey] = []
        self._codes: bytes | list[bytes] = b""

    @property
    def num_blocks(self) -> int:
        """Blocks remembered from the previous call."""
        return len(self._keys)

    def reset(self) -> None:
        """Forget the previous prompt (the next call hashes every block)."""
        self._tokens = np.empty(0, dtype="<u4")
        self._keys = []
        self._codes = b""

    def keys(self, tokens: Sequence[int] | np.ndarray, extra: ExtraArg = None) -> list[BlockKey]:
        """Keys of every full block of this turn's prompt; equal to ``keyer.keys(tokens, extra)``.

        Args:
            tokens: the whole prompt's token ids, shape ``(num_tokens,)``, ints in
                ``[0, 2**32)``; a numpy integer array is the fastest (a list costs one
                conversion of every token).
            extra: as :meth:`kvstore.common.keys.BlockKeyer.keys`.
        Returns:
            ``num_tokens // block_tokens`` keys of 32 bytes; the list is the caller's.
        Raises:
            ValueError: bad token ids or a per-block ``extra`` list of the wrong length;
                the remembered turn is then kept as it was.
        """
        arr = token_array(tokens)
        bt = self.keyer.block_tokens
        n = len(arr) // bt
        codes = block_extra_codes(extra, n)
        reuse = min(n, len(self._keys))
        if reuse:
            reuse = min(reuse, common_prefix_tokens(self._tokens[:reuse * bt], arr[:reuse * bt]) // bt)
        if reuse:
            reuse = _common_codes(self._codes, codes, reuse)
        parent = self._keys[reuse - 1] if reuse else self.keyer.root
        rest = codes if isinstance(codes, bytes) else codes[reuse:]
        out = self._keys[:reuse]
        out.extend(self.keyer.chain(parent, arr[reuse * bt:n * bt], rest))
        self._remember(arr, out, codes, reuse)
        self.reused_blocks, self.hashed_blocks = reuse, n - reuse
        return out

    def _remember(self, arr: np.ndarray, out: list[BlockKey], codes: bytes | list[bytes], reuse: int) -> None:
        bt = self.keyer.block_tokens
        keep = min(len(out), self.max_blocks)      # >= reuse: reuse <= the blocks remembered
        if len(self._tokens) < keep * bt:
            grown = np.empty(min(max(keep, 2 * len(self._tokens) // bt), self.max_blocks) * bt, dtype="<u4")
            grown[:reuse * bt] = self._tokens[:reuse * bt]
            self._tokens = grown
        self._tokens[reuse * bt:keep * bt] = arr[reuse * bt:keep * bt]
        self._keys = out[:keep]                    # a copy: the caller owns ``out``
        self._codes = codes if isinstance(codes, bytes) else codes[:keep]


__all__ = ["DEFAULT_MAX_BLOCKS", "TrajectoryKeyer"]
