"""TrajectoryKeyer: the keys of successive agent turns equal a fresh BlockKeyer's, while
only the blocks after the common prefix are hashed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.common.keys import BlockKeyer, Namespace
from kvstore.common.trajectory_keys import TrajectoryKeyer


def keyer(block_tokens=4):
    return BlockKeyer(Namespace("tiny", "float32", "layer.kv.head.token.dim/v1", block_tokens=block_tokens))


def test_append_turn_hashes_only_new_blocks():
    k = keyer()
    turns = TrajectoryKeyer(k)
    first = list(range(42))                       # 10 full blocks, 2 tokens over
    assert turns.keys(first) == k.keys(first)
    assert (turns.reused_blocks, turns.hashed_blocks) == (0, 10)
    second = first + list(range(100, 120))        # the partial block completes, 4 more blocks
    assert turns.keys(np.array(second)) == k.keys(second)
    assert (turns.reused_blocks, turns.hashed_blocks) == (10, 5)
    assert turns.num_blocks == 15


def test_divergence_inside_a_block_rehashes_that_block():
    k = keyer()
    turns = TrajectoryKeyer(k)
    a = list(range(40))
    turns.keys(a)
    b = list(a)
    b[21] = 999                                   # block 5, second token
    assert turns.keys(b) == k.keys(b)
    assert (turns.reused_blocks, turns.hashed_blocks) == (5, 5)


def test_shorter_prompt_and_changed_extra():
    k = keyer()
    turns = TrajectoryKeyer(k)
    a = list(range(40))
    turns.keys(a)
    assert turns.keys(a[:18]) == k.keys(a[:18])
    assert (turns.reused_blocks, turns.hashed_blocks) == (4, 0)
    assert turns.keys(a, {"lora": "x"}) == k.keys(a, {"lora": "x"})
    assert turns.reused_blocks == 0
    per_block = [{"lora": "x"}] * 6 + [{"image": b"\x01"}] + [{"lora": "x"}] * 3
    assert turns.keys(a, per_block) == k.keys(a, per_block)
    assert turns.reused_blocks == 6


def test_memory_is_bounded_and_results_stay_exact():
    k = keyer()
    turns = TrajectoryKeyer(k, max_blocks=8)
    a = list(range(100))                          # 25 blocks
    assert turns.keys(a) == k.keys(a)
    assert turns.num_blocks == 8
    b = a + list(range(7, 15))
    assert turns.keys(b) == k.keys(b)
    assert (turns.reused_blocks, turns.hashed_blocks) == (8, 19)
    assert turns.num_blocks == 8
    with pytest.raises(ValueError):
        TrajectoryKeyer(k, max_blocks=0)


def test_bad_input_keeps_the_remembered_turn():
    k = keyer()
    turns = TrajectoryKeyer(k)
    a = list(range(40))
    turns.keys(a)
    with pytest.raises(ValueError):
        turns.keys(a + [-1])
    with pytest.raises(ValueError):
        turns.keys(a, [None])
    assert turns.keys(a) == k.keys(a) and turns.reused_blocks == 10


def test_returned_list_is_the_callers():
    k = keyer()
    turns = TrajectoryKeyer(k)
    out = turns.keys(list(range(16)))
    out.clear()
    assert turns.keys(list(range(16))) == k.keys(list(range(16)))
    turns.reset()
    turns.keys(list(range(16)))
    assert turns.reused_blocks == 0


edit = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 9), max_size=30)),
    st.tuples(st.just("truncate"), st.integers(0, 80)),
    st.tuples(st.just("change"), st.integers(0, 80), st.integers(0, 9)),
    st.tuples(st.just("extra"), st.integers(0, 20), st.sampled_from([None, "a", "b"])),
)


@settings(max_examples=150, deadline=None)
@given(start=st.lists(st.integers(0, 9), max_size=60), edits=st.lists(edit, min_size=1, max_size=8),
       block_tokens=st.integers(1, 5), max_blocks=st.integers(1, 30), as_array=st.booleans())
def test_turns_equal_fresh_keys_under_random_edits(start, edits, block_tokens, max_blocks, as_array):
    """Random turns (append, truncate, a changed token, a per-block extra key changed):
    every turn's keys equal a fresh BlockKeyer's, and exactly the blocks of the common
    prefix (within the remembered bound) are reused."""
    k = keyer(block_tokens)
    turns = TrajectoryKeyer(k, max_blocks=max_blocks)
    tokens = list(start)
    extras: dict[int, str] = {}
    prev_tokens: list[int] = []
    prev_extra: list = []
    for op in edits:
        if op[0] == "append":
            tokens += op[1]
        elif op[0] == "truncate":
            tokens = tokens[:op[1]]
        elif op[0] == "change" and tokens:
            tokens[op[1] % len(tokens)] = op[2]
        elif op[0] == "extra":
            extras[op[1]] = op[2]
        n = len(tokens) // block_tokens
        per_block = [{"image": extras[i]} if extras.get(i) else None for i in range(n)]
        arg = np.array(tokens, dtype=np.int64) if as_array else tokens
        got = turns.keys(arg, per_block if extras else None)
        assert got == k.keys(tokens, per_block if extras else None)
        assert turns.reused_blocks + turns.hashed_blocks == n
        same = 0
        while (same < min(n, len(prev_extra)) and prev_extra[same] == per_block[same]
               and prev_tokens[same * block_tokens:(same + 1) * block_tokens]
               == tokens[same * block_tokens:(same + 1) * block_tokens]):
            same += 1
        assert turns.reused_blocks == same
        assert turns.num_blocks == min(n, max_blocks)
        prev_tokens, prev_extra = list(tokens), per_block[:max_blocks]
