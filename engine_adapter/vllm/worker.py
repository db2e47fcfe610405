"""Worker half of the vLLM connector: page blocks into vLLM's paged cache and store new ones.

One instance per TP rank, driven by the hooks vLLM calls in every step:

- ``bind(plan)``: the step's plan, when vLLM binds the metadata;
- ``start_load()``: a loader thread leases every planned block once (one store round
  trip for the step whatever the layer count, ``store_io.load_stages``; a load larger
  than one lease may hold is read in parts, each block promoted from NVMe once) and
  copies this rank's KV heads out of it layer by layer (``docs/block_layout.md``):
  with vLLM's CPU cache straight into the planned cache blocks (a block's k and v of
  each head, in the cache's order), with another cache into staging tensors of its own;
- ``wait_layer(l)`` (before layer ``l``'s attention): waits for layer ``l`` (and, for a
  staged load, scatters its blocks into the cache, ``kernels.scatter_blocks``). A block
  missing, short or late in any layer is never used: it and the rest of its request's
  loaded blocks are reported by ``take_load_errors`` and vLLM recomputes them; a load
  given up is stopped before vLLM goes on, so it writes nothing into the cache later;
- ``save_layer(l)`` (after layer ``l``'s attention): copies layer ``l`` of the blocks
  this step completes out of the cache (``kernels.gather_blocks``), so vLLM may reuse
  the cache blocks as soon as the step ends (a CUDA cache's copies and loads are queued
  through pinned staging, the forward never waits: :mod:`engine_adapter.vllm.cuda_copies`);
- ``end_step()``: when every layer was copied, TP rank 0 gathers the other ranks' heads
  (``gather_heads``) and a background thread stores the full-head payloads
  (``store_io.save_blocks``) with each block's vLLM hash, parent hash and token ids from
  the plan (``BlockTransfer.block_meta``), so the daemon's KV events announce them as vLLM
  does; a save missing a layer is dropped, never stored partly.

The client is a :class:`engine_adapter.store_io.GuardedStore`: while the store is failing
its breaker is open, loads are not attempted (their blocks are recomputed) and saves are
dropped, counted and summarised by the breaker in one log line when the store is back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kernels import gather_blocks, scatter_blocks
from kvstore.common.errors import KVStoreError, StoreUnavailable

from engine_adapter import store_io
from engine_adapter.background import BackgroundJobs, KeptThread
from engine_adapter.layout import BlockLayout
from engine_adapter.vllm.cuda_copies import CudaSaves, rows_of
from engine_adapter.vllm.kv_views import kernel_view
from engine_adapter.vllm.plan import BlockTransfer, StepPlan

log = logging.getLogger("engine_adapter.vllm")

GatherHeads = Callable[[torch.Tensor], "torch.Tensor | None"]
"""``(n, layers, 2, rank_heads, bs, hd)`` of this rank -> all heads on TP rank 0, ``None`` elsewhere."""


LOADER_RETURN_S = 5.0
"""Longest a step waits for the loader thread (:class:`~engine_adapter.background.KeptThread`)
to return from a load that has finished (microseconds, normally); past it the step's load
takes a new thread (seconds)."""


class _LayerLoads:
    """The load of one step, run by ``start(job)`` on the worker's loader thread: per-layer
    readiness of the blocks copied in.

    One store call for the step (:func:`engine_adapter.store_io.load_stages`): every planned
    block read from the block table or leased, once, its layers copied out one after the
    other, each layer published (``ok``, ``ready``) as soon as its copy is in place. A layer
    that is never published (the store failed, the load was cancelled) fails every block.
    ``calls``: the store round trips the load made.

    With ``direct`` (per layer, vLLM's own cache tensor in the CPU layout, contiguous) each
    layer is copied straight into the planned cache blocks (``BlockLayout.head_major_ranges``
    puts a block's bytes in that layout's order) and ``staging`` is None; otherwise into
    ``staging[layer]``, ``(n, 1, 2, rank_heads, bs, hd)``, which ``wait_layer`` scatters.
    Every write into either is made under a lock after the cancel flag was checked, and
    :meth:`cancel` sets the flag, then takes the lock (waiting out a copy under way): once
    ``cancel`` returns nothing more is written, so a load given up (late, failed) never
    touches cache blocks vLLM recomputes or reuses.
    """

    def __init__(self, client, loads: Sequence[BlockTransfer], layout: BlockLayout,
                 heads: tuple[int, int], timeout_s: float, direct: Sequence[torch.Tensor] | None,
                 start: Callable[[Callable[[], None]], None], pin: bool = False):
        self.loads = list(loads)
        self.keys = [k for t in self.loads for k in t.keys]
        self.layout, self.heads, self.timeout_s = layout, heads, timeout_s
        n, nh = len(self.keys), heads[1] - heads[0]
        self.want = 2 * nh * layout.head_bytes              # bytes of one block of one layer
        self.direct = list(direct) if direct is not None else None
        self.staging = None if direct is not None else [
            torch.empty((n, 1, 2, nh, layout.block_tokens, layout.head_dim), dtype=layout.dtype, pin_memory=pin)
            for _ in range(layout.num_layers)]
        self.ok: list[list[bool] | None] = [None] * layout.num_layers
        self.ready = [threading.Event() for _ in range(layout.num_layers)]
        self.problem: str | None = None
        self.calls = 0
        self._cancel = threading.Event()
        self._writing = threading.Lock()
        self._client = client
        start(self._run)                # on the worker's loader thread

    def _publish(self, layer: int, sizes: list[int]) -> None:
        self.ok[layer] = [size == self.want for size in sizes]
        self.ready[layer].set()

    def _stages(self) -> list[store_io.ReadStage]:
        layers = range(self.layout.num_layers)
        if self.direct is None:
            return [store_io.ReadStage(self.layout.layer_ranges(layer, self.heads), self.staging[layer])
                    for layer in layers]
        offsets = [b * self.want for t in self.loads for b in t.block_ids]
        return [store_io.ReadStage(self.layout.head_major_ranges(layer, self.heads), self.direct[layer], offsets)
                for layer in layers]

    def _run(self) -> None:
        layers = range(self.layout.num_layers)
        try:
            self.calls = store_io.load_stages(self._client, self.keys, self._stages(), timeout_s=self.timeout_s,
                                              publish=self._publish, cancelled=self._cancel.is_set,
                                              write_lock=self._writing).calls
        except Exception as e:  # store down or a bug: the blocks are recomputed, never used
            first = next((layer for layer in layers if not self.ready[layer].is_set()), None)
            self.problem = f"layer {first}: {e}" if first is not None else str(e)
        for layer in layers:        # not published: every block of the layer fails (no later use)
            if not self.ready[layer].is_set():
                self.ok[layer] = [False] * len(self.keys)
                self.ready[layer].set()

    def cancel(self) -> None:
        """Stop the load; when this returns, nothing more is written into the cache or staging."""
        self._cancel.set()
        with self._writing:         # a copy that began before the flag has ended; none follows
            pass


@dataclass
class _Save:
    transfers: list[BlockTransfer]
    block_ids: list[int]
    keys: list[bytes]
    staging: torch.Tensor            # (n, num_layers, 2, rank_heads, bs, hd); CUDA: (num_layers, n, ...)
    layers_done: list[bool]
    device_ids: object = None        # CUDA: the step's block ids on the device, after its first layer


class WorkerTransfers:
    """Loads and saves of one TP rank.

    Args:
        client: the daemon's client behind its breaker (:class:`engine_adapter.store_io.GuardedStore`).
        layer_names: vLLM's attention layer names in layer order.
        kv_caches: ``layer name -> cache tensor`` as vLLM registers it.
        kv_layout: ``"token"``, ``"cpu"`` or ``"kv_first"`` (:mod:`engine_adapter.vllm.kv_views`).
        layout: payload layout (all KV heads of the model).
        heads: ``[h0, h1)``, the model KV heads this rank's cache holds.
        is_first_rank: TP rank 0 (the one that puts).
        gather_heads: TP>1 head gather (a collective every rank calls in ``end_step``).
        timeout_s: deadline of each store call; load_timeout_s: wait for one layer.
        max_pending_saves: steps' saves queued for the writer; beyond it a step's save is
            dropped (a later miss, never wrong KV) rather than stalling the engine.
        direct_loads: page back straight into the cache where it allows (the ``"cpu"``
            layout, every layer's tensor on the CPU and contiguous): no staging copy and no
            scatter before a layer's attention. False, or another cache: staged (the twin
            that tests compare it with).
    """

    def __init__(self, client, layer_names: Sequence[str], kv_caches: dict[str, torch.Tensor], kv_layout: str,
                 layout: BlockLayout, heads: tuple[int, int], *, is_first_rank: bool = True,
                 gather_heads: GatherHeads | None = None, timeout_s: float = 10.0, load_timeout_s: float = 30.0,
                 max_pending_saves: int = 64, direct_loads: bool = True):
        self.client = client
        self.layout = layout
        self.heads = heads
        self.is_first_rank = is_first_rank
        self.gather_heads = gather_heads
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        if len(self.layer_index) != layout.num_layers:
            raise ValueError(f"{len(self.layer_index)} KV cache layers for a {layout.num_layers}-layer layout")
        self.views, self.kernel_layout = [], "HND"
        for name in layer_names:
            kv = kv_caches[name]
            if kv.dtype != layout.dtype:
                raise ValueError(f"layer {name} cache is {kv.dtype}, the store namespace says {layout.dtype}")
            view, self.kernel_layout = kernel_view(kv, kv_layout, layout.head_dim)
            self.views.append(view)
        caches = [kv_caches[name] for name in layer_names]
        self._cuda = CudaSaves(caches[0].device) if caches[0].is_cuda else None
        self.direct = caches if direct_loads and kv_layout == "cpu" and all(
            kv.device.type == "cpu" and kv.is_contiguous() for kv in caches) else None
        shape = self.views[0].shape
        cache_heads = shape[2] if self.kernel_layout == "HND" else shape[3]
        cache_bs = shape[3] if self.kernel_layout == "HND" else shape[2]
        if cache_heads != heads[1] - heads[0] or cache_bs != layout.block_tokens:
            raise ValueError(f"cache holds {cache_heads} KV heads x {cache_bs} tokens per block; expected "
                             f"{heads[1] - heads[0]} x {layout.block_tokens}")
        self._plan: StepPlan | None = None
        self._load: _LayerLoads | None = None
        self._loader: KeptThread | None = None
        self._last_load: _LayerLoads | None = None
        self._load_valid: list[int] = []        # per load transfer: leading blocks usable so far
        self._waited: list[bool] = []
        self._load_ids: dict = {}               # CUDA: (transfer, blocks) -> ids on the device, per step
        self._errors: set[int] = set()
        self._save: _Save | None = None
        self.blocks_loaded = self.blocks_saved = self.save_failures = self.saves_dropped = 0
        self._behind = self._put_failing = False        # logged once until the writer catches up / a put works
        self._writes = BackgroundJobs(self._write, "kvstore-vllm-save", max_pending_saves)

    # ------------------------------------------------------------ loads

    def bind(self, plan: StepPlan) -> None:
        """Take the step's plan (when vLLM binds the metadata, before the forward): prepares
        the save staging. vLLM calls ``start_load_kv`` after the forward when the step has
        no synchronous loads, so saves must not wait for it."""
        self._plan = plan
        self._load = None
        self._save = None
        if plan.saves:
            ids = [b for t in plan.saves for b in t.block_ids]
            nh, lay = self.heads[1] - self.heads[0], self.layout
            if self._cuda is not None:
                staging = self._cuda.staging(len(ids), lay.num_layers, nh, lay.block_tokens, lay.head_dim, lay.dtype)
            else:
                staging = torch.empty((len(ids), lay.num_layers, 2, nh, lay.block_tokens, lay.head_dim),
                                      dtype=lay.dtype)
            self._save = _Save(list(plan.saves), ids, [k for t in plan.saves for k in t.keys], staging,
                               [False] * self.layout.num_layers)

    def start_load(self) -> None:
        """Start the loader thread of the bound plan's loads (once per step)."""
        plan = self._plan
        if plan is None or not plan.loads or self._load is not None:
            return
        self._load = _LayerLoads(self.client, plan.loads, self.layout, self.heads, self.timeout_s, self.direct,
                                 start=self._start_loader, pin=self._cuda is not None)
        self._last_load = self._load
        self._load_valid = [len(t.keys) for t in plan.loads]
        self._waited = [False] * self.layout.num_layers
        self._load_ids = {}
        self._deadline = time.monotonic() + self.load_timeout_s

    def _start_loader(self, job: Callable[[], None]) -> None:
        """Run a step's load on the kept loader thread, or on a new one when it still runs
        an earlier load still waiting on the store (a layer not published; that thread then
        ends). An earlier load with every layer published is only returning: its thread is
        waited for (at most :data:`LOADER_RETURN_S`)."""
        last = self._last_load
        wait_s = LOADER_RETURN_S if last is None or all(e.is_set() for e in last.ready) else 0.0
        if self._loader is None or not self._loader.run(job, wait_s):
            if self._loader is not None:
                self._loader.retire()
            self._loader = KeptThread("kvstore-vllm-load")
            self._loader.run(job)

    def _fail(self, i: int, first_bad: int) -> None:
        """Transfer ``i``'s blocks from ``first_bad`` on are not used: report them."""
        t = self._load.loads[i]
        if first_bad < self._load_valid[i]:
            self._errors.update(t.block_ids[first_bad:])
            self._load_valid[i] = first_bad

    def wait_layer(self, name: str) -> None:
        load = self._load
        if load is None or name not in self.layer_index:
            return
        layer = self.layer_index[name]
        if self._waited[layer]:
            return
        self._waited[layer] = True
        if not load.ready[layer].wait(max(0.0, self._deadline - time.monotonic())):
            load.cancel()
            log.warning("kvstore page back of layer %d not done in %.1fs: recomputing", layer, self.load_timeout_s)
            for i in range(len(load.loads)):
                self._fail(i, 0)
            return
        ok, start = load.ok[layer], 0
        for i, t in enumerate(load.loads):
            n = len(t.keys)
            lead = next((j for j in range(n) if not ok[start + j]), n)
            if lead < self._load_valid[i]:
                log.warning("kvstore block %d of request %s unusable in layer %d%s: recomputing from it",
                            lead, t.req_id, layer, f" ({load.problem})" if load.problem else "")
                self._fail(i, lead)
            valid = self._load_valid[i]
            if valid and load.staging is not None:
                src = load.staging[layer][start:start + valid]     # pinned for a CUDA cache: no sync
                ids = list(t.block_ids[:valid])
                if self._cuda is not None:          # checked and copied once for every layer
                    ids = self._cuda.ids_once(self._load_ids, (i, valid), ids, self.views[layer], self.kernel_layout)
                    src = src.to(self.views[layer].device, non_blocking=True)   # staging left alone after
                scatter_blocks([self.views[layer]], ids, src, heads=None, layers=[0], layout=self.kernel_layout)
            start += n

    # ------------------------------------------------------------ saves

    def save_layer(self, name: str) -> None:
        save = self._save
        if save is None or name not in self.layer_index:
            return
        layer = self.layer_index[name]
        if self._cuda is not None:      # queued off the forward's stream; the host does not wait
            save.device_ids = self._cuda.copy_layer(self.views[layer], save.device_ids or save.block_ids,
                                                    self.kernel_layout, save.staging[layer])
        else:
            gather_blocks([self.views[layer]], save.block_ids, layers=[0], layout=self.kernel_layout,
                          out=save.staging[:, layer:layer + 1])
        save.layers_done[layer] = True

    def end_step(self) -> None:
        """After the step's forward: check loads were applied, hand saves to the writer."""
        plan, self._plan = self._plan, None
        if plan is not None and plan.loads and self._load is None:
            log.error("vLLM ran the step without starting the KV loads; reporting the blocks as failed")
            self._errors.update(b for t in plan.loads for b in t.block_ids)
        load = self._load
        if load is not None:
            if not all(self._waited):
                log.error("vLLM did not wait for every layer's KV load; reporting the loaded blocks as failed")
                for i in range(len(load.loads)):
                    self._fail(i, 0)
            self.blocks_loaded += sum(self._load_valid)
            load.cancel()
            self._load = None
        save, self._save = self._save, None
        if save is None:
            return
        if not all(save.layers_done):
            log.error("KV of %d blocks was not copied for every layer; not storing them", len(save.keys))
            return
        rows, ready = save.staging, None
        if self._cuda is not None:
            ready = self._cuda.finish()
            if self.gather_heads is not None:    # the collective reads the host copies: wait for them now
                ready.synchronize()
                rows, ready = rows_of(rows), None
        full = self.gather_heads(rows) if self.gather_heads is not None else rows
        if full is None or not self.is_first_rank:
            return
        if not self._writes.submit(save.keys, full if ready is not None else full.contiguous(), save.transfers,
                                   ready, block=False):
            self.saves_dropped += 1
            if not self._behind:
                log.warning("kvstore writer is %d steps behind; not storing the blocks of the steps that find "
                            "it full (counted in saves_dropped) until it catches up", self._writes.max_pending)
            self._behind = True
        else:
            self._behind = False

    def _write(self, keys, full, transfers: list[BlockTransfer], ready: torch.cuda.Event | None = None) -> None:
        """Store a step's saves: ``full`` is ``(n, layers, 2, heads, bs, hd)``, or with ``ready``
        (a CUDA cache) the layer-major staging, read once its copies are done."""
        metas = [t.block_meta() for t in transfers]
        meta = None
        if any(m is not None for m in metas):
            meta = [b for t, m in zip(transfers, metas) for b in (m if m is not None else [None] * len(t.keys))]
        try:
            if ready is not None:           # a CUDA error here is counted as the save's failure
                ready.synchronize()
                full = rows_of(full)
            store_io.save_blocks(self.client, keys, full, meta=meta, timeout_s=self.timeout_s)
        except StoreUnavailable:            # failing or skipped: the breaker logs and counts it
            self.save_failures += 1
            return
        except KVStoreError as e:
            self.save_failures += 1
            if not self._put_failing:
                log.warning("kvstore put of %d blocks failed (%s); they will be recomputed when needed. "
                            "Further failures are logged at debug level until a put succeeds.", len(keys), e)
            else:
                log.debug("kvstore put of %d blocks failed: %s", len(keys), e)
            self._put_failing = True
            return
        except Exception:
            self.save_failures += 1
            raise
        self.blocks_saved += len(keys)
        self._put_failing = False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued puts are done; False when ``timeout_s`` passed first."""
        return self._writes.flush(timeout_s)

    def take_load_errors(self) -> set[int]:
        """Cache block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors


def assemble_heads(parts, bounds, num_kv_heads: int) -> torch.Tensor:
    """Full-head blocks from the TP ranks' parts ``(n, L, 2, rank_heads, bs, hd)`` and their
    head ranges (replicated heads, TP > KV heads, are taken once)."""
    n, L, _, _, bs, hd = parts[0].shape
    full = torch.empty((n, L, 2, num_kv_heads, bs, hd), dtype=parts[0].dtype)
    for part, (h0, h1) in zip(parts, bounds):
        full[:, :, :, h0:h1] = part
    return full
