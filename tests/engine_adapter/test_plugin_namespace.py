"""The namespace fingerprints everything that changes KV bytes (weights, attention config,
quantization, KV dtype), for the vLLM connector, the SGLang backend and the reference runner:
two same-shape checkpoints with different weights and one model id are a miss, never a hit."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import ns_support as nss
from ea_support import engine
from engine_adapter import store_io
from engine_adapter.engine_keys import key_from_engine_hash
from engine_adapter.model_identity import attention_config, fingerprint_checkpoint, weights_identity
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.tp import TPGroup
from engine_adapter.reference.weights import SafetensorsWeights
from engine_adapter.sglang.settings import BackendSettings
from engine_adapter.sglang.settings import namespace_of as sglang_namespace
from engine_adapter.vllm.scheduler import SchedulerPlanner
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.settings import namespace_of as vllm_namespace

HERE = pathlib.Path(__file__).resolve().parent
BS = 16
SETTINGS = ConnectorSettings(target="unix:/nowhere.sock", model_id="same-model")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one architecture (same names, shapes, dtypes, sizes), other weights."""
    root = tmp_path_factory.mktemp("ckpt")
    a, b = nss.write_checkpoint(root / "a", seed=1), nss.write_checkpoint(root / "b", seed=2)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    return a, b


def vllm_ns(model, **kw):
    return vllm_namespace(nss.vllm_config(str(model), **kw), SETTINGS)


# ---------------------------------------------------------------- the weights' identity

def test_same_shape_checkpoints_with_other_weights_have_other_fingerprints(checkpoints):
    a, b = checkpoints
    fa, fb = fingerprint_checkpoint(a), fingerprint_checkpoint(b)
    assert fa[0].startswith("sha256:") and len(fa[0]) == len("sha256:") + 64
    assert fa[0] != fb[0]
    assert fingerprint_checkpoint(a) == fa                                   # deterministic
    assert "1 weight files (headers and sampled bytes)" in fa[1]


