"""A put into a full tier looks for a clean victim among the policy's coldest blocks only
(:data:`kvstore.store.room.CLEAN_SCAN` of them): when the clean blocks are behind many dirty
ones (hit since they were cleaned), it demotes the coldest block instead of scanning the
whole tier under the store's lock. Every put scanned all of them: a second replay of a trace
on a default daemon (111,218 host blocks, nearly all dirty) stalled at 100% CPU."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.config import from_dict
from kvstore.service.build import build_manager
from kvstore.store.room import CLEAN_SCAN

N, B = 4096, 512


def key(i: int) -> bytes:
    return hashlib.sha256(b"scan:%d" % i).digest()


@pytest.fixture
def store(tmp_path):
    m = build_manager(from_dict({"tiers": {"host": {"capacity": N * B},
                                           "nvme": {"enabled": True, "path": str(tmp_path / "nvme"),
                                                    "capacity": "64MiB"}}}))
    yield m
    m.close()


def test_a_put_behind_many_dirty_blocks_looks_at_a_bounded_number_of_them(store):
    m = store
    for i in range(N):
        assert m.put(key(i), bytes([i % 251]) * B)
    m.drain()
    out = bytearray(B)
    for i in range(N // 4):                 # the coldest blocks, the clean ones, become the most recent
        assert m.read_into(key(i), out) is not None
    policy = m.room.policies[0]
    calls: list[int] = []
    real = policy.victim

    def counting(evictable, incoming=None, now=0.0):
        n = 0

        def counted(k):
            nonlocal n
            n += 1
            return evictable(k)
        try:
            return real(counted, incoming=incoming, now=now)
        finally:
            calls.append(n)
    policy.victim = counting
    for j in range(50):
        assert m.put(key(N + j), bytes([j]) * B)
    policy.victim = real
    assert calls and max(calls) <= CLEAN_SCAN + 1, max(calls)
    for j in range(50):                     # every new block is stored whole
        assert m.read_into(key(N + j), out) is not None and bytes(out) == bytes([j]) * B
    for i in range(N):                      # and every old one is still stored, in some tier
        assert m.lookup([key(i)]).hit_blocks == 1, i
