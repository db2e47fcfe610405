"""S3-FIFO (Yang et al., SOSP'23) with hand-computed queues."""

from __future__ import annotations

import pytest

from kvstore.common.errors import ConfigError
from kvstore.policy import NoVictim, make_policy

from policy_driver import drive as run_policy


def names(od) -> list[str]:
    return [k.decode() for k in od]


def test_small_main_ghost_queues_by_hand():
    # capacity 4 one-byte blocks, small queue target 2 bytes (small_ratio 0.5), ghost
    # limit 4 - 2 = 2 bytes. By hand:
    #   A B C D        S=[A B C D]
    #   A, B, B hits   freq A=1, B=2
    #   E  S >= 2:     A (freq 1) -> M, B -> M, C (freq 0) evicted -> G=[C];  S=[D E] M=[A B]
    #   A  hit         freq A=1
    #   F  S >= 2:     D evicted -> G=[C D];  S=[E F]
    #   D  S >= 2:     E evicted -> G=[C D E] -> trimmed to 2 bytes: G=[D E];
    #                  D is a ghost -> inserted into M=[A B D];  G=[E]; S=[F]
    #   G  S=1 < 2:    evict from M: A freq 1 -> reinserted with freq 0: M=[B D A];
    #                  B freq 0 evicted (main victims leave no ghost);  S=[F G]
    p = make_policy("s3fifo", 4, {"small_ratio": 0.5})
    evicted = run_policy(p, "ABCDABBEAFDG", capacity=4)
    assert evicted == ["C", "D", "E", "B"]
    assert names(p.small) == ["F", "G"]
    assert names(p.main) == ["D", "A"]
    assert names(p.ghost) == ["E"]
    assert p.freq[b"A"] == 0


def test_frequency_is_capped_at_three():
    p = make_policy("s3fifo", 10)
    p.insert(b"A", 1, 0.0)
    for _ in range(10):
        p.access(b"A", 0.0)
    assert p.freq[b"A"] == 3


def test_one_hit_wonders_leave_through_the_small_queue():
    # a hot block hit often survives a scan of one-time blocks
    p = make_policy("s3fifo", 10)
    seq = ["H"]
    for i in range(50):
        seq += ["H", chr(0x100 + i)]
    evicted = run_policy(p, seq, capacity=10)
    assert "H" not in evicted
    assert b"H" in p.main


def test_pinned_blocks_are_rotated_not_evicted():
    p = make_policy("s3fifo", 4)
    for k in (b"A", b"B"):
        p.insert(k, 1, 0.0)
    assert p.victim(lambda k: k != b"A") == b"B"
    with pytest.raises(NoVictim):
        p.victim(lambda k: False)


@pytest.mark.parametrize("params", [{"small_ratio": 1.5}, {"small_ratio": "x"},
                                    {"move_to_main_threshold": 0}, {"nope": 1}])
def test_bad_parameters_are_config_errors(params):
    with pytest.raises(ConfigError):
        make_policy("s3fifo", 4, params)
