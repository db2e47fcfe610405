"""Result types shared by the client, the service and the store core.

Plain frozen dataclasses with no behaviour beyond small views, so that ``import
kvstore.client`` needs nothing of the core (manager, policies, predictor, mover).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tiers.base import TierKind

KEY_BYTES = 32
"""Length of a block key (SHA-256 digest)."""

PUBLISH_CHOICES = ("demoted", "all")
"""When a node copies its blocks into the cluster (``[tiers.remote] publish``): ``demoted``,
as they leave its last local tier; ``all``, also every put, in the background."""

_KINDS = {int(k): k for k in TierKind}


def tier_kinds(codes: bytes) -> tuple[TierKind, ...]:
    """TierKind values from one byte per block (``LookupReply.tier_codes``)."""
    return tuple(_KINDS[c] for c in codes)


@dataclass(frozen=True)
class LookupResult:
    """Longest stored prefix of a key list.

    Attributes:
        hit_blocks: number of leading keys that are stored.
        tier_codes: the fastest tier holding each hit block, one byte per block
            (``TierKind`` values); :attr:`tiers` decodes them.
    """

    hit_blocks: int
    tier_codes: bytes = b""

    @property
    def tiers(self) -> tuple[TierKind, ...]:
        """The fastest tier of each hit block (``hit_blocks`` entries)."""
        return tier_kinds(self.tier_codes)


@dataclass(frozen=True)
class GetResult:
    """One block's outcome of a get: ``found`` False is a normal miss.

    ``data`` is the block (or the requested ranges of it, concatenated) as a buffer
    (bytes, or a numpy uint8 array owned by the result); empty on a miss.
    """

    key: bytes
    found: bool
    tier: TierKind | None = None
    data: Any = b""


@dataclass(frozen=True)
class PutResult:
    """What a put did, in blocks and bytes.

    Attributes:
        stored: blocks newly stored.
        already_present: blocks stored before with the same size (idempotent re-put).
        bytes_stored: payload bytes newly stored.
        not_admitted: blocks no tier's admission policy wanted (a normal outcome).
        size_conflicts: blocks refused because the key is stored with another size.
    """

    stored: int
    already_present: int
    bytes_stored: int
    not_admitted: int = 0
    size_conflicts: int = 0


@dataclass(frozen=True)
class BlockMeta:
    """What cache-aware routers index a block by, published with its KV events.

    Attributes:
        engine_hash: the engine's own hash of the block (e.g. vLLM's block hash).
        parent_engine_hash: the engine's hash of the block before it (empty: the first).
        token_ids: the block's token ids.
        block_tokens: tokens per block.
        lora_name: the LoRA adapter, if any.
    """

    engine_hash: bytes = b""
    parent_engine_hash: bytes = b""
    token_ids: tuple[int, ...] = ()
    block_tokens: int = 0
    lora_name: str = ""


class ReserveStatus(enum.IntEnum):
    """Outcome of one key of a zero-copy Reserve (``proto/kvstore.proto`` ``ReserveStatus``)."""

    RESERVED = 0          # write the bytes at the offset, then commit
    ALREADY_PRESENT = 1   # stored with the same size: nothing to write
    NOT_ADMITTED = 2      # no tier wants it (a normal outcome)
    NO_ROOM = 3           # the arena cannot make room now: use the gRPC put
    SIZE_CONFLICT = 4     # stored with another size: refused
    BUSY = 5              # another client is writing it now


__all__ = ["BlockMeta", "ReserveStatus", "KEY_BYTES", "PUBLISH_CHOICES", "GetResult", "LookupResult", "PutResult", "TierKind", "tier_kinds"]
