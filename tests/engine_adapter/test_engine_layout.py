"""The stored block layout: byte ranges of a rank's KV heads, payload round trip, namespace."""

import dataclasses

import numpy as np
import pytest
import torch

from ea_support import TINY, engine
from engine_adapter.layout import LAYOUT_ID, BlockLayout, namespace
from engine_adapter.reference.tp import shard_bounds
from kernels.reference import gather_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rank_byte_ranges_select_its_heads(dtype):
    cfg = dataclasses.replace(TINY, num_kv_heads=4)
    eng = engine(dtype=dtype)
    layout = BlockLayout.of(cfg, eng)
    torch.manual_seed(0)
    caches = [torch.randn(2, 6, 16, 4, cfg.head_dim).to(eng.torch_dtype) for _ in range(cfg.num_layers)]
    block = gather_blocks(caches, [4])[0]                       # (L, 2, H, bs, hd): all heads
    payload = layout.to_payload(block)
    assert len(payload) == layout.block_bytes == cfg.num_layers * 2 * 4 * 16 * cfg.head_dim * block.element_size()
    for tp in (1, 2, 4):
        for rank in range(tp):
            heads = shard_bounds(4, rank, tp)
            for layer in range(cfg.num_layers):
                data = b"".join(payload[o:o + n] for o, n in layout.layer_ranges(layer, heads))
                out = torch.empty((1, 2, heads[1] - heads[0], 16, cfg.head_dim), dtype=eng.torch_dtype)
                layout.copy_payload(data, out)
                assert torch.equal(out[0], block[layer, :, heads[0]:heads[1]])


def test_payload_is_little_endian_layer_kv_head_token_dim():
    layout = BlockLayout(num_layers=2, num_kv_heads=3, block_tokens=4, head_dim=5, dtype=torch.float32)
    block = torch.arange(2 * 2 * 3 * 4 * 5, dtype=torch.float32).reshape(layout.block_shape())
    arr = np.frombuffer(layout.to_payload(block), dtype="<f4")
    assert arr.tolist() == list(range(arr.size))
    # layer 1, v, head 2, token 3, dim 4 is the last element
    assert layout.layer_ranges(1, (2, 3))[1] == ((1 * 2 + 1) * 3 * 80 + 2 * 80, 80)


def test_copy_payload_rejects_wrong_size():
    layout = BlockLayout(1, 1, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="expected 128"):
        layout.copy_payload(b"\0" * 100, torch.empty(1, 2, 1, 4, 4))


def test_namespace_keeps_model_dtype_layout_block_size_but_not_tp():
    ns = namespace(TINY, engine())
    assert (ns.model, ns.dtype, ns.layout, ns.block_tokens) == ("tiny-llama-test", "float32", LAYOUT_ID, 16)
    assert dict(ns.extra) == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
    # nothing about the TP size: a TP=2 runner and a TP=1 runner compute the same keys
    assert namespace(TINY, engine(dtype="bfloat16")).fingerprint() != ns.fingerprint()
    assert namespace(TINY, engine(block_tokens=32)).fingerprint() != ns.fingerprint()
