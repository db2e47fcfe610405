"""``EvictionPolicy.access_all`` (the hits of a lease or a block-table read, under one lock)
leaves every policy exactly as the same hits made one by one with ``access`` do: the same
victims in the same order, the same use counts, the same let-go blocks taken back."""

from __future__ import annotations

import random

import pytest

from kvstore.policy import POLICIES, make_policy
from kvstore.policy.uses import UseLedger

BLOCK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(4, "big").ljust(32, b"k")


def drained(policy) -> list[bytes]:
    """Every resident block, in the order the policy evicts them."""
    out = []
    while True:
        try:
            k = policy.victim(lambda k: True, now=1e6)
        except Exception:                               # NoVictim: empty
            return out
        policy.evicted(k)
        out.append(k)


@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "opt"))
def test_access_all_is_access_one_by_one(name):
    rng = random.Random(7)
    pair = [make_policy(name, 64 * BLOCK) for _ in range(2)]
    for p in pair:                                      # the same ledger state to start from
        p.uses = UseLedger()
    now = 0.0
    for step in range(400):
        now += rng.choice([0.0, 0.5, 1.0])
        op = rng.random()
        if op < 0.4:
            k = key(rng.randrange(96))
            for p in pair:
                if p.admit(k, BLOCK, now):
                    p.insert(k, BLOCK, now)
        elif op < 0.9:
            hits = [key(rng.randrange(96)) for _ in range(rng.randrange(1, 20))]
            resident = [k for k in hits if k in pair[0]._sizes]
            for k in resident:
                pair[0].access(k, now)
            pair[1].access_all(resident, now)
        else:
            gone = [key(rng.randrange(96)) for _ in range(3)]
            for p in pair:
                p.let_go(gone)
        while sum(p._used > p.capacity_bytes for p in pair):
            for p in pair:
                p.evicted(p.victim(lambda k: True, now=now))
    counts = [[p.uses.count(key(i)) for i in range(96)] for p in pair]
    assert counts[0] == counts[1] and sum(counts[0]) > 0
    assert drained(pair[0]) == drained(pair[1])
