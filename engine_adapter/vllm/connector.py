"""kvstore as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded by module path::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "engine_adapter.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "unix:/run/kvstore/kvstore.sock"}}'

``kv_connector_extra_config`` keys (:class:`ConnectorSettings`): ``target`` (required),
``auth_token``, ``timeout_s``, ``lookup_timeout_s``, ``load_timeout_s``, ``backoff_s``,
``max_backoff_s``, ``model_id``, ``weights_revision``, ``tenant``,
``key_scheme`` (``auto`` | ``block_hash`` | ``tokens``), ``kv_layout`` (``auto`` |
``token`` | ``cpu`` | ``kv_first``); agent hints and trajectories (docs/agent_hints.md):
``agent_hints``, ``trajectories``, ``max_trajectories``, ``trajectory_ttl_s``,
``trajectory_class_blocks``, ``hint_queue``, ``hint_timeout_s``.

At start the scheduler half builds the namespace (weights fingerprint, attention config,
quantization, KV dtype, block size, layout: :func:`~engine_adapter.vllm.settings.namespace_of`,
logged at INFO) and refuses a daemon configured for another block size.

(``engine_adapter.vllm_connector``, the old module path, is this same module.)

The scheduler half is :class:`engine_adapter.vllm.scheduler.SchedulerPlanner`, the worker half
:class:`engine_adapter.vllm.worker.WorkerTransfers`; the step plan they share is
:class:`engine_adapter.vllm.plan.StepPlan`. This module only adapts vLLM's hooks to them.
Loads are synchronous with the step (layer by layer); saves copy the KV out of the cache
during the step and put it in the background, so ``request_finished`` never delays
freeing blocks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from engine_adapter import store_io
from engine_adapter.hint_sender import HintSender
from engine_adapter.layout import BlockLayout
from engine_adapter.trajectories import AgentTracker
from engine_adapter.vllm.kv_views import detect_layout
from engine_adapter.vllm.plan import StepPlan
from engine_adapter.vllm.scheduler import SchedulerPlanner
from engine_adapter.vllm.settings import ConnectorSettings, kv_dtype_name, namespace_of, tp_heads
from engine_adapter.vllm.worker import WorkerTransfers, assemble_heads

log = logging.getLogger("engine_adapter.vllm")


def _log_through_vllm() -> None:
    """Let the plug-in's loggers (``engine_adapter.*``) print through vLLM's handler, at its
    level, when nothing else handles them (vLLM configures only its ``vllm`` logger): so the
    start-up INFO line of what the namespace covers shows in vLLM's log."""
    ours, theirs = logging.getLogger("engine_adapter"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


_log_through_vllm()


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, shipped from the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class KVStoreConnector(KVConnectorBase_V1):
    """Pages vLLM's prefix blocks back from kvstore and stores new full blocks there."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.settings = ConnectorSettings.from_extra(extra)
        self.block_size = vllm_config.cache_config.block_size
        self.client = store_io.connect(self.settings.target, timeout_s=self.settings.timeout_s,
                                       auth_token=self.settings.auth_token)
        self.store = store_io.GuardedStore(self.client, self.settings.breaker())
        self.planner: SchedulerPlanner | None = None
        self.worker: WorkerTransfers | None = None
        if getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a block that fails to load from kvstore "
                        "fails its request instead of being recomputed")
        self.namespace = None                          # only the scheduler half derives keys
        self.agent: AgentTracker | None = None
        if role == KVConnectorRole.SCHEDULER:
            cache = vllm_config.cache_config
            self.namespace = namespace_of(vllm_config, self.settings)
            self.agent = agent_tracker(self.settings, self.store)
            self.planner = SchedulerPlanner(
                self.namespace, self.block_size, self.store, self.settings.lookup_timeout_s,
                hashes_per_block=getattr(cache, "hash_block_size", None) in (None, cache.block_size),
                agent=self.agent)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        cfg = self._vllm_config
        names = list(kv_caches)
        first = kv_caches[names[0]]
        kv_layout = detect_layout(first) if self.settings.kv_layout == "auto" else self.settings.kv_layout
        model = cfg.model_config
        layout = BlockLayout(num_layers=len(names), num_kv_heads=model.get_total_num_kv_heads(),
                             block_tokens=self.block_size, head_dim=model.get_head_size(), dtype=first.dtype)
        expected = _cache_torch_dtype(cfg)
        if expected is not None and first.dtype != expected:
            raise ValueError(f"KV cache tensors are {first.dtype}, but kv-cache-dtype {kv_dtype_name(cfg)!r} "
                             f"is stored as {expected}: the store namespace would misname their bytes")
        tp_size = cfg.parallel_config.tensor_parallel_size
        gather, rank = None, 0
        if tp_size > 1:
            from vllm.distributed.parallel_state import get_tp_group
            group = get_tp_group()
            rank = group.rank_in_group
            gather = _tp_head_gather(group, layout.num_kv_heads, tp_size, rank)
        self.worker = WorkerTransfers(
            self.store, names, kv_caches, kv_layout, layout, tp_heads(layout.num_kv_heads, tp_size, rank),
            is_first_rank=rank == 0, gather_heads=gather, timeout_s=self.settings.timeout_s,
            load_timeout_s=self.settings.load_timeout_s)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self):
        if self.worker is not None:
            self.worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self):
        if self.worker is not None:
            self.worker.flush(self.settings.timeout_s)
        if self.agent is not None:
            self.agent.close()
        self.store.close()
        self.client.close()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.planner.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens > 0:
            self.planner.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVStoreConnectorMetadata(self.planner.build(scheduler_output))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request)
        return False, None


def agent_tracker(settings: ConnectorSettings, store) -> AgentTracker | None:
    """The scheduler half's agent-hint and trajectory tracker (None when both are off)."""
    if not (settings.agent_hints or settings.trajectories):
        return None
    sender = HintSender(store, max_pending=settings.hint_queue, timeout_s=settings.hint_timeout_s)
    return AgentTracker(sender, hints=settings.agent_hints, trajectories=settings.trajectories,
                        max_trajectories=settings.max_trajectories, ttl_s=settings.trajectory_ttl_s,
                        class_blocks=settings.trajectory_class_blocks)


def _cache_torch_dtype(vllm_config) -> torch.dtype | None:
    """The torch dtype vLLM gives KV cache tensors of ``cache_dtype`` (fp8 caches are
    ``uint8``), or None when this vLLM release cannot say."""
    try:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        return kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    except (ImportError, KeyError):
        return None


def _tp_head_gather(group, num_kv_heads: int, tp_size: int, rank: int):
    """A :data:`~engine_adapter.vllm.worker.GatherHeads` over vLLM's TP group (gloo CPU group)."""
    import torch.distributed as dist

    bounds = [tp_heads(num_kv_heads, tp_size, r) for r in range(tp_size)]

    def gather(staging: torch.Tensor):
        parts = [torch.empty_like(staging) for _ in range(tp_size)] if rank == 0 else None
        dist.gather(staging, parts, dst=group.ranks[0], group=group.cpu_group)
        if rank != 0:
            return None
        return assemble_heads(parts, bounds, num_kv_heads)

    return gather


__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "assemble_heads"]
