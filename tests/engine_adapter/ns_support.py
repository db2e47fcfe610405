"""Test support for the namespace, block-size and KV-event tests of the engine plug-ins: small
safetensors checkpoints, fakes of vLLM's config, request and scheduler-output objects with
the attributes the connector reads (vLLM 0.32 names), SGLang's storage config and host pool.

Not a test module. Importable in a fresh interpreter (the determinism test runs one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from types import SimpleNamespace

import torch

from engine_adapter.reference.config import ModelConfig
from engine_adapter.reference.weights import SeededWeights

MODEL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32)


def write_checkpoint(path: pathlib.Path, seed: int, model: ModelConfig = MODEL) -> pathlib.Path:
    """A Hugging Face style checkpoint folder: ``config.json`` and ``model.safetensors`` of
    seeded weights (same names, shapes and dtypes for every seed; other values)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(SeededWeights(model, seed).state_dict(), str(path / "model.safetensors"))
    hf = model.to_hf()
    hf.update(model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=4096)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path


# ------------------------------------------------------------------ vLLM config fakes

class FakeModelConfig:
    """The ``ModelConfig`` fields and methods the connector reads."""

    def __init__(self, model: str, *, revision=None, dtype=torch.float32, quantization=None, hf_overrides=None,
                 rope=None, sliding_window=None, disable_sliding_window=False, layers: int = MODEL.num_layers):
        self.model, self.revision, self.dtype, self.quantization = model, revision, dtype, quantization
        self.hf_overrides = hf_overrides or {}
        self.disable_sliding_window = disable_sliding_window
        rope = rope if rope is not None else {"rope_theta": 10000.0, "rope_type": "default"}
        self.hf_text_config = SimpleNamespace(
            model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=MODEL.hidden_size,
            num_attention_heads=MODEL.num_heads, num_key_value_heads=MODEL.num_kv_heads, head_dim=MODEL.head_dim,
            max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu", rope_parameters=rope,
            rope_scaling=rope, sliding_window=sliding_window)
        self._layers = layers

    def get_head_size(self) -> int:
        return MODEL.head_dim

    def get_total_num_kv_heads(self) -> int:
        return MODEL.num_kv_heads

    def get_num_layers(self, parallel) -> int:
        return self._layers


def vllm_config(model: str, *, block_size: int = 16, cache_dtype: str = "auto", load_format: str = "auto",
                target: str = "unix:/nowhere.sock", **model_kw):
    """A stand-in of vLLM's ``VllmConfig`` with the fields ``settings.namespace_of`` reads."""
    return SimpleNamespace(
        model_config=FakeModelConfig(model, **model_kw),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype, hash_block_size=None,
                                     prefix_caching_hash_algo="sha256", kv_cache_dtype_skip_layers=[]),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"target": target}))


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained SHA-256 block hashes in the manner of vLLM's ``request.block_hashes``."""
    out, parent = [], b"\0" * 32
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(parent + json.dumps(tokens[i * block_size:(i + 1) * block_size]).encode()).digest()
        out.append(parent)
    return out


@dataclasses.dataclass
class FakeRequest:
    """The ``Request`` attributes the scheduler half reads."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes]
    lora_request: object = None
    cache_salt: str | None = None
    mm_features: list = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def request(req_id: str, tokens: list[int], block_size: int) -> FakeRequest:
    return FakeRequest(req_id, list(tokens), block_hashes(tokens, block_size))


def first_step(req_id: str, block_ids: list[int], num_tokens: int):
    """A ``SchedulerOutput`` stand-in: one new request, its whole prompt scheduled."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={req_id: num_tokens}, finished_req_ids=set())


# ------------------------------------------------------------------ SGLang fakes

class HostPool:
    """A page-first host KV pool stand-in: what the backend reads of SGLang's host pools."""

    layout = "page_first"

    def __init__(self, page_size: int = 16, layers: int = 2, heads: int = 2, dim: int = 8):
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layers, heads, dim

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim)


def storage_config(model_name: str = "tiny", tp_size: int = 1):
    """``HiCacheStorageConfig`` stand-in (the fields the namespace reads)."""
    return SimpleNamespace(model_name=model_name, tp_rank=0, tp_size=tp_size, is_mla_model=False)


def sglang_model_args(model_path: str, **kw):
    """SGLang's ``get_model()`` bag stand-in."""
    base = dict(model_path=model_path, revision=None, load_format="auto", json_model_override_args="{}",
                dtype="auto", quantization=None, kv_cache_dtype="auto", quantization_param_path=None)
    base.update(kw)
    return SimpleNamespace(**base)
