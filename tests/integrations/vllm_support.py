"""Test support for the vLLM connector: a tiny Llama checkpoint, vLLM configs and requests.

Not a test module. Everything here imports vLLM lazily; tests skip when it is absent.
"""

from __future__ import annotations

import pathlib


def tiny_llama_dir(path: pathlib.Path, *, layers: int = 2, kv_heads: int = 2, heads: int = 4,
                   hidden: int = 256, vocab: int = 32000, seed: int = 0) -> pathlib.Path:
    """Save a seeded random Llama (``save_pretrained``) under ``path``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, torch_dtype="float32")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def kv_transfer_config(target: str, **extra):
    """The connector's transfer config. The lookup deadline is generous (60 s, not the
    50 ms default) unless given: a test that asserts hits must not miss on a loaded machine."""
    from vllm.config import KVTransferConfig

    extra = {"lookup_timeout_s": 60.0, **extra}
    return KVTransferConfig(kv_connector="KVStoreConnector",
                            kv_connector_module_path="engine_adapter.vllm.connector",
                            kv_role="kv_both", kv_connector_extra_config={"target": target, **extra})


def vllm_config(model_dir: pathlib.Path, target: str, *, block_size: int = 16, num_blocks: int = 64,
                model_kw: dict | None = None, cache_kw: dict | None = None, **extra):
    """A VllmConfig of the tiny model with the connector (no device needed); ``model_kw`` and
    ``cache_kw`` go to vLLM's ``ModelConfig`` and ``CacheConfig`` (e.g. ``hf_overrides``,
    ``quantization``, ``cache_dtype``)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(**{"model": str(model_dir), "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                           "max_model_len": 2048, **(model_kw or {})})
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True, **(cache_kw or {}))
    cache.num_gpu_blocks = num_blocks
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                            is_encoder_decoder=False)
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, device_config=DeviceConfig(device="cpu"),
                      kv_transfer_config=kv_transfer_config(target, **extra))


def scheduler(cfg, num_blocks: int = 64):
    """vLLM's real v1 Scheduler over one full-attention KV cache group."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = cfg.model_config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(cfg.parallel_config))]
    spec = FullAttentionSpec(block_size=cfg.cache_config.block_size,
                             num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=torch.float32)
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cfg, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=cfg.cache_config.block_size, log_stats=True)


def request(req_id: str, tokens: list[int], block_size: int, max_tokens: int = 4):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(req_id, list(tokens), params, None, block_hasher=get_request_block_hasher(block_size, sha256))
