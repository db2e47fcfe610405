"""Zero-copy puts into the shared arena: the daemon's Reserve and Commit, whichever way they come.

A same-node client reserves room for its blocks in the host arena, copies each block into
its room itself and commits them. The two calls arrive as gRPC ``Reserve`` / ``Commit``
(:mod:`kvstore.service.server`) or as RESERVE / COMMIT control frames on the client's arena
session (:mod:`kvstore.service.arena_control`); both run the checks and store calls here, so
the two ways cannot drift apart.

Guarantees: a reservation belongs to the tenant (``space``) and the session that made it, and
only they can commit or abort it; a Commit is all or none (a key not reserved, or whose
reservation ended, aborts the whole batch and raises BlockNotFound: the client puts it again
by gRPC); a key listed twice is refused before anything changes.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.common import errors
from kvstore.common.arena import SESSION_HEADER
from kvstore.common.types import BlockMeta, ReserveStatus
from kvstore.service.auth import KeySpace
from kvstore.service.validate import check_size
from kvstore.store.manager import TierManager


def reserve_blocks(m: TierManager, space: KeySpace, keys: Sequence[bytes], sizes: Sequence[int],
                   metas: Sequence[BlockMeta | None] | None, ttl_s: float,
                   session: str) -> tuple[list[int], list[ReserveStatus], str]:
    """Reserve room in the shared arena for ``keys`` (32 bytes each, checked by the caller)
    of ``sizes`` bytes, for ``ttl_s`` seconds or until ``session`` ends: per key its arena
    offset (bytes) and status, and the first refusal's detail ("" when none). ``metas``: one
    router metadata per key (or None for none).

    Raises FeatureDisabled (no shared arena, no session), InvalidRequest (counts that do
    not match, a size outside ``(0, MAX_BLOCK_BYTES]``), before anything is reserved."""
    if m.shared_tier is None:
        raise errors.FeatureDisabled("no shared host arena: zero-copy puts are off (use Put)")
    if len(sizes) != len(keys):
        raise errors.InvalidRequest(f"{len(keys)} keys but {len(sizes)} sizes")
    if metas and len(metas) != len(keys):
        raise errors.InvalidRequest(f"{len(keys)} keys but {len(metas)} block metas")
    checked = [check_size(s, f"sizes[{i}]") for i, s in enumerate(sizes)]
    if not session:
        raise errors.FeatureDisabled(f"a zero-copy put names the client's same-node session "
                                     f"({SESSION_HEADER}, handed out with the arena): map the arena "
                                     f"first, or use Put")
    offsets: list[int] = []
    statuses: list[ReserveStatus] = []
    detail = ""
    for i, (key, size) in enumerate(zip(keys, checked)):
        offset, status, why = m.reserve_shared(space.internal(key), size, space.tenant, ttl_s,
                                                metas[i] if metas else None, session)
        offsets.append(offset)
        statuses.append(status)
        if why and not detail:
            detail = f"block {key.hex()[:16]}: {why}"
    return offsets, statuses, detail


def commit_blocks(m: TierManager, space: KeySpace, keys: Sequence[bytes], session: str,
                  abort: bool) -> tuple[int, int]:
    """Commit (``abort``: drop) the open reservations of ``keys`` (32 bytes each, checked by
    the caller) made by ``session``: ``(blocks committed, bytes committed)``, ``(0, 0)`` for
    an abort. All or none: a key with no open reservation of this tenant and session aborts
    the others and raises BlockNotFound (an abort skips it). Raises InvalidRequest for a key
    listed twice, before anything changes."""
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):     # a reservation is committed once: refuse before committing any
        j = first.setdefault(k, i)
        if j != i:
            raise errors.InvalidRequest(f"keys[{i}] repeats keys[{j}]: each reservation is committed once")
    claims, missing = [], None
    for k in keys:
        try:
            claims.append(m.find_claim(space.internal(k), space.tenant, session))
        except errors.BlockNotFound as e:
            missing = missing or e
    if abort or missing is not None:    # a Commit is all or none: the client puts the batch again by gRPC
        for claim in claims:
            m.abort_put(claim)
        if not abort:
            raise missing
        return 0, 0
    m.commit_puts(claims, in_place=True)      # one put call: the cluster's write-through batched
    return len(claims), sum(c.size for c in claims)


__all__ = ["commit_blocks", "reserve_blocks"]
