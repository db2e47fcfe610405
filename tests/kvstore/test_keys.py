import hashlib
import os
import subprocess
import sys
import pathlib

import pytest

from kvstore.keys import (KEY_BYTES, BlockKeyer, Namespace, chain_key, encode_extra, explain_miss,
                          validate_key)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ns(**kw):
    base = dict(model="tiny", dtype="float32", layout="layer.kv.head.token.dim/v1", block_tokens=4)
    base.update(kw)
    return Namespace(**base)


def test_keys_cover_full_blocks_only():
    keys = BlockKeyer(ns()).keys(list(range(11)))
    assert len(keys) == 2
    assert all(len(k) == KEY_BYTES for k in keys)


def test_chain_matches_definition():
    n = ns()
    root = hashlib.sha256(b"kvstore.namespace.v1")
    k = BlockKeyer(n).keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert k[0] == chain_key(n.fingerprint(), [1, 2, 3, 4])
    assert k[1] == chain_key(k[0], [5, 6, 7, 8])
    assert n.fingerprint() != root.digest()


def test_prefix_property_and_divergence():
    keyer = BlockKeyer(ns())
    a = keyer.keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = keyer.keys([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0]
    assert a[1] != b[1]
    # the chain carries the difference forward even though block 3 is equal
    assert a[2] != b[2]


@pytest.mark.parametrize("field,value", [("model", "other"), ("dtype", "bfloat16"), ("layout", "x"),
                                         ("block_tokens", 8), ("tenant", "acme")])
def test_namespace_fields_change_keys(field, value):
    tokens = list(range(16))
    assert BlockKeyer(ns()).keys(tokens)[0] != BlockKeyer(ns(**{field: value})).keys(tokens)[0]


def test_extra_keys_are_tagged():
    tokens = [1, 2, 3, 4]
    keyer = BlockKeyer(ns())
    assert keyer.keys(tokens, {"lora": "x"}) != keyer.keys(tokens, {"salt": "x"})
    assert keyer.keys(tokens, {"lora": "x"}) != keyer.keys(tokens)
    assert keyer.keys(tokens, {"n": 1}) != keyer.keys(tokens, {"n": "1"})
    assert keyer.keys(tokens, {"n": True}) != keyer.keys(tokens, {"n": 1})
    assert encode_extra({"a": 1, "b": 2}) == encode_extra({"b": 2, "a": 1})


def test_per_block_extra_list():
    keyer = BlockKeyer(ns())
    k = keyer.keys(list(range(8)), [None, {"image": b"\x01"}])
    assert k[0] == keyer.keys(list(range(8)))[0]
    assert k[1] != keyer.keys(list(range(8)))[1]
    with pytest.raises(ValueError):
        keyer.keys(list(range(8)), [None])


def test_bad_tokens_and_keys_rejected():
    with pytest.raises(ValueError):
        BlockKeyer(ns()).keys([-1, 2, 3, 4])
    with pytest.raises(ValueError):
        validate_key(b"short")
    with pytest.raises(ValueError):
        Namespace("m", "d", "l", block_tokens=0)


def test_stable_across_processes_and_hash_seeds():
    code = ("from kvstore.keys import *; "
            "print(BlockKeyer(Namespace('tiny','float32','l',4,tenant='t',extra={'kv_heads':2}))"
            ".keys(list(range(12)), {'lora':'x'})[-1].hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    local = BlockKeyer(ns(layout="l", tenant="t", extra={"kv_heads": 2})).keys(list(range(12)), {"lora": "x"})[-1].hex()
    assert outs == {local}


def test_explain_miss():
    a, b = BlockKeyer(ns()), BlockKeyer(ns(tenant="x"))
    assert "tenant" in explain_miss(a, [1] * 8, b, [1] * 8)
    assert "token 5" in explain_miss(a, list(range(8)), a, [0, 1, 2, 3, 4, 9, 6, 7])
