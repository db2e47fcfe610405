"""Processes of ``bench/agent_serving.py``: the kvstore daemon (its own process, run by this
module so that it can report its prefetch scheduler's statistics when it stops), vLLM's OpenAI
server, and what each says about itself (the daemon's config, vLLM's prefix-cache counters).

    python bench/agent_serving_procs.py daemon CONFIG.toml STATS.json

runs a daemon from ``CONFIG.toml`` until SIGTERM / SIGINT, then writes ``STATS.json``: the
prefetch scheduler's :meth:`~kvstore.agent.stats.PrefetchStats.summary` (tool calls, resumes
known and unknown, readiness, promoted and wasted bytes, expiries, prediction errors), its
measured hop bandwidths, and the daemon's counters.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = 32


def model_dir(scratch: pathlib.Path, **shape) -> pathlib.Path:
    """The seeded Llama of ``shape`` (``vllm_support.tiny_llama_dir``'s arguments) under ``scratch``."""
    import vllm_support
    return vllm_support.tiny_llama_dir(scratch / "model", **shape)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_toml(scratch: pathlib.Path, host_bytes: int, policy: str, prefetch: bool, options: list[str],
                engine_events: str | None = None, metrics_port: int | None = None, nvme_bytes: int = 1 << 30) -> str:
    """The daemon's config: host tier then NVMe, KV events on a unix socket; ``engine_events``:
    vLLM's KV event endpoint, read by the daemon (``[engines] kv_events``); ``metrics_port``:
    its Prometheus endpoint (each call's latency: :func:`rpc_latency`); ``nvme_bytes``: the NVMe
    tier's capacity. ``options``:
    ``SECTION.KEY=VALUE`` (a TOML value) added to their section, e.g. ``prefetch.lead_time_s=0.2``,
    ``tiers.host.shared=false``, ``policy.params={admission=false}``."""
    sections = {
        "server": [f'listen = "unix:{scratch}/kvstore.sock"', "stop_grace_s = 1.0"],
        "blocks": [f"block_tokens = {BLOCK}"],
        "tiers.host": [f"capacity = {host_bytes}"],
        "tiers.nvme": ["enabled = true", f'path = "{scratch}/nvme"', f"capacity = {nvme_bytes}"],
        "policy": [f'eviction = "{policy}"'],
        "store": ["stop_persist_s = 0.0"],
        "prefetch": [f"enabled = {'true' if prefetch else 'false'}"],
        "events": ["enabled = true", f'endpoint = "ipc://{scratch}/events.sock"'],
    }
    if metrics_port:
        sections["metrics"] = [f'listen = "127.0.0.1:{metrics_port}"']
    if engine_events:
        sections["engines"] = [f'kv_events = ["{engine_events}"]', 'kv_events_topic = "vllm"']
    for option in options:
        name, sep, value = option.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not sep or not dot or not key:
            raise ValueError(f"daemon option {option!r} is not SECTION.KEY=VALUE")
        lines = sections.setdefault(section, [])
        lines[:] = [line for line in lines if line.split(" = ")[0] != key] + [f"{key} = {value.strip()}"]
    return "".join(f"[{name}]\n" + "".join(f"{line}\n" for line in lines) for name, lines in sections.items())


def start(cmd: list[str], logfile: pathlib.Path, env: dict) -> subprocess.Popen:
    """A child in its own process group (vLLM's engine core and workers are its children)."""
    return subprocess.Popen(cmd, stdout=logfile.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def stop(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """SIGTERM to the child's process group, SIGKILL after ``grace_s``."""
    import signal
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``/proc``; None where unreadable)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(port: int, proc: subprocess.Popen, logfile: pathlib.Path, deadline_s: float = 900.0) -> None:
    import http.client
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}): {logfile.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM server not up after {deadline_s:.0f} s; log in {logfile}")


def vllm_command(model: pathlib.Path, port: int, events: str, args, target: str | None) -> list[str]:
    """vLLM's OpenAI server on ``port`` (KV events published on ``events``), with the kvstore
    connector when ``target`` is given; sizes from ``args`` (``max_model_len``,
    ``engine_blocks``, ``max_num_seqs``, ``lookup_timeout_s``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--skip-tokenizer-init", "--enable-prefix-caching",
           "--max-model-len", str(args.max_model_len), "--block-size", str(BLOCK), "--dtype", "float32",
           "--seed", "0", "--num-gpu-blocks-override", str(args.engine_blocks),
           "--max-num-seqs", str(args.max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
           "--enable-prompt-tokens-details", "--kv-events-config",
           json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "topic": "vllm"})]
    if target is not None:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"target": target, "lookup_timeout_s": args.lookup_timeout_s}})]
    return cmd


def rpc_latency(port: int) -> dict[str, dict[str, float]]:
    """The daemon's calls so far, from its /metrics (``kvstore:request_seconds``): per method,
    ``count`` and ``mean_ms``, summed over tenants."""
    import urllib.request
    sums: dict[str, list[float]] = {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    for line in text.splitlines():
        for part, i in (("kvstore:request_seconds_sum{", 0), ("kvstore:request_seconds_count{", 1)):
            if line.startswith(part):
                method = line.split('method="', 1)[1].split('"', 1)[0]
                sums.setdefault(method, [0.0, 0.0])[i] += float(line.split()[-1])
    return {m: {"count": int(c), "mean_ms": round(1e3 * t / c, 3)} for m, (t, c) in sums.items() if c}


def vllm_metrics(port: int) -> dict[str, float]:
    """vLLM's prefix-cache counters (local and through the connector), from its /metrics."""
    import urllib.request
    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.startswith(("vllm:prefix_cache_", "vllm:external_prefix_cache_")) and name.endswith("_total"):
            out[name.removeprefix("vllm:")] = out.get(name.removeprefix("vllm:"), 0.0) + float(line.split()[-1])
    return out


def run_daemon(config: pathlib.Path, stats_out: pathlib.Path) -> int:
    """The daemon of ``config`` in this process until SIGTERM / SIGINT; then its statistics."""
    from kvstore import config as config_mod
    from kvstore.service.startup import start_server

    cfg = config_mod.load(config)
    daemon = start_server(cfg)
    print(f"kvstore serving on {daemon.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.2):
        pass
    scheduler = daemon.service.hints
    out = {"counters": {k: int(v) for k, v in daemon.manager.counters.items()}}
    if scheduler is not None:
        out["prefetch"] = scheduler.stats.summary()
        out["bandwidth"] = {f"{a.name.lower()}:{b.name.lower()}": v for (a, b), v in dict(scheduler.bandwidth).items()}
    stats_out.write_text(json.dumps(out, indent=1, default=str))
    daemon.stop(grace=1.0)
    print("kvstore stopped", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "daemon":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(run_daemon(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])))
