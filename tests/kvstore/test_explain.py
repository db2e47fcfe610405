"""Explain-miss: two prompts, or one prompt and the store's record of evictions."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from kvstore.tools import explain_cli
from kvstore.service.explain import EvictionLog, LocalStoreView, Prompt, explain_pair, explain_prompt
from kvstore.common.keys import BlockKeyer, Namespace
from kvstore.store.manager import TierManager
from kvstore.policy import make_policy
from tiers.base import TierKind
from tiers.null import NullTier

NS = Namespace("tiny-agent", "bfloat16", "layer.kv.head.token.dim/v1", block_tokens=16)
BLOCK = 64


def tokens(text: str) -> tuple[int, ...]:
    """A byte-level tokenizer: one token per UTF-8 byte."""
    return tuple(text.encode())


def decode(ids) -> str:
    return bytes(ids).decode("utf-8", "replace")


def agent_turn(observation: dict) -> str:
    head = "SYS: you are an agent\nUSER: weather?\n"     # 37 bytes
    return head + "CALL get_weather\nTOOL: " + json.dumps(observation) + "\nASSISTANT:"


def test_tool_results_that_differ_only_in_key_order_miss_at_their_block():
    a = Prompt(tokens(agent_turn({"city": "Paris", "temp": 21, "unit": "C"})), namespace=NS)
    b = Prompt(tokens(agent_turn({"temp": 21, "city": "Paris", "unit": "C"})), namespace=NS)
    first = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert first // 16 == 3                                   # the JSON's first key lies in block 3
    r = explain_pair(a, b, window=6, decode=decode)
    assert (r.kind, r.block, r.token) == ("tokens", 3, first)
    assert r.text.startswith(f"block 3, tokens differ at token {first}")
    assert "city" in r.text and "temp" in r.text                # both windows, as text
    assert explain_pair(a, a).kind == "all_hit"


def test_namespace_extra_keys_prefix_and_keys_only():
    a = Prompt(tokens("x" * 64), namespace=NS)
    other = Namespace("tiny-agent", "float16", NS.layout, 16)
    r = explain_pair(a, Prompt(a.tokens, namespace=other))
    assert (r.kind, r.namespace_field) == ("namespace", "dtype") and "'bfloat16' vs 'float16'" in r.text
    lora = Prompt(a.tokens, namespace=NS, extra=[None, None, {"lora": "v2"}, None])
    assert explain_pair(a, lora).kind == "extra" and explain_pair(a, lora).block == 2
    longer = Prompt(tokens("x" * 96), namespace=NS)
    assert (explain_pair(a, longer).kind, explain_pair(a, longer).block) == ("prefix", 4)
    keys_a, keys_b = a.block_keys(), Prompt(tokens("x" * 40 + "y" * 24), namespace=NS).block_keys()
    r = explain_pair(Prompt(keys=tuple(keys_a)), Prompt(keys=tuple(keys_b)))
    assert (r.kind, r.block) == ("keys", 2)


def store(capacity_blocks: int = 8):
    clock = [0.0]
    log = EvictionLog(capacity=100)
    tier = NullTier(TierKind.HOST, capacity_blocks * BLOCK, name="host")
    policy = make_policy("lru", tier.capacity_bytes, tier_name="host")
    policy.listener = log
    m = TierManager([tier], [policy], clock=lambda: clock[0])
    return m, log, clock


def test_a_prompt_whose_block_5_was_evicted_names_tier_time_and_policy():
    m, log, clock = store()
    keys = BlockKeyer(NS).keys(tokens("y" * 128))               # 8 blocks
    for i, k in enumerate(keys):
        clock[0] = float(i)
        m.put(k, bytes(BLOCK))
    clock[0] = 10.0
    for i, k in enumerate(keys):
        if i != 5:
            m.get(k)                                           # block 5 is now least recently used
    clock[0] = 42.5
    m.put(b"n" * 32, bytes(BLOCK))                             # a new block needs room
    r = explain_prompt(keys, LocalStoreView(m, log))
    assert (r.kind, r.block) == ("evicted", 5)
    assert r.text.startswith("block 5 evicted from host at t=42.500 s by lru")
    assert "least recently used" in r.text
    assert r.eviction.key == keys[5]


def test_refused_never_stored_and_all_hit():
    m, log, clock = store()
    keys = BlockKeyer(NS).keys(tokens("z" * 48))
    m.put(keys[0], bytes(BLOCK))
    log.record_refusal(keys[1], 3.0)
    view = LocalStoreView(m, log)
    r = explain_prompt(keys, view)
    assert (r.kind, r.block) == ("refused", 1) and "t=3.000 s" in r.text
    assert explain_prompt([keys[0], keys[2]], view).kind == "never_stored"
    assert explain_prompt(keys[:1], view).kind == "all_hit"


def test_the_log_is_bounded():
    m, log, clock = store(capacity_blocks=2)
    log.capacity = 3
    for i in range(10):
        m.put(bytes([i]) * 32, bytes(BLOCK))
    assert log.recorded == 8 and log.forgotten == 5
    assert log.evictions(bytes([7]) * 32) and not log.evictions(bytes([0]) * 32)


def _parser():
    p = argparse.ArgumentParser(prog="kvstore")
    explain_cli.register(p.add_subparsers())
    return p


def test_cli_two_prompt_files(tmp_path, capsys):
    ns = tmp_path / "ns.json"
    ns.write_text(json.dumps({"model": NS.model, "dtype": NS.dtype, "layout": NS.layout, "block_tokens": 16}))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(list(tokens(agent_turn({"city": "Paris", "temp": 21})))))
    b.write_text(json.dumps({"tokens": list(tokens(agent_turn({"temp": 21, "city": "Paris"})))}))
    args = _parser().parse_args(["explain", str(a), str(b), "--namespace", str(ns), "--tokenizer", "bytes"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("block 3, tokens differ at token")


@pytest.mark.parametrize("content, message", [("[1, -2]", "token ids"), ('{"keys": ["zz"]}', "hex"),
                                              ("{", "not valid JSON"), ("[1, 2]", "namespace")])
def test_cli_bad_prompt_files_are_clear_errors(tmp_path, capsys, content, message):
    p = tmp_path / "p.json"
    p.write_text(content)
    args = _parser().parse_args(["explain", str(p), str(p)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "p.json" in err and message in err


def test_cli_one_prompt_asks_the_daemon(tmp_path, capsys, daemon):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"keys": [k.hex() for k in BlockKeyer(NS).keys(tokens("q" * 32))]}))
    args = _parser().parse_args(["explain", str(p), "--target", daemon.address])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("block 0 was never stored")
    args = _parser().parse_args(["explain", str(p)])
    assert args.func(args) == 2 and "--target" in capsys.readouterr().err


def test_the_daemon_explains_an_eviction_and_a_refusal(tmp_path):
    """Explain through the daemon: a block pushed out of a full host tier (no NVMe) is
    named with its tier, policy and time; a block never put is never stored."""
    import numpy as np

    from support.daemon import daemon_config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, host="1MiB", nvme=None))
    try:
        keys = BlockKeyer(NS).keys(tokens("e" * NS.block_tokens * 20))          # 20 blocks
        assert len(keys) == 20
        with KVStoreClient(d.address, timeout=30) as c:
            c.put_from(keys[:4], np.zeros((4, 128 << 10), dtype=np.uint8))
            c.put_from(keys[4:12], np.zeros((8, 128 << 10), dtype=np.uint8))   # pushes blocks 0..3 out
            r = c.explain(keys)
            assert (r.kind, r.block, r.tier, r.policy) == ("evicted", 0, "host", "lru")
            assert "block 0 evicted from host at " in r.text and "by lru" in r.text
            assert abs(r.time - time.time()) < 600
            r = c.explain(keys[4:12] + keys[12:])
            assert (r.kind, r.block) == ("never_stored", 8)
    finally:
        d.stop(0)
