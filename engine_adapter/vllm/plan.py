"""The step plan the scheduler half of the vLLM connector ships to the worker half.

The scheduler half (:mod:`engine_adapter.vllm.scheduler`) builds one :class:`StepPlan` per
engine step; vLLM pickles it, inside the connector's metadata, to every worker process,
whose worker half (:mod:`engine_adapter.vllm.worker`) carries it out. Neither half
imports the other: both speak these two types.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request moving between vLLM's paged cache and the store.

    Attributes:
        req_id: vLLM request id.
        keys: 32-byte store keys, one per block, in prefix order.
        block_ids: vLLM cache block ids (KV cache group 0), one per key.
    """

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} blocks")


@dataclass
class StepPlan:
    """What the workers load before and store after one engine step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
