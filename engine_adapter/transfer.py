"""Moving blocks between a TP rank and the store in background threads.

- :class:`BlockStore` is what the adapter needs from the store (the subset of
  :class:`kvstore.client.KVStoreClient` it calls), so tests can pass an in-memory fake.
- :class:`LayerLoader` pages back a prefix layer by layer in a loader thread: it
  fetches this rank's KV heads of layer 0 for every hit block, publishes them, then
  layer 1, ...; the forward pass waits for layer ``N`` just before layer ``N``'s
  attention, so loading layer ``N`` overlaps computing layer ``N - 1``. The loader only
  fills its own staging tensors; the forward thread copies them into the paged cache,
  so a loader abandoned on a timeout can never write into the cache late.
- :class:`StoreWriter` stores new full blocks in a writer thread so the next prefill
  or decode step does not wait for the store.

TP>1 store: every rank copies its KV heads of the new blocks out of its paged cache
(synchronously, so the cache blocks may be reused as soon as :meth:`StoreWriter.submit`
returns); the writer threads then gather the heads to TP rank 0 over a process group
of their own, and rank 0 puts the full-head payload (``docs/block_layout.md``). Each
job's tensors belong to that job alone and are dropped only after ``put`` returned,
i.e. after the client copied the bytes into its request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from kvstore.errors import KVStoreError
from kvstore.types import GetResult, LookupResult

from .layout import BlockLayout
from .tp import TPGroup

log = logging.getLogger("engine_adapter.transfer")


class BlockStore(Protocol):
    """The store calls the adapter makes; :class:`kvstore.client.KVStoreClient` implements it.

    Every method raises :class:`kvstore.errors.KVStoreError` (e.g. ``StoreUnavailable``)
    on failure; a miss is a normal result, never an exception.
    """

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult: ...

    def get(self, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]] | None = None,
            stop_at_miss: bool = False, timeout: float | None = None) -> list[GetResult]: ...

    def put(self, blocks, timeout: float | None = None): ...

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int: ...

    def check_block_tokens(self, block_tokens: int) -> None:
        """Raise :class:`kvstore.errors.InvalidRequest` when the node is configured for
        another block size (``[blocks] block_tokens``)."""


@dataclass(frozen=True)
class LayerLoad:
    """What the loader delivered for one layer.

    Attributes:
        valid_blocks: leading blocks of the prefix whose KV arrived intact.
        data: ``(valid_blocks, 1, 2, kv_heads_of_rank, block_tokens, head_dim)`` in the KV
            dtype (``[block][layer][k|v][head][token][dim]``), or ``None`` when nothing arrived.
        problem: why fewer blocks than asked arrived (missing, corrupt, store error,
            timeout); ``None`` when all did.
    """

    valid_blocks: int
    data: torch.Tensor | None
    problem: str | None = None


class LayerLoader:
    """Pages back ``keys`` (this rank's KV heads ``heads``) layer by layer in a thread.

    The valid prefix only shrinks: after block ``j`` is missing or corrupt in some
    layer, later layers are fetched for blocks ``[0, j)`` only.

    Args:
        store: where the blocks are.
        keys: the agreed hit blocks' keys, in prefix order.
        layout: the payload layout.
        heads: ``[h0, h1)``, this rank's KV heads.
        call_timeout_s: deadline of each store call, seconds.
    """

    def __init__(self, store: BlockStore, keys: Sequence[bytes], layout: BlockLayout,
                 heads: tuple[int, int], call_timeout_s: float):
        self.store = store
        self.keys = list(keys)
        self.layout = layout
        self.heads = heads
        self.call_timeout_s = call_timeout_s
        self._results: list[LayerLoad | None] = [None] * layout.num_layers
        self._ready = [threading.Event() for _ in range(layout.num_layers)]
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-page-back", daemon=True)

    def start(self) -> "LayerLoader":
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop after the call in flight; waits that follow return what was published."""
        self._cancelled.set()

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

    def _fetch(self, layer: int, valid: int) -> LayerLoad:
        h0, h1 = self.heads
        layout = self.layout
        got = self.store.get(self.keys[:valid], ranges=layout.layer_ranges(layer, self.heads),
                             stop_at_miss=True, timeout=self.call_timeout_s)
        buf = torch.empty((valid, 1, 2, h1 - h0, layout.block_tokens, layout.head_dim), dtype=layout.dtype)
        for i in range(valid):
            r = got[i] if i < len(got) else None
            if r is None or not r.found or r.key != self.keys[i]:
                return LayerLoad(i, buf[:i], f"block {i} missing in layer {layer}")
            try:
                layout.copy_payload(r.data, buf[i])
            except ValueError as e:
                return LayerLoad(i, buf[:i], f"block {i} corrupt in layer {layer}: {e}")
        return LayerLoad(valid, buf)

    def _run(self) -> None:
        valid = len(self.keys)
        problem: str | None = None
        for layer in range(self.layout.num_layers):
            if self._cancelled.is_set():
                break
            if valid:
                try:
                    result = self._fetch(layer, valid)
                except KVStoreError as e:
                    result = LayerLoad(0, None, f"store error in layer {layer}: {e}")
                except Exception as e:  # a bug here must not hang or kill the forward pass
                    log.exception("page back of layer %d failed", layer)
                    result = LayerLoad(0, None, f"loader failed in layer {layer}: {e!r}")
                valid = result.valid_blocks
                problem = result.problem or problem
            else:
                result = LayerLoad(0, None, problem)
            self._results[layer] = result
            self._ready[layer].set()


class StoreWriter:
    """Stores new full blocks in a background thread (on every TP rank; rank 0 puts).

    Args:
        store: destination; ``None`` on a rank that never puts (jobs still join the
            head gather so the ranks stay in step).
        layout: the payload layout.
        tp: this rank's collectives (the gather uses ``tp.store_group``).
        call_timeout_s: deadline of each put, seconds.
        max_pending: queued jobs before :meth:`submit` blocks (bounds staging memory).
    """

    def __init__(self, store: BlockStore | None, layout: BlockLayout, tp: TPGroup,
                 call_timeout_s: float, max_pending: int = 64):
        self.store = store
        self.layout = layout
        self.tp = tp
        self.call_timeout_s = call_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pending = 0
        self._idle = threading.Condition()
        self._failing = False
        self.blocks_stored = 0
        self.put_failures = 0
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[bytes], kv: torch.Tensor) -> None:
        """Queue blocks for storing.

        Args:
            keys: one key per block.
            kv: ``(len(keys), num_layers, 2, kv_heads_of_rank, block_tokens, head_dim)``,
                owned by the job from now on (the caller must not write to it).
        """
        if len(keys) != kv.shape[0]:
            raise ValueError(f"{len(keys)} keys for {kv.shape[0]} blocks")
        with self._idle:
            self._pending += 1
        self._queue.put((list(keys), kv))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted job is done; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued jobs (up to ``timeout_s``) and stop the thread."""
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _put(self, keys: list[bytes], kv: torch.Tensor) -> None:
        full = self.tp.gather_heads_to_first(kv, head_dim_index=3)
        if full is None or self.store is None:
            return
        blocks = [(k, self.layout.to_payload(full[i])) for i, k in enumerate(keys)]
        try:
            self.store.put(blocks, timeout=self.call_timeout_s)
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

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._put(*job)
            except Exception:  # never let the writer die: later jobs would hang flush()
                log.exception("background store of %d blocks failed", len(job[0]))
            finally:
                del job
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
