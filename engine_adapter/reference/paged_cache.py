"""A TP rank's paged KV cache (vLLM's layout) and the block table of each sequence.

One tensor per layer, ``(2, num_blocks, block_tokens, kv_heads, head_dim)``
(``[k|v][block][token][head][dim]``, vLLM's "NHD" order), where ``kv_heads`` is
this rank's share of the KV heads. Token ``p`` of a sequence lives in cache block
``block_table[p // block_tokens]`` at row ``p % block_tokens``::

    sequence tokens  | 0 .. 15 | 16 .. 31 | 32 .. 40      |
    block_table      |   7     |   2      |   9           |   (block_tokens = 16)
    cache block 9    | rows 0..8 written, rows 9..15 free  |

Blocks come from a free list (:class:`BlockAllocator`); a sequence returns its blocks
when it is released, tail first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


class CacheFull(RuntimeError):
    """The paged cache has fewer free blocks than a sequence needs."""


class BlockAllocator:
    """Free list of cache block ids; O(1) allocate and free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free block ids. Raises CacheFull when fewer are free."""
        if not self.can_allocate(n):
            raise CacheFull(f"need {n} KV cache blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)


@dataclass
class Sequence:
    """One request's state on one TP rank.

    Attributes:
        tokens: every token id fed so far (prompt, then each decoded token once fed).
        block_table: cache block ids, one per ``block_tokens`` tokens.
        num_computed: tokens whose KV is in the cache (positions ``[0, num_computed)``).
        keys: chained store keys of the full blocks of ``tokens`` computed so far.
        num_stored_blocks: leading full blocks known to be in the store (paged back
            or submitted for storing); later full blocks are stored when computed.
        store_blocks: store this sequence's new full blocks (False for a recompute
            baseline that must leave the store untouched).
    """

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    keys: list[bytes] = field(default_factory=list)
    num_stored_blocks: int = 0
    store_blocks: bool = True


class PagedKVCache:
    """Per-layer paged KV tensors of one TP rank, plus the block allocator.

    Args:
        num_layers, num_blocks, block_tokens, kv_heads (this rank's), head_dim: sizes.
        dtype: KV dtype.
        device: torch device of the cache.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self._storage = torch.zeros((num_layers, 2, num_blocks, block_tokens, kv_heads, head_dim),
                                    dtype=dtype, device=device)
        self.device = self._storage.device
        self.layers: list[torch.Tensor] = list(self._storage.unbind(0))
        self.allocator = BlockAllocator(num_blocks)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on this rank, all layers."""
        s = self._storage
        return s.numel() // (self.num_blocks * self.block_tokens) * s.element_size()

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens. Raises CacheFull."""
        need = -(-num_tokens // self.block_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks to the free list (tail first) and empty its table."""
        self.allocator.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_computed = 0

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Flat slot index ``block * block_tokens + row`` of positions ``[start, end)``, int64."""
        pos = torch.arange(start, end, device=self.device)
        table = torch.as_tensor(seq.block_table, dtype=torch.long, device=self.device)
        return table[pos // self.block_tokens] * self.block_tokens + pos % self.block_tokens

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` of shape ``(n, kv_heads, head_dim)`` at flat ``slots`` ``(n,)``."""
        flat = self.layers[layer].view(2, self.num_blocks * self.block_tokens, self.kv_heads, self.head_dim)
        flat[0, slots] = k
        flat[1, slots] = v

    def context(self, layer: int, seq: Sequence, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, num_tokens)``, each ``(num_tokens, kv_heads, head_dim)``."""
        nblocks = -(-num_tokens // self.block_tokens)
        table = torch.as_tensor(seq.block_table[:nblocks], dtype=torch.long, device=self.device)
        kv = self.layers[layer].index_select(1, table)       # (2, nblocks, bs, H, hd)
        kv = kv.reshape(2, nblocks * self.block_tokens, self.kv_heads, self.head_dim)[:, :num_tokens]
        return kv[0], kv[1]
