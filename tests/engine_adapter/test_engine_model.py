"""The reference runner's model at TP=1 against transformers' LlamaForCausalLM (no download)."""

import dataclasses

import pytest
import torch

from ea_support import TINY, engine
from engine_adapter.reference.config import ModelConfig
from engine_adapter.reference.model import LlamaModel
from engine_adapter.reference.paged_cache import PagedKVCache, Sequence
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.tp import TPGroup
from engine_adapter.reference.weights import SafetensorsWeights, SeededWeights, load_rank_weights

transformers = pytest.importorskip("transformers")


def hf_model(cfg: ModelConfig, state_dict=None, dtype=torch.float32):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf()))
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.to(dtype).eval()


def paged_logits(model: LlamaModel, cfg: ModelConfig, tokens: torch.Tensor, cuts=(37, 45)) -> torch.Tensor:
    """Logits of every position: prefill in two chunks (crossing block edges), then decode."""
    cache = PagedKVCache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    seq = Sequence(tokens=tokens.tolist())
    cache.reserve(seq, len(tokens))
    cache.allocator.free(cache.allocator.allocate(3))  # block ids need not be 0, 1, 2, ...
    rows = [model.forward(tokens[:cuts[0]], 0, seq, cache, all_logits=True),
            model.forward(tokens[cuts[0]:cuts[1]], cuts[0], seq, cache, all_logits=True)]
    rows += [model.forward(tokens[i:i + 1], i, seq, cache)[None] for i in range(cuts[1], len(tokens))]
    return torch.cat(rows)


def test_tp1_logits_match_transformers_fp32():
    source = SeededWeights(TINY, seed=3)
    ours = LlamaModel(TINY, load_rank_weights(TINY, source, 0, 1, torch.float32), TPGroup.single())
    tokens = torch.randint(0, TINY.vocab_size, (52,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(TINY, source.state_dict())(tokens[None]).logits[0]
    got = paged_logits(ours, TINY, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_checkpoint_matches_transformers(tmp_path, tied):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied, num_kv_heads=4)  # plain MHA too
    torch.manual_seed(1)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_checkpoint(tmp_path) == cfg
    runner = Runner(cfg, engine(), TPGroup.single(), weights=SafetensorsWeights(tmp_path))
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    got = paged_logits(runner.model, cfg, tokens, cuts=(20, 33))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_close_to_transformers_bf16():
    source = SeededWeights(TINY, seed=4)
    ours = LlamaModel(TINY, load_rank_weights(TINY, source, 0, 1, torch.bfloat16), TPGroup.single())
    tokens = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf_model(TINY, source.state_dict(), torch.bfloat16)(tokens[None]).logits[0].float()
    got = paged_logits(ours, TINY, tokens, cuts=(20, 33))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=3e-2)


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="split over TP size 4"):
        TINY.check_tp(4)
    hf = TINY.to_hf()
    assert ModelConfig.from_hf(hf) == TINY
    hf["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5}
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_hf(hf)


def test_seeded_weights_do_not_depend_on_tp_size():
    source = SeededWeights(TINY, seed=0)
    full = load_rank_weights(TINY, source, 0, 1, torch.float32)
    halves = [load_rank_weights(TINY, source, r, 2, torch.float32) for r in range(2)]
    q = TINY.num_heads * TINY.head_dim // 2
    kv = TINY.num_kv_heads * TINY.head_dim // 2
    for r, half in enumerate(halves):
        qkv = half.layers[1].qkv
        assert torch.equal(qkv[:q], full.layers[1].qkv[r * q:(r + 1) * q])
        assert torch.equal(qkv[q:q + kv], full.layers[1].qkv[2 * q + r * kv:2 * q + (r + 1) * kv])
        assert torch.equal(half.layers[1].o, full.layers[1].o[:, r * q:(r + 1) * q])