def test_one_changed_tensor_changes_the_fingerprint(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    a, _ = checkpoints
    tensors = load_file(str(a / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1.0           # the KV of layer 1 changes
    c = tmp_path / "c"
    c.mkdir()
    (c / "config.json").write_bytes((a / "config.json").read_bytes())
    save_file(tensors, str(c / "model.safetensors"))
    assert fingerprint_checkpoint(c)[0] != fingerprint_checkpoint(a)[0]


def test_hub_cache_snapshot_is_named_by_its_blob_hashes(tmp_path):
    """A hub snapshot's files link to ``blobs/<content hash>``: no weight byte is read."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()

    def snapshot(name: str, weights_blob: str) -> pathlib.Path:
        snap = tmp_path / "snapshots" / name
        snap.mkdir(parents=True)
        (blobs / weights_blob).write_bytes(b"not even a safetensors file")   # never read
        (snap / "model.safetensors").symlink_to(os.path.relpath(blobs / weights_blob, snap))
        return snap

    one = snapshot("c1", "a" * 64)
    two = snapshot("c2", "b" * 64)
    f1, f2 = fingerprint_checkpoint(one), fingerprint_checkpoint(two)
    assert f1[0] != f2[0] and "1 hub blob hashes" in f1[1]


def test_unreadable_or_missing_checkpoints_fall_back_and_say_so(tmp_path, caplog):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((10 ** 9).to_bytes(8, "little") + b"{}")  # header longer than the file
    assert weights_identity(str(bad)).value == "" and "not readable" in weights_identity(str(bad)).source
    missing = weights_identity("no-such-org/no-such-model")
    assert missing.value == "" and "no checkpoint files found" in missing.source
    assert weights_identity("no-such-org/no-such-model", revision="abc123").value == "revision:abc123"
    assert weights_identity(str(bad), explicit="v7").value == "revision:v7"         # files not read
    assert weights_identity(str(bad), load_format="dummy").value == "dummy"
    with caplog.at_level(logging.INFO, logger="engine_adapter.vllm"):
        ns = vllm_ns("no-such-org/no-such-model")
    assert "weights" not in ns.extra
    [line] = [r.getMessage() for r in caplog.records if "kvstore namespace" in r.getMessage()]
    assert "weights NOT fingerprinted" in line and "'same-model'" in line


# ---------------------------------------------------------------- vLLM

def test_vllm_namespace_of_other_weights_is_a_miss_through_the_daemon(checkpoints, client, caplog):
    """Blocks stored by the engine of checkpoint A are not hit by the engine of checkpoint B
    (same model id, same shapes), and are hit again by a new engine of A."""
    a, b = checkpoints
    tokens = list(range(100, 100 + 5 * BS + 3))
    with caplog.at_level(logging.INFO, logger="engine_adapter.vllm"):
        planners = {name: SchedulerPlanner(vllm_ns(path), BS, client, 30.0) for name, path in
                    (("a", a), ("b", b), ("a again", a))}
    assert any("weights sha256:" in r.getMessage() for r in caplog.records)
    assert planners["a"].namespace.fingerprint() != planners["b"].namespace.fingerprint()
    first = planners["a"]
    req = nss.request("r", tokens, BS)
    keys = first.request_keys(first._track(req))
    store_io.save_blocks(client, keys, np.zeros((len(keys), 64), dtype=np.float32))
    assert planners["b"].num_new_matched_tokens(nss.request("r", tokens, BS), 0) == 0
    assert planners["a again"].num_new_matched_tokens(nss.request("r", tokens, BS), 0) == 5 * BS


@pytest.mark.parametrize("change", [
    {"rope": {"rope_theta": 500000.0, "rope_type": "default"}},
    {"rope": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}},
    {"rope": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
    {"quantization": "fp8"},
    {"cache_dtype": "fp8_e4m3"},
    {"dtype": torch.bfloat16},
    {"hf_overrides": {"rope_theta": 20000.0}},
    {"sliding_window": 512},
    {"disable_sliding_window": True},
], ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values()))))
def test_vllm_namespace_changes_with_what_changes_kv(checkpoints, change):
    a, _ = checkpoints
    assert vllm_ns(a, **change).fingerprint() != vllm_ns(a).fingerprint()


def test_vllm_revision_names_weights_that_are_not_found_locally():
    assert vllm_ns("no-such-org/m", revision="v2").fingerprint() != vllm_ns("no-such-org/m", revision="v1").fingerprint()
    assert vllm_ns("no-such-org/m", revision="v2").extra["weights"] == "revision:v2"


def test_vllm_namespace_records_kv_dtype_and_model_dtype(checkpoints):
    a, _ = checkpoints
    ns = vllm_ns(a, cache_dtype="fp8_e4m3", quantization="fp8", dtype=torch.bfloat16)
    assert (ns.dtype, ns.extra["model_dtype"], ns.extra["quantization"]) == ("fp8_e4m3", "bfloat16", "fp8")
    assert "model_dtype" not in vllm_ns(a).extra and vllm_ns(a).dtype == "float32"
    assert json.loads(vllm_ns(a).extra["attention"])["rope"] == {"rope_theta": 10000.0}


def test_rope_spellings_of_transformers_releases_agree():
    old = {"rope_theta": 10000, "rope_scaling": None, "model_type": "llama"}          # transformers 4
    new = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "model_type": "llama"}
    assert attention_config(old) == attention_config(new)
    scaled = {"rope_theta": 10000, "rope_scaling": {"type": "linear", "factor": 2}, "model_type": "llama"}
    assert attention_config(scaled) == attention_config(
        {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}, "model_type": "llama"})
    assert attention_config(scaled) != attention_config(new)


def test_same_inputs_give_the_same_namespace_in_a_fresh_process(checkpoints):
    a, _ = checkpoints
    here = vllm_ns(a, quantization="fp8").fingerprint().hex()
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; import ns_support as nss; "
            "from engine_adapter.vllm.settings import ConnectorSettings, namespace_of; "
            "cfg = nss.vllm_config(sys.argv[2], quantization='fp8'); "
            "print(namespace_of(cfg, ConnectorSettings(target='unix:/nowhere.sock', model_id='same-model'))"
            ".fingerprint().hex())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, str(HERE), str(a)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == here


# ---------------------------------------------------------------- SGLang

def sglang_ns(model_path, **kw):
    return sglang_namespace(nss.storage_config(), nss.HostPool(), BackendSettings(target="unix:/x", model_id="m"),
                            nss.sglang_model_args(str(model_path), **kw))


def test_sglang_namespace_of_other_weights_is_a_miss_through_the_daemon(checkpoints, client):
    a, b = checkpoints
    ra, rb = sglang_ns(a).fingerprint(), sglang_ns(b).fingerprint()
    assert ra != rb
    pages = [f"{i:064x}" for i in range(4)]                      # SGLang's page hashes
    store_io.save_blocks(client, [key_from_engine_hash(ra, p.encode()) for p in pages],
                         np.zeros((4, 64), dtype=np.float32))
    assert store_io.lookup_prefix(client, [key_from_engine_hash(rb, p.encode()) for p in pages]) == 0
    assert store_io.lookup_prefix(client, [key_from_engine_hash(ra, p.encode()) for p in pages]) == 4


@pytest.mark.parametrize("change", [
    {"json_model_override_args": '{"rope_theta": 500000.0}'},
    {"json_model_override_args": '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'},
    {"quantization": "fp8"},
    {"kv_cache_dtype": "fp8_e4m3"},
    {"revision": "v2", "model_path": "no-such-org/no-such-model"},
], ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values()))))
def test_sglang_namespace_changes_with_what_changes_kv(checkpoints, change):
    a, _ = checkpoints
    path = change.pop("model_path", a)
    assert sglang_ns(path, **change).fingerprint() != sglang_ns(path).fingerprint()


# ---------------------------------------------------------------- reference runner

def test_reference_runner_of_other_weights_misses_through_the_daemon(checkpoints, client):
    a, b = checkpoints
    prompt = list(range(1, 5 * BS + 4))
    eng = engine(model_id="same-model")

    def run(path):
        runner = Runner(nss.MODEL, eng, TPGroup.single(), store=client, weights=SafetensorsWeights(path))
        out = runner.generate(prompt, 2)
        assert runner.flush()
        runner.close()
        return out.stats

    assert run(a).lookup_hit_tokens == 0
    assert run(b).lookup_hit_tokens == 0            # other weights, same model id and shapes: a miss
    assert run(a).lookup_hit_tokens == 5 * BS       # the same checkpoint again: a hit


def test_reference_namespace_changes_with_rope_theta_and_seed():
    import dataclasses

    from ea_support import runner_namespace

    base = runner_namespace(engine(), nss.MODEL)
    assert runner_namespace(engine(), dataclasses.replace(nss.MODEL, rope_theta=500000.0)) != base
    assert runner_namespace(engine(), nss.MODEL, seed=1).fingerprint() != base.fingerprint()
    assert runner_namespace(engine(), nss.MODEL).fingerprint() == base.fingerprint()
