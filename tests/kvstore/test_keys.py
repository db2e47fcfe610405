import hashlib
import subprocess
import sys
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.common.keys import (
    KEY_BYTES,
    BlockKeyer,
    Namespace,
    chain_key,
    encode_extra,
    encode_tokens,
    explain_miss,
    first_divergence,
    validate_key,
)

from support.daemon import child_env


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
    code = ("from kvstore.common.keys import *; "
            "print(BlockKeyer(Namespace('tiny','float32','l',4,tenant='t',extra={'kv_heads':2}))"
            ".keys(list(range(12)), {'lora':'x'})[-1].hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = child_env(PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    local = BlockKeyer(ns(layout="l", tenant="t", extra={"kv_heads": 2})).keys(list(range(12)), {"lora": "x"})[-1].hex()
    assert outs == {local}


def test_explain_miss():
    a, b = BlockKeyer(ns()), BlockKeyer(ns(tenant="x"))
    assert "tenant" in explain_miss(a, [1] * 8, b, [1] * 8)
    assert "token 5" in explain_miss(a, list(range(8)), a, [0, 1, 2, 3, 4, 9, 6, 7])


# ---------------------------------------------------------------- the encoding contract

GOLDEN_NS = dict(model="tiny", dtype="float32", layout="layer.kv.head.token.dim/v1", block_tokens=4,
                 tenant="t", extra={"kv_heads": 2})


def test_golden_key_values():
    """Keys are the store's contract: these values must never change (a change would
    orphan every stored block)."""
    n = Namespace(**GOLDEN_NS)
    keyer = BlockKeyer(n)
    assert n.fingerprint().hex() == "fb950b793f9d1d784a5808d1da5b17f35e1d2bfb427983f9cd5c683d013a7429"
    assert [k.hex() for k in keyer.keys(list(range(12)))] == [
        "cdde50216214406d5c980adae983ff4d2bcd82e40276dc512c0a313dc95dad32",
        "83f23973f05bf2e1da3a0d4e789101c0de4be0019a13fb5a0018c43b8b241eac",
        "3b6c9dfb6778e7c0e07cf69e09e1b25ac7226e9ac0004592d598dae9deb31f4b"]
    mixed = keyer.keys(np.arange(12, dtype=np.int64), [None, {"lora": "x", "n": 3}, {"img": b"\x00\x01", "b": True}])
    assert [k.hex() for k in mixed] == [
        "cdde50216214406d5c980adae983ff4d2bcd82e40276dc512c0a313dc95dad32",
        "41a11f4e8f814fb90c5d8f2ae8863e1b03155633c4d0c4734d2c6154f8846b4d",
        "1ff207cde19395f1e8a0259d3fe45efb03afc3fa943f194b4f8461256356dda9"]
    edge = keyer.keys([2**32 - 1, 0, 7, 65536, 5, 6, 7, 8], {"salt": "s"})
    assert [k.hex() for k in edge] == [
        "5974a3c6255877149083bd1c0905f47ab3211c6060b9400513b5e95ed2729a77",
        "faf6f25b3ba437888af26af2bcb8f6ca00b40554fc339d227f0fcfa74ae6ef53"]


def reference_keys(keyer: BlockKeyer, tokens, extra=None) -> list[bytes]:
    """The definition (module docstring of kvstore.common.keys), one block at a time."""
    bt = keyer.block_tokens
    n = len(tokens) // bt
    per_block = [extra] * n if extra is None or isinstance(extra, dict) else list(extra)
    out, parent = [], keyer.root
    for i in range(n):
        block = struct.pack(f"<{bt}I", *tokens[i * bt:(i + 1) * bt])
        h = hashlib.sha256(b"kvstore.block.v1")
        h.update(parent + struct.pack("<Q", len(block)) + block + encode_extra(per_block[i]))
        parent = h.digest()
        out.append(parent)
    return out


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=70)
extra_maps = st.none() | st.dictionaries(st.sampled_from(["lora", "image", "salt"]),
                                         st.integers(-5, 5) | st.text(max_size=3) | st.binary(max_size=3)
                                         | st.booleans(), max_size=2)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, block_tokens=st.integers(1, 9), extra=extra_maps, as_array=st.booleans())
def test_bulk_keys_equal_reference_chain(tokens, block_tokens, extra, as_array):
    keyer = BlockKeyer(ns(block_tokens=block_tokens))
    arg = np.array(tokens, dtype=np.uint64) if as_array else tokens
    assert keyer.keys(arg, extra) == reference_keys(keyer, tokens, extra)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), block_tokens=st.integers(1, 6))
def test_bulk_keys_per_block_extras_and_extend(data, block_tokens):
    keyer = BlockKeyer(ns(block_tokens=block_tokens))
    tokens = data.draw(token_lists)
    n = len(tokens) // block_tokens
    extras = data.draw(st.lists(extra_maps, min_size=n, max_size=n + 2))
    ref = reference_keys(keyer, tokens, extras[:n])
    assert keyer.keys(tokens, extras) == ref
    split = data.draw(st.integers(0, n))
    bt = block_tokens
    head = keyer.keys(tokens[:split * bt], extras[:split])
    tail = keyer.extend(head[-1] if head else None, tokens[split * bt:], extras[split:])
    assert head + tail == ref


def test_token_input_forms_and_errors():
    keyer = BlockKeyer(ns())
    want = keyer.keys(list(range(8)))
    for form in (tuple(range(8)), range(8), np.arange(8, dtype=np.int32), np.arange(8, dtype=np.uint16),
                 np.arange(16, dtype=np.int64)[::2] // 2, [np.int64(i) for i in range(8)]):
        assert keyer.keys(form) == want
    for bad in ([1.5, 2, 3, 4], [2**32, 0, 0, 0], np.array([0, 1, 2, -3]), np.array([2**32, 0, 0, 0]),
                np.zeros((2, 4), dtype=np.int64), np.zeros(4, dtype=np.float32), ["a", 1, 2, 3]):
        with pytest.raises(ValueError):
            keyer.keys(bad)
    assert keyer.keys([]) == [] and keyer.keys(np.array([])) == []
    assert encode_tokens([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3, 4], 2) is None
    assert first_divergence([1, 2, 3], [1, 2, 4], 2) == (1, 2)
    assert first_divergence([], [5], 2) is None
    assert first_divergence([7], [5], 2) == (0, 0)


def test_extend_checks_parent_and_chain_ignores_a_partial_block():
    keyer = BlockKeyer(ns())
    with pytest.raises(ValueError):
        keyer.extend(b"short", [1, 2, 3, 4])
    arr = np.arange(10, dtype="<u4")
    assert keyer.chain(keyer.root, arr, encode_extra(None)) == keyer.keys(list(range(10)))
