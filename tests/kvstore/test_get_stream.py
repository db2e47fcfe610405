"""Serving a Get: every requested block comes back once, in order, whatever failed before it."""

from __future__ import annotations

from support.fake_tiers import MemTier

from kvstore.service.get_frames import raw_frames
from kvstore.service.get_stream import GetPlan, pieces
from kvstore.store.manager import TierManager
from kvstore.policy import make_policy
from kvstore.common.wire import decode
from tiers.base import TierKind


def K(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_a_block_failing_mid_get_never_hides_the_blocks_after_it():
    """A corrupt block gives one FAILED piece; the 300 blocks after it are all served (a
    reader that failed must not be confused with later readers that reuse its memory)."""
    tier = MemTier(TierKind.NVME, 1 << 20)
    m = TierManager([tier], [make_policy("lru", 1 << 20)])
    keys = [K(i) for i in range(302)]
    for i, k in enumerate(keys):
        m.put(k, bytes([i % 251]) * 100)
    tier.corrupt.add(keys[1])
    plan = GetPlan(m, keys, lambda k: k, None, False, 1 << 20, 1 << 20)
    got = [(p.key, p.flags) for p in pieces(plan)]
    assert [k for k, _ in got] == keys                      # one piece per block, in order
    assert [f for _, f in got].count(2) == 1 and got[1] == (keys[1], 2)      # FAILED
    assert all(f == 1 for k, f in got if k != keys[1])                       # FOUND
    tier.corrupt.clear()
    records = [r for frame in raw_frames(GetPlan(m, keys, lambda k: k, None, False, 4096, 8192))
               for r in decode(frame)]
    assert [r.key for r in records] == keys                # the corrupt copy was dropped: now a miss
    assert [r.found for r in records] == [True, False] + [True] * 300
    assert bytes(records[-1].data) == bytes([301 % 251]) * 100
