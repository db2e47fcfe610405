"""The step plan the scheduler half of the vLLM connector ships to the worker half.

The scheduler half (:mod:`engine_adapter.vllm.scheduler`) builds one :class:`StepPlan` per
engine step; vLLM pickles it, inside the connector's metadata, to every worker process,
whose worker half (:mod:`engine_adapter.vllm.worker`) carries it out. Neither half
imports the other: both speak these two types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore.common.types import BlockMeta


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request moving between vLLM's paged cache and the store.

    Attributes:
        req_id: vLLM request id.
        keys: 32-byte store keys, one per block, in prefix order.
        block_ids: vLLM cache block ids (KV cache group 0), one per key.
        engine_hashes: saves only: vLLM's own hash of each block (``request.block_hashes``),
            one per key, or empty when vLLM's hashes are not per block.
        parent_hash: saves only: vLLM's hash of the block before ``keys[0]`` (empty: the
            request's first block, or no hashes).
        token_ids: saves only: the blocks' token ids, little-endian uint32 (4 bytes per
            token, ``block_size`` tokens per block), or empty.
        lora_name: the request's LoRA adapter, if any.

    The save fields are what the daemon's KV events announce the blocks under
    (:meth:`block_meta`), so a router that indexes vLLM's own events matches them.
    """

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    engine_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes = b""
    token_ids: bytes = b""
    lora_name: str = ""

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} blocks")
        if self.engine_hashes and len(self.engine_hashes) != len(self.keys):
            raise ValueError(f"{len(self.engine_hashes)} engine hashes for {len(self.keys)} blocks")
        if self.token_ids and len(self.token_ids) % (4 * max(1, len(self.keys))):
            raise ValueError(f"{len(self.token_ids)} bytes of token ids do not split into {len(self.keys)} blocks")

    def block_meta(self) -> list[BlockMeta] | None:
        """One :class:`~kvstore.common.types.BlockMeta` per block (its vLLM hash, the hash of
        the block before it, its token ids), or None when the plan carries none."""
        if not self.engine_hashes and not self.token_ids:
            return None
        n = len(self.keys)
        tokens = np.frombuffer(self.token_ids, dtype="<u4")
        per = len(tokens) // n if n else 0
        hashes = self.engine_hashes
        return [BlockMeta(engine_hash=hashes[i] if hashes else b"",
                          parent_engine_hash=(hashes[i - 1] if i else self.parent_hash) if hashes else b"",
                          token_ids=tuple(tokens[i * per:(i + 1) * per].tolist()), block_tokens=per,
                          lora_name=self.lora_name)
                for i in range(n)]


@dataclass
class StepPlan:
    """What the workers load before and store after one engine step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
