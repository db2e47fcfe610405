"""The connector inside vLLM's real v1 Scheduler, against a real daemon.

Needs vLLM importable (``.venv-vllm`` of scripts/test-integrations.sh); skips otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/test-integrations.sh builds .venv-vllm)", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm_support as vs  # noqa: E402

from engine_adapter.engine_keys import IncrementalKeys  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vs.tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def expected_keys(connector, req) -> list[bytes]:
    keys = IncrementalKeys(connector.namespace)
    return keys.extend(tokens=req.all_token_ids, block_hashes=req.block_hashes)


def plan_of(output):
    return output.kv_connector_metadata.plan


@pytest.mark.parametrize("scheme", ["auto", "tokens"])
def test_second_request_is_scheduled_with_external_tokens(daemon, client, model_dir, scheme):
    prompt_a = list(range(100, 170))                      # 4 full blocks + 6 tokens
    sched = vs.scheduler(vs.vllm_config(model_dir, daemon.address, key_scheme=scheme))
    conn = sched.connector
    assert conn.namespace.extra["keys"] == ("block_hash" if scheme == "auto" else "tokens")
    req_a = vs.request("a", prompt_a, BS)
    sched.add_request(req_a)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0          # empty store: no hit
    plan = plan_of(out)
    keys_a = expected_keys(conn, req_a)
    assert len(keys_a) == 4 and plan.loads == []
    [save] = plan.saves
    assert save.req_id == "a" and list(save.keys) == keys_a
    assert list(save.block_ids) == out.scheduled_new_reqs[0].block_ids[0][:4]

    # what the workers would store: the 4 full blocks (payload bytes do not matter to Lookup)
    client.put([(k, bytes([i]) * 64) for i, k in enumerate(keys_a)])

    # a fresh vLLM instance (empty local prefix cache): 3 shared blocks, then a new tail
    prompt_b = prompt_a[:48] + list(range(500, 520))       # 68 tokens: 4 full blocks
    sched2 = vs.scheduler(vs.vllm_config(model_dir, daemon.address, key_scheme=scheme))
    req_b = vs.request("b", prompt_b, BS)
    sched2.add_request(req_b)
    out2 = sched2.schedule()
    new_b = out2.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens == 48                  # external tokens: 3 blocks from kvstore
    assert out2.num_scheduled_tokens["b"] == 68 - 48
    keys_b = expected_keys(sched2.connector, req_b)
    assert keys_b[:3] == keys_a[:3] and keys_b[3] != keys_a[3]
    plan2 = plan_of(out2)
    [load] = plan2.loads
    assert load.req_id == "b" and list(load.keys) == keys_a[:3]
    assert list(load.block_ids) == new_b.block_ids[0][:3]
    [save2] = plan2.saves                                  # only the new full block is stored
    assert list(save2.keys) == [keys_b[3]] and list(save2.block_ids) == [new_b.block_ids[0][3]]


def test_whole_prompt_hit_leaves_one_token_to_compute(daemon, client, model_dir):
    prompt = list(range(1000, 1064))                       # exactly 4 blocks
    sched = vs.scheduler(vs.vllm_config(model_dir, daemon.address))
    req = vs.request("x", prompt, BS)
    keys = expected_keys(sched.connector, req)
    client.put([(k, b"\0" * 64) for k in keys])
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48   # 3 blocks: the last one is computed
    assert list(plan_of(out).loads[0].keys) == keys[:3]


def test_daemon_down_schedules_without_external_tokens(tmp_path, model_dir):
    sched = vs.scheduler(vs.vllm_config(model_dir, f"unix:{tmp_path}/absent.sock", timeout_s=0.5))
    sched.add_request(vs.request("c", list(range(40, 110)), BS))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens["c"] == 70
    assert plan_of(out).loads == []


def test_bad_extra_config_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['tagret'\\]"):
        vs.scheduler(vs.vllm_config(model_dir, "unix:/x", tagret="oops"))


# ---------------------------------------------------------------- the namespace, the block size, events

def test_other_weights_of_the_same_shape_are_a_miss(daemon, client, model_dir, tmp_path):
    """Two checkpoints of one architecture, other weights, one ``model_id``: the second
    engine is scheduled with no external tokens from the first one's blocks."""
    other = vs.tiny_llama_dir(tmp_path / "other", seed=1)
    prompt = list(range(100, 170))
    first = vs.scheduler(vs.vllm_config(model_dir, daemon.address, model_id="tiny"))
    req = vs.request("a", prompt, BS)
    client.put([(k, b"\0" * 64) for k in expected_keys(first.connector, req)])
    again = vs.scheduler(vs.vllm_config(model_dir, daemon.address, model_id="tiny"))
    again.add_request(vs.request("a", prompt, BS))
    assert again.schedule().scheduled_new_reqs[0].num_computed_tokens == 64     # the same weights: a hit
    second = vs.scheduler(vs.vllm_config(other, daemon.address, model_id="tiny"))
    assert second.connector.namespace.fingerprint() != first.connector.namespace.fingerprint()
    second.add_request(vs.request("b", prompt, BS))
    assert second.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


@pytest.mark.parametrize("change", [
    {"model_kw": {"hf_overrides": {"rope_theta": 20000.0}}},
    {"model_kw": {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}},
    {"model_kw": {"quantization": "fp8", "dtype": "bfloat16"}},
    {"cache_kw": {"cache_dtype": "fp8"}},
], ids=["rope_theta", "rope_scaling", "quantization", "kv_dtype"])
def test_what_changes_kv_changes_the_namespace(model_dir, change):
    """Each against the same config without it (the fp8 quantization one: bfloat16 both)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_adapter.vllm.connector import KVStoreConnector

    def ns(**kw):
        return KVStoreConnector(vs.vllm_config(model_dir, "unix:/nowhere.sock", **kw),
                                KVConnectorRole.SCHEDULER).namespace.fingerprint()

    dtype = change.get("model_kw", {}).get("dtype")
    try:
        changed = ns(**change)
    except ImportError as e:                    # the lean API-only vLLM lacks quantization packages
        pytest.skip(f"this vLLM environment cannot configure {change}: {e}")
    assert changed != ns(model_kw={"dtype": dtype} if dtype else None)


def test_a_daemon_of_another_block_size_is_refused(tmp_path, model_dir):
    from kvstore.service.startup import start_server
    from support.daemon import daemon_config

    d = start_server(daemon_config(tmp_path, extra={"blocks": {"block_tokens": 16}}))
    try:
        with pytest.raises(ValueError, match="vLLM block_size 32 does not match the kvstore daemon"):
            vs.scheduler(vs.vllm_config(model_dir, d.address, block_size=32))
        vs.scheduler(vs.vllm_config(model_dir, d.address, block_size=16))
    finally:
        d.stop(0)


def test_saves_carry_vllms_block_hashes_and_tokens(daemon, model_dir):
    import numpy as np

    sched = vs.scheduler(vs.vllm_config(model_dir, daemon.address))
    prompt = list(range(300, 370))
    req = vs.request("h", prompt, BS)
    sched.add_request(req)
    [save] = plan_of(sched.schedule()).saves
    assert save.engine_hashes == tuple(req.block_hashes[:4]) and save.parent_hash == b""
    assert np.frombuffer(save.token_ids, dtype="<u4").tolist() == prompt[:64]
    metas = save.block_meta()
    assert metas[1].parent_engine_hash == req.block_hashes[0] and metas[1].token_ids == tuple(prompt[16:32])
