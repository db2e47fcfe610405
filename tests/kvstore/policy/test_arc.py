"""ARC (Megiddo & Modha, FAST'03) with hand-computed victims, ghosts and target p."""

from __future__ import annotations

import pytest

from kvstore.policy import NoVictim, make_policy

from policy_driver import drive as run_policy


def names(od) -> list[str]:
    return [k.decode() for k in od]


def test_ghost_hits_move_p_and_pick_the_list():
    # c = 3 one-byte blocks. By hand:
    #   A B C         T1=[A B C]
    #   A (hit)       T1=[B C]  T2=[A]
    #   D  miss       |T1|=2 > p=0 -> evict LRU(T1)=B -> B1=[B];  T1=[C D]
    #   B  B1 ghost   p = 0 + 1*max(1, |B2|/|B1|) = 1; |T1|=2 > 1 -> evict C -> B1=[B C];
    #                 B enters T2=[A B], B1=[C]
    #   E  miss       |T1|=1 = p and E not in B2 -> evict LRU(T2)=A -> B2=[A]; T1=[D E]
    #   A  B2 ghost   p = max(0, 1 - 1*max(1, |B1|/|B2|)) = 0; |T1|=2 > 0 -> evict D -> B1=[C D];
    #                 A enters T2=[B A], B2=[]
    p = make_policy("arc", 3)
    evicted = run_policy(p, "ABCADBEA", capacity=3)
    assert evicted == ["B", "C", "A", "D"]
    assert names(p.t1) == ["E"]
    assert names(p.t2) == ["B", "A"]
    assert names(p.b1) == ["C", "D"]
    assert names(p.b2) == []
    assert p.p == 0.0


def test_b1_ghost_hit_grows_p():
    # c = 2: A A -> T2=[A]; B -> T1=[B]; C: |T1|=1 > p=0 -> evict B -> B1=[B], T1=[C];
    # B (B1 ghost): p = 0 + 1*max(1, 0/1) = 1; |T1|=1 = p, B not in B2 -> evict LRU(T2)=A -> B2=[A]
    p = make_policy("arc", 2)
    assert run_policy(p, "AABCB", capacity=2) == ["B", "A"]
    assert p.p == 1.0
    assert names(p.t2) == ["B"] and names(p.b2) == ["A"]


def test_ghost_directory_stays_bounded():
    p = make_policy("arc", 4)
    run_policy(p, [chr(65 + i % 20) for i in range(400)], capacity=4)
    assert p.t1_bytes + p.b1_bytes <= 4
    assert p.t1_bytes + p.t2_bytes + p.b1_bytes + p.b2_bytes <= 8


def test_pinned_blocks_are_skipped():
    p = make_policy("arc", 3)
    for k in (b"A", b"B", b"C"):
        p.insert(k, 1, 0.0)
    assert p.victim(lambda k: k != b"A", incoming=b"D") == b"B"
    with pytest.raises(NoVictim):
        p.victim(lambda k: False)


def test_remove_forgets_without_ghost():
    p = make_policy("arc", 3)
    p.insert(b"A", 1, 0.0)
    p.remove(b"A")
    assert b"A" not in p and not p.b1 and not p.b2 and p.t1_bytes == 0


def test_sizes_are_bytes():
    # two 2-byte blocks fill a 4-byte ARC; the third evicts exactly one
    p = make_policy("arc", 4)
    assert run_policy(p, "ABC", capacity=4, size=2) == ["A"]
    assert p.t1_bytes == 4
