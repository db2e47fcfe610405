"""Moving blocks between a TP rank and the store in background threads.

- :class:`BlockStore` is what the adapter needs from the store (the subset of
  :class:`kvstore.client.KVStoreClient` it calls), so tests can pass an in-memory fake.
- :class:`LayerLoader` pages back a prefix in a loader thread. From a store that leases
  (a :class:`kvstore.client.KVStoreClient`, behind its breaker or not:
  ``store_io.offers_leased_read``), one store call for the page back: every hit block
  read from the block table or leased, once, and this rank's KV heads copied out of it layer by layer straight into
  the loader's staging tensor, each layer published when copied
  (``store_io.load_stages``). From any other :class:`BlockStore`, the batch-first
  ``get_into``: one call per group of layers (growing groups: layer 0, layers 1-2,
  3-6, 7-14, ... so layer 0 arrives early and a page back of ``L`` layers takes about
  ``log2(L)`` calls). Every byte of the rank's heads is read once either way. The
  forward pass waits for layer ``N`` just before layer ``N``'s
  attention, so loading a group overlaps computing the layers before it. The loader
  only fills its own staging tensor; the forward thread copies from it into the paged
  cache, so a loader abandoned on a timeout can never write into the cache late.
- :class:`StoreWriter` stores new full blocks in a writer thread (``put_from``) so the
  next prefill or decode step does not wait for the store; each block's token ids and its
  parent's key go with it (``BlockMeta``), which the daemon's KV events announce.

TP>1 store: every rank copies its KV heads of the new blocks out of its paged cache
(synchronously, so the cache blocks may be reused as soon as :meth:`StoreWriter.submit`
returns); the writer threads then gather the heads to TP rank 0 over a process group
of their own, and rank 0 puts the full-head payload (``docs/block_layout.md``). Each
job's tensors belong to that job alone and are dropped only after ``put_from``
returned, i.e. after the client copied the bytes out of them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from kvstore.client.client import GetIntoResult
from kvstore.common.errors import KVStoreError, StoreUnavailable
from kvstore.common.types import BlockMeta, LookupResult, PutResult

from engine_adapter import store_io
from engine_adapter.background import BackgroundJobs
from engine_adapter.layout import BlockLayout
from engine_adapter.reference.tp import TPGroup

log = logging.getLogger("engine_adapter.reference.transfer")


class BlockStore(Protocol):
    """The store calls the adapter makes; :class:`kvstore.client.KVStoreClient` implements it.

    Every method raises :class:`kvstore.common.errors.KVStoreError` (e.g. ``StoreUnavailable``,
    ``InvalidRequest`` for malformed ranges or a buffer too small) on failure; a miss is a
    normal result, never an exception (a range past a block's end makes that block a miss).
    """

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult: ...

    def get_into(self, keys: Sequence[bytes], out: Any, *, ranges: Sequence[tuple[int, int]] | None = None,
                 offsets: Sequence[int] | None = None, stop_at_miss: bool = True,
                 timeout: float | None = None) -> GetIntoResult:
        """Copy each block (or its ``ranges``, concatenated) into ``out`` (one buffer per
        key, or one buffer with the blocks at byte ``offsets``); with ``stop_at_miss``
        copying stops at the first miss (``found`` is the hit prefix)."""
        ...

    def put_from(self, keys: Sequence[bytes], src: Any, *, sizes: Sequence[int] | int | None = None,
                 offsets: Sequence[int] | None = None, meta: Sequence[BlockMeta | None] | None = None,
                 timeout: float | None = None) -> PutResult:
        """Store ``keys`` from ``src`` (one buffer per key, or one buffer of ``sizes``-byte
        blocks back to back or at ``offsets``); ``meta``: per block, what the daemon's KV
        events announce it by."""
        ...

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int: ...

    def check_block_tokens(self, block_tokens: int) -> None:
        """Raise :class:`kvstore.common.errors.InvalidRequest` when the node is configured for
        another block size (``[blocks] block_tokens``)."""
        ...

    def ping(self, timeout: float = 1.0) -> object:
        """Return when the store answers within ``timeout`` seconds; raise
        :class:`kvstore.common.errors.StoreUnavailable` otherwise (the breaker's probe)."""


def layer_groups(num_layers: int, first: int = 1) -> list[tuple[int, int]]:
    """``[l0, l1)`` layer groups of a page back: ``first`` layers, then twice as many as
    the group before; a group also takes the layers left after it when they are fewer
    than its own (no small call at the end). ``layer_groups(4) == [(0, 1), (1, 4)]``,
    ``layer_groups(32)`` is 1, 2, 4, 8, 17 layers. Each group is loaded while the
    layers before it compute, so a load per layer up to the compute per layer hides.
    """
    if num_layers < 1 or first < 1:
        raise ValueError(f"need num_layers >= 1 and first >= 1, got {num_layers}, {first}")
    groups, start, size = [], 0, first
    while start < num_layers:
        end = min(start + size, num_layers)
        if num_layers - end < size:
            end = num_layers
        groups.append((start, end))
        start, size = end, size * 2
    return groups


def _layers_name(l0: int, l1: int) -> str:
    return f"layer {l0}" if l1 - l0 == 1 else f"layers {l0}-{l1 - 1}"


@dataclass(frozen=True)
class LayerLoad:
    """What the loader delivered for one layer.

    Attributes:
        valid_blocks: leading blocks of the prefix whose KV arrived intact.
        data: ``(valid_blocks, 1, 2, kv_heads_of_rank, block_tokens, head_dim)`` in the KV
            dtype (``[block][layer][k|v][head][token][dim]``; a view of the loader's
            staging tensor), or ``None`` when nothing arrived.
        problem: why fewer blocks than asked arrived (missing, corrupt, store error,
            timeout); ``None`` when all did.
    """

    valid_blocks: int
    data: torch.Tensor | None
    problem: str | None = None


class LayerLoader:
    """Pages back ``keys`` (this rank's KV heads ``heads``) group of layers by group in a thread.

    From a store that leases (``store_io.offers_leased_read``): one ``store_io.load_stages``
    of every layer (one stage per layer, published as copied); a block missing or short
    in layer ``l`` ends the valid prefix there for ``l`` and every later layer. Otherwise
    each group is one ``store.get_into(keys[:valid], staging, ranges=<the group's k and v
    ranges of this rank's heads>, offsets=<block i at staging[i, l0]>, stop_at_miss=True)``.
    A block counts as arrived when it lies in the hit prefix the call reports and its
    size is exactly the bytes asked for (a short block is corrupt). The valid prefix
    only shrinks: after block ``j`` is missing or corrupt in some group, later groups
    are fetched for blocks ``[0, j)`` only.

    Args:
        store: where the blocks are.
        keys: the agreed hit blocks' keys, in prefix order.
        layout: the payload layout.
        heads: ``[h0, h1)``, this rank's KV heads.
        call_timeout_s: deadline of each store call, seconds.
        staging: where the blocks land: a contiguous CPU tensor
            ``(len(keys), num_layers, 2, h1 - h0, block_tokens, head_dim)`` of the KV
            dtype that nobody else writes while this loader runs (default: a new one).
        groups: ``[l0, l1)`` layer groups in order, covering every layer once
            (default :func:`layer_groups`).
    Attributes:
        calls: store calls made so far (``get_into`` calls; from a store that leases, its
            round trips, Lease and Get, counted once the read ended: not :attr:`running`).
        bytes_received: bytes the store copied into the staging tensor (this rank's
            heads of the blocks that arrived, and of a short block).
        load_s: seconds from :meth:`start` until the latest group of layers was
            published (after the last group: the whole page back); None before.
    Raises:
        ValueError: a staging tensor of the wrong shape, dtype or layout, or groups that
            do not cover the layers in order.
    """

    def __init__(self, store: BlockStore, keys: Sequence[bytes], layout: BlockLayout,
                 heads: tuple[int, int], call_timeout_s: float, staging: torch.Tensor | None = None,
                 groups: Sequence[tuple[int, int]] | None = None):
        self.store = store
        self.keys = list(keys)
        self.layout = layout
        self.heads = heads
        self.call_timeout_s = call_timeout_s
        shape = (len(self.keys),) + layout.block_shape(heads=heads[1] - heads[0])
        if staging is None:
            staging = torch.empty(shape, dtype=layout.dtype)
        if (tuple(staging.shape) != shape or staging.dtype != layout.dtype or not staging.is_contiguous()
                or staging.device.type != "cpu"):
            raise ValueError(f"staging must be a contiguous CPU tensor {shape} {layout.dtype}, got "
                             f"{tuple(staging.shape)} {staging.dtype} on {staging.device}")
        self.staging = staging
        self.groups = list(groups) if groups is not None else layer_groups(layout.num_layers)
        if [g[0] for g in self.groups] != [0] + [g[1] for g in self.groups[:-1]] or \
                self.groups[-1][1] != layout.num_layers or any(g[1] <= g[0] for g in self.groups):
            raise ValueError(f"layer groups {self.groups} do not cover layers 0..{layout.num_layers - 1} in order")
        self.calls = 0
        self.bytes_received = 0
        self.load_s: float | None = None
        self._t0 = time.perf_counter()
        self._results: list[LayerLoad | None] = [None] * layout.num_layers
        self._ready = [threading.Event() for _ in range(layout.num_layers)]
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-page-back", daemon=True)

    def start(self) -> "LayerLoader":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop after the call in flight; waits that follow return what was published."""
        self._cancelled.set()

    @property
    def running(self) -> bool:
        """True while the loader thread may still write into its staging tensor."""
        return self._thread.is_alive()

    def wait(self, layer: int, deadline: float) -> LayerLoad:
        """Block until ``layer`` is delivered or ``time.monotonic()`` passes ``deadline``.

        Returns the layer's :class:`LayerLoad`; on a timeout one with no valid block
        (and the loader is cancelled). Never raises for store trouble.
        """
        if not self._ready[layer].wait(timeout=max(0.0, deadline - time.monotonic())):
            self.cancel()
            return LayerLoad(0, None, f"layer {layer} not paged back before the load timeout")
        result = self._results[layer]
        assert result is not None
        return result

    def _fetch(self, l0: int, l1: int, valid: int) -> tuple[int, str | None]:
        """One ``get_into`` of layers ``[l0, l1)`` for blocks ``[0, valid)``; returns the
        blocks that arrived intact and why the others did not."""
        stage = self.staging
        block_bytes = stage[0].nbytes
        layer_bytes = stage[0, 0].nbytes
        want = (l1 - l0) * layer_bytes
        self.calls += 1
        got = self.store.get_into(self.keys[:valid], stage, ranges=self.layout.group_ranges((l0, l1), self.heads),
                                  offsets=[i * block_bytes + l0 * layer_bytes for i in range(valid)],
                                  stop_at_miss=True, timeout=self.call_timeout_s)
        self.bytes_received += sum(got.sizes)
        where = _layers_name(l0, l1)
        for i in range(valid):
            if i >= got.found or i >= len(got.sizes) or got.sizes[i] == 0:
                return i, f"block {i} missing in {where}"
            if got.sizes[i] != want:
                return i, f"block {i} corrupt in {where}: {got.sizes[i]} bytes, expected {want}"
        return valid, None

    def _run(self) -> None:
        if store_io.offers_leased_read(self.store):
            self._run_leased()
            return
        valid = len(self.keys)
        problem: str | None = None
        for l0, l1 in self.groups:
            if self._cancelled.is_set():
                break
            if valid:
                where = _layers_name(l0, l1)
                try:
                    valid, new = self._fetch(l0, l1, valid)
                except KVStoreError as e:
                    valid, new = 0, f"store error in {where}: {e}"
                except Exception as e:  # a bug here must not hang or kill the forward pass
                    log.exception("page back of %s failed", where)
                    valid, new = 0, f"loader failed in {where}: {e!r}"
                problem = new or problem
            self._deliver(l0, l1, valid, problem)

    def _run_leased(self) -> None:
        """The page back as one leased read of every layer (see the class docstring)."""
        stage = self.staging
        n, block_bytes, layer_bytes = len(self.keys), stage[0].nbytes, stage[0, 0].nbytes
        stages = [store_io.ReadStage(self.layout.group_ranges((layer, layer + 1), self.heads), stage,
                                     offsets=[i * block_bytes + layer * layer_bytes for i in range(n)])
                  for layer in range(self.layout.num_layers)]
        state = {"valid": n, "problem": None}

        def publish(layer: int, sizes: list[int]) -> None:
            valid = state["valid"]
            bad = next((i for i in range(valid) if sizes[i] != layer_bytes), valid)
            if bad < valid:
                state["valid"], state["problem"] = bad, f"block {bad} missing or short in layer {layer}"
            self.bytes_received += sum(sizes)
            self._deliver(layer, layer + 1, state["valid"], state["problem"])

        try:
            self.calls = store_io.load_stages(self.store, self.keys, stages, timeout_s=self.call_timeout_s,
                                              publish=publish, cancelled=self._cancelled.is_set).calls
        except Exception as e:  # store trouble or a bug: the layers not delivered have no valid block
            first = next((layer for layer, r in enumerate(self._results) if r is None), self.layout.num_layers)
            if isinstance(e, KVStoreError):
                problem = f"store error in {_layers_name(first, self.layout.num_layers)}: {e}"
            else:
                log.exception("page back from layer %d on failed", first)
                problem = f"loader failed in {_layers_name(first, self.layout.num_layers)}: {e!r}"
            if first < self.layout.num_layers and not self._cancelled.is_set():
                self._deliver(first, self.layout.num_layers, 0, problem)

    def _deliver(self, l0: int, l1: int, valid: int, problem: str | None) -> None:
        """Publish layers ``[l0, l1)`` with ``valid`` leading blocks."""
        for layer in range(l0, l1):
            data = self.staging[:valid, layer:layer + 1] if valid else None
            self._results[layer] = LayerLoad(valid, data, problem)
        self.load_s = time.perf_counter() - self._t0
        for layer in range(l0, l1):
            self._ready[layer].set()


class StoreWriter:
    """Stores new full blocks in a background thread (on every TP rank; rank 0 puts).

    Args:
        store: destination; ``None`` on a rank that never puts (jobs still join the
            head gather so the ranks stay in step).
        layout: the payload layout.
        tp: this rank's collectives (the gather uses ``tp.store_group``).
        call_timeout_s: deadline of each put, seconds.
        max_pending: queued jobs at most (bounds staging memory). At TP=1 a job that
            finds the queue full is dropped and counted (``jobs_dropped``, one warning
            until the queue has room again): a store that is slow or gone never stalls
            the engine. At TP>1 :meth:`submit` waits for room instead: every rank's
            writer takes part in each job's head gather, so the ranks must agree on
            the jobs; jobs are quick while the store's breaker is open (no put is made).

    Attributes: ``blocks_stored``, ``put_failures`` (puts that failed or were skipped
    while the store's breaker was open), ``jobs_dropped``, ``blocks_dropped``.
    """

    def __init__(self, store: BlockStore | None, layout: BlockLayout, tp: TPGroup,
                 call_timeout_s: float, max_pending: int = 64):
        self.store = store
        self.layout = layout
        self.tp = tp
        self.call_timeout_s = call_timeout_s
        self._failing = False
        self._behind = False
        self.blocks_stored = 0
        self.put_failures = 0
        self.jobs_dropped = self.blocks_dropped = 0
        self._jobs = BackgroundJobs(self._put, "kv-store-writer", max_pending)

    def submit(self, keys: Sequence[bytes], kv: torch.Tensor, meta: Sequence[BlockMeta] | None = None) -> None:
        """Queue blocks for storing.

        Args:
            keys: one key per block.
            kv: ``(len(keys), num_layers, 2, kv_heads_of_rank, block_tokens, head_dim)``,
                owned by the job from now on (the caller must not write to it).
            meta: one per block (token ids, parent), or None.
        """
        if len(keys) != kv.shape[0] or (meta is not None and len(meta) != len(keys)):
            raise ValueError(f"{len(keys)} keys for {kv.shape[0]} blocks and {len(meta or keys)} block metas")
        if self._jobs.submit(list(keys), kv, list(meta) if meta is not None else None,
                             block=self.tp.world_size > 1):
            self._behind = False
            return
        self.jobs_dropped += 1
        self.blocks_dropped += len(keys)
        if not self._behind:
            log.warning("the store writer has %d jobs queued; not storing the blocks of new jobs (counted in "
                        "jobs_dropped) until it has room", self._jobs.max_pending)
        self._behind = True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted job is done; False if ``timeout_s`` passed first."""
        return self._jobs.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued jobs (up to ``timeout_s``) and stop the thread."""
        self._jobs.close(timeout_s)

    def _put(self, keys: list[bytes], kv: torch.Tensor, meta: list[BlockMeta] | None) -> None:
        full = self.tp.gather_heads_to_first(kv, head_dim_index=3)
        if full is None or self.store is None:
            return
        shape = (len(keys),) + self.layout.block_shape()
        if tuple(full.shape) != shape or full.dtype != self.layout.dtype:
            raise ValueError(f"blocks to store must be {shape} {self.layout.dtype}, got {tuple(full.shape)} {full.dtype}")
        try:       # one buffer, block i at i * block_bytes: the payload layout of docs/block_layout.md
            self.store.put_from(keys, full.contiguous(), sizes=self.layout.block_bytes, meta=meta,
                                timeout=self.call_timeout_s)
        except StoreUnavailable:            # failing or skipped: the store's breaker logs and counts it
            self.put_failures += 1
            return
        except KVStoreError as e:
            self.put_failures += 1
            if not self._failing:
                log.warning("storing %d blocks failed (%s); they will be recomputed when needed. "
                            "Further put failures are logged at debug level until one succeeds.",
                            len(keys), e)
            else:
                log.debug("storing %d blocks failed: %s", len(keys), e)
            self._failing = True
            return
        self._failing = False
        self.blocks_stored += len(keys)
