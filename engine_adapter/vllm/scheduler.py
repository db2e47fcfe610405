"""Scheduler half of the vLLM connector: what to load and store, planned per engine step.

Runs in vLLM's scheduler process (the workers are other processes), so what is stored
is learnt from the daemon itself (a Lookup), never from worker memory. Per request:

1. ``num_new_matched_tokens``: keys of the request's full blocks (at most
   ``(num_tokens - 1) // block_size`` of them, so at least one token is computed and
   gives the next token's logits); Lookup gives the stored prefix ``hit``; vLLM already
   holds ``num_computed_tokens`` locally; the external tokens are
   ``(hit - num_computed_tokens / block_size) * block_size`` when positive.
2. ``after_alloc``: the external blocks become a load of ``keys[first:first + n]`` into
   the request's cache blocks ``block_ids[first:first + n]``.
3. ``build``: the step's :class:`~engine_adapter.vllm.plan.StepPlan`: the loads above
   and, per scheduled request, a store of each full block that this step completes and
   the store does not hold yet (blocks before ``hit`` are already stored), with vLLM's
   own hash of each block, its parent's and the blocks' token ids, which the daemon's
   KV events announce them under.

Agent hints and trajectories (:class:`engine_adapter.trajectories.AgentTracker`, when given):
on a request's first ``num_new_matched_tokens`` its keys, ``request.kv_transfer_params`` and
``request.kv_hints`` go to the tracker (which tells the daemon what wait it resumes), and
when it finishes (``finished``, or its id in a step's ``finished_req_ids``) its stored prefix
(the blocks before ``stored_blocks``) does; every call to the daemon is queued, never waited on.

At start the planner checks that the daemon's ``[blocks] block_tokens`` (when it publishes
one) is vLLM's block size, and refuses to start otherwise (``store_io.check_block_tokens``).

Nothing here imports vLLM: requests and scheduler outputs are read by attribute
(``request.request_id``, ``.all_token_ids``, ``.num_tokens``, ``.block_hashes``,
``.lora_request``, ``.cache_salt``, ``.kv_transfer_params``, ``.kv_hints``, ``.session_id``,
``.arrival_time``;
``scheduler_output.scheduled_new_reqs``,
``.scheduled_cached_reqs``, ``.num_scheduled_tokens``, ``.finished_req_ids``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from kvstore.common.errors import KVStoreError, StoreUnavailable
from kvstore.common.keys import BlockKeyer, Namespace, encode_tokens

from engine_adapter import store_io
from engine_adapter.engine_keys import EngineHashKeys, IncrementalKeys
from engine_adapter.trajectories import AgentTracker, RequestHints
from engine_adapter.vllm.plan import BlockTransfer, StepPlan

log = logging.getLogger("engine_adapter.vllm")


@dataclass
class _Tracked:
    request: object
    keys: IncrementalKeys
    local_computed: int = 0          # block-aligned local prefix hit given to the lookup
    stored_blocks: int = 0           # leading full blocks known to be in the store
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    agent: RequestHints | None = None    # what the tracker learnt on arrival (None: not arrived yet)


class SchedulerPlanner:
    """Lookups and load/store planning of the scheduler process.

    Args:
        namespace: store namespace (its scheme decides how keys are derived).
        block_size: vLLM's block size in tokens (the store's ``block_tokens``).
        client: the daemon's client behind its breaker (:class:`engine_adapter.store_io.GuardedStore`;
            used for Info at start and Lookup).
        timeout_s: Lookup deadline, seconds (tens of milliseconds: the scheduler waits on it).
        hashes_per_block: vLLM's ``request.block_hashes`` are one per ``block_size`` tokens
            (``cache_config.hash_block_size`` unset or equal): saves then carry them for the
            daemon's KV events.
        agent: the agent-hint and trajectory tracker (None: no hint or trajectory is sent).
    Raises:
        ValueError: the daemon is configured for another block size (``[blocks] block_tokens``).

    A request's ``num_publishable_block_hashes`` (where a vLLM release has it) caps how
    many of its leading block hashes are used for keys; vLLM 0.32 and 0.33 have none.
    """

    def __init__(self, namespace: Namespace, block_size: int, client, timeout_s: float, *,
                 hashes_per_block: bool = True, agent: AgentTracker | None = None):
        if namespace.block_tokens != block_size:
            raise ValueError(f"namespace block_tokens {namespace.block_tokens} != block size {block_size}")
        store_io.check_block_tokens(client, block_size, "vLLM block_size")
        self.hashes_per_block = hashes_per_block
        self.namespace = namespace
        self._keyer = BlockKeyer(namespace)             # one root and hash state for every request
        self._hash_keys = EngineHashKeys(self._keyer.root) if namespace.extra.get("keys") == "block_hash" else None
        self.block_size = block_size
        self.client = client
        self.timeout_s = timeout_s
        self._reqs: dict[str, _Tracked] = {}
        self._loads: list[BlockTransfer] = []
        self._lookup_failing = False
        self.agent = agent

    # ------------------------------------------------------------ keys

    def _track(self, request) -> _Tracked:
        st = self._reqs.get(request.request_id)
        if st is None:
            extra = {}
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                extra["lora"] = str(getattr(lora, "lora_name", lora))
            salt = getattr(request, "cache_salt", None)
            if salt:
                extra["cache_salt"] = str(salt)
            st = _Tracked(request, IncrementalKeys(self.namespace, extra, keyer=self._keyer,
                                                   hash_keys=self._hash_keys))
            self._reqs[request.request_id] = st
        return st

    @staticmethod
    def _block_hashes(req) -> list:
        hashes = list(getattr(req, "block_hashes", ()))
        cap = getattr(req, "num_publishable_block_hashes", None)
        return hashes if cap is None else hashes[:cap]

    def request_keys(self, st: _Tracked) -> list[bytes]:
        """Keys of the request's full blocks known now (empty when it must not use the store)."""
        req = st.request
        if st.keys.scheme == "tokens" and getattr(req, "mm_features", None):
            return []                      # token keys cannot see image inputs: never share
        return st.keys.extend(tokens=req.all_token_ids, block_hashes=self._block_hashes(req))

    def _save(self, st: _Tracked, req_id: str, keys: list[bytes], first: int, full: int) -> BlockTransfer:
        """The store of blocks ``[first, full)`` with what the daemon's events name them by."""
        req, bs = st.request, self.block_size
        hashes = [bytes(h) for h in self._block_hashes(req)[:full]] if self.hashes_per_block else []
        if len(hashes) < full:
            hashes = []
        lora = getattr(req, "lora_request", None)
        return BlockTransfer(req_id, tuple(keys[first:full]), tuple(st.block_ids[first:full]),
                             engine_hashes=tuple(hashes[first:full]),
                             parent_hash=hashes[first - 1] if hashes and first else b"",
                             token_ids=encode_tokens(list(req.all_token_ids[first * bs:full * bs])),
                             lora_name=str(getattr(lora, "lora_name", "")) if lora is not None else "")

    # ------------------------------------------------------------ vLLM hooks

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that the store can supply (a multiple
        of the block size). 0 when the store fails or misses the lookup deadline, and at
        once while its breaker is open (the breaker logs the outage); another store error
        is logged once until a lookup succeeds."""
        st = self._track(request)
        st.local_computed = num_computed_tokens
        keys = self.request_keys(st)
        if st.agent is None and self.agent is not None:
            st.agent = self._arrived(request, keys)
        usable = keys[:max(0, (request.num_tokens - 1) // self.block_size)]
        try:
            hit = store_io.lookup_prefix(self.client, usable, self.timeout_s)
        except StoreUnavailable:
            return 0
        except KVStoreError as e:
            if not self._lookup_failing:
                log.warning("kvstore lookup failed (%s); computing prefixes without the store", e)
            self._lookup_failing = True
            return 0
        self._lookup_failing = False
        st.stored_blocks = max(st.stored_blocks, hit)
        return max(0, hit - num_computed_tokens // self.block_size) * self.block_size

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into ``block_ids`` (all of the request's
        blocks of KV cache group 0, as vLLM allocated them)."""
        st = self._track(request)
        n = num_external_tokens // self.block_size
        if n <= 0:
            return
        first = st.local_computed // self.block_size
        keys = self.request_keys(st)[first:first + n]
        ids = block_ids[first:first + n]
        if len(keys) != n or len(ids) != n:
            raise RuntimeError(f"request {request.request_id}: {n} external blocks planned but "
                               f"{len(keys)} keys and {len(ids)} cache blocks are known")
        self._loads.append(BlockTransfer(request.request_id, tuple(keys), tuple(ids)))

    def build(self, scheduler_output) -> StepPlan:
        """The step's loads and stores; resets the pending loads."""
        plan = StepPlan(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                st.num_computed = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            st.num_computed = cached.num_computed_tokens[i]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            keys = self.request_keys(st)
            full = min((st.num_computed + n) // self.block_size, len(keys), len(st.block_ids))
            if full > st.stored_blocks:
                plan.saves.append(self._save(st, req_id, keys, st.stored_blocks, full))
                st.stored_blocks = full
        for req_id in scheduler_output.finished_req_ids:
            self._finish(req_id)
        return plan

    def finished(self, request) -> None:
        """Forget a finished request (its stores were planned in earlier steps); its
        session or trajectory starts to wait."""
        self._finish(request.request_id)

    # ------------------------------------------------------------ agent hints

    def _arrived(self, request, keys: list[bytes]) -> RequestHints:
        """Hand a new request to the agent tracker (never raises: a hint is advice)."""
        at = getattr(request, "arrival_time", None)
        now = time.time()
        if not isinstance(at, (int, float)) or not math.isfinite(at) or abs(now - at) > 3600:
            at = now
        try:
            return self.agent.arrived(request.request_id, list(keys), getattr(request, "kv_transfer_params", None),
                                      getattr(request, "kv_hints", None), at, getattr(request, "session_id", None))
        except Exception:  # noqa: BLE001 - a bug in the hint path must never fail a request
            log.exception("kvstore agent hints of request %s failed; the request is served without them",
                          request.request_id)
            return RequestHints()

    def _finish(self, req_id: str) -> None:
        st = self._reqs.pop(req_id, None)
        if st is None or st.agent is None or self.agent is None:
            return
        try:
            self.agent.finished(st.agent, self.request_keys(st)[:st.stored_blocks])
        except Exception:  # noqa: BLE001 - as in _arrived
            log.exception("kvstore agent hints of finished request %s failed", req_id)
