"""The adapter between a TP rank's paged KV cache and the store.

Before a prefill (:meth:`PageBackAdapter.plan`):

1. compute the prompt's chained block keys (:class:`kvstore.common.keys.BlockKeyer`);
2. Lookup the longest stored prefix, at most ``(len(prompt) - 1) // block_tokens``
   blocks so at least one token is prefilled (its logits give the first output token);
3. agree on the hit length with every TP rank: a MIN all-reduce, before anything is
   loaded (SGLang's HiCache keeps its ranks in lockstep the same way);
4. start a :class:`~engine_adapter.reference.transfer.LayerLoader` for this rank's KV heads: it
   fetches them with ``get_into`` into a staging tensor, one call per growing group
   of layers, each byte once.

During the prefill, :class:`PageBackGate` is the model's per-layer hook: it waits for
the layer's blocks, copies them into the paged cache (``kernels.scatter_blocks``: the torch reference, or the CUDA kernels for a GPU cache)
and MIN-all-reduces how many blocks every rank actually received. When some rank got
fewer (a block deleted or corrupt since the lookup, the store gone, a timeout), every
rank raises :class:`PageBackShortfall` at the same layer and the runner restarts the
prefill from the new, shorter hit: those tokens are recomputed, with a warning, and
the logits are the same as with no store at all.

After a prefill or a decode step that fills a block, :meth:`PageBackAdapter.store_new_blocks`
copies the new full blocks out of the cache (``kernels.gather_blocks``) into host memory
and hands them to the background :class:`~engine_adapter.reference.transfer.StoreWriter`.

The store sits behind a circuit breaker (:class:`engine_adapter.store_io.GuardedStore`):
a lookup has a deadline of tens of milliseconds (``EngineConfig.lookup_timeout_s``), and
after a store failure no call is made (a zero hit, no page back, stores dropped) until
the store answers a probe; the breaker logs the outage once and a summary at its end.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from kernels import gather_blocks, scatter_blocks
from kvstore.common.errors import KVStoreError, StoreUnavailable
from kvstore.common.keys import BlockKeyer, chain_key
from kvstore.common.types import BlockMeta

from engine_adapter import store_io
from engine_adapter.breaker import BreakerSettings
from engine_adapter.store_io import GuardedStore
from engine_adapter.layout import BlockLayout, namespace
from engine_adapter.model_identity import WeightsIdentity, describe
from engine_adapter.reference.config import EngineConfig, ModelConfig
from engine_adapter.reference.paged_cache import PagedKVCache, Sequence
from engine_adapter.reference.tp import TPGroup, shard_bounds
from engine_adapter.reference.transfer import BlockStore, LayerLoader, StoreWriter

log = logging.getLogger("engine_adapter.reference.adapter")


class PageBackShortfall(Exception):
    """Raised by :class:`PageBackGate` on every TP rank at the same layer when fewer blocks
    than planned were paged back; the prefill restarts from ``blocks``."""

    def __init__(self, blocks: int, reason: str):
        super().__init__(f"page back fell short: recompute from block {blocks} ({reason})")
        self.blocks = blocks
        self.reason = reason


@dataclass
class PageBackPlan:
    """Outcome of the lookup step of one prefill.

    Attributes:
        keys: chained keys of the prompt's full blocks.
        local_hit_blocks: this rank's Lookup answer (capped as in the module docstring).
        hit_blocks: the hit length agreed by all TP ranks (MIN), in blocks.
        problems: why the store could not be used (e.g. unreachable), for the caller's stats.
    """

    keys: list[bytes]
    local_hit_blocks: int = 0
    hit_blocks: int = 0
    problems: list[str] = field(default_factory=list)


class PageBackGate:
    """The per-layer hook of a prefill that pages back ``hit_blocks`` blocks.

    Args:
        loader: the running loader of this prefill.
        cache: this rank's paged cache.
        seq: the sequence; its block table already covers the prompt.
        hit_blocks: the agreed hit length.
        tp: this rank's collectives.
        deadline: ``time.monotonic()`` value after which missing layers count as failed.
    """

    def __init__(self, loader: LayerLoader, cache: PagedKVCache, seq: Sequence, hit_blocks: int,
                 tp: TPGroup, deadline: float):
        self.loader = loader
        self.cache = cache
        self.seq = seq
        self.hit_blocks = hit_blocks
        self.tp = tp
        self.deadline = deadline
        self._copied = [0] * len(cache.layers)
        self.wait_s = 0.0

    def __call__(self, layer: int) -> None:
        t0 = time.perf_counter()
        got = self.loader.wait(layer, self.deadline)
        self.wait_s += time.perf_counter() - t0
        have = min(got.valid_blocks, self.hit_blocks)
        done = self._copied[layer]
        if have > done:
            scatter_blocks(self.cache.layers, self.seq.block_table[done:have], got.data[done:have],
                           layers=[layer])
            self._copied[layer] = have
        agreed = self.tp.all_reduce_min(have)
        if agreed < self.hit_blocks:
            reason = got.problem if have == agreed and got.problem else "another TP rank fell short"
            self.hit_blocks = agreed
            raise PageBackShortfall(agreed, reason)


class PageBackAdapter:
    """Page back and store of one TP rank.

    Args:
        store: the store, or ``None`` to run without one (every prefill recomputes); it
            is used behind a breaker (:attr:`store`, a
            :class:`~engine_adapter.store_io.GuardedStore`), and stays the caller's to close.
        model: architecture.
        engine: engine settings (block size, timeouts, namespace fields).
        tp: this rank's collectives.
        cache: this rank's paged cache.
        weights: the weights' identity (the runner's ``TensorSource.identity()``), part of
            the namespace; None leaves the weights out of it (blocks are then shared by
            every checkpoint served under ``engine.model_id``).
    Raises:
        ValueError: the TP ranks' namespaces differ (e.g. a tenant computed per rank);
            checked with two all-reduces, so every rank must construct its adapter; or
            the node's ``[blocks] block_tokens`` is set to another block size than
            ``engine.block_tokens`` (``store_io.check_block_tokens``: an unreachable store
            only logs a warning, and every prefill recomputes until it answers).
    """

    def __init__(self, store: BlockStore | None, model: ModelConfig, engine: EngineConfig, tp: TPGroup,
                 cache: PagedKVCache, weights: WeightsIdentity | None = None):
        self.store = (GuardedStore(store, BreakerSettings(backoff_s=engine.store_backoff_s,
                                                          max_backoff_s=engine.store_max_backoff_s))
                      if store is not None else None)
        self.engine = engine
        self.tp = tp
        self.cache = cache
        if store is not None:
            store_io.check_block_tokens(store, engine.block_tokens, "the reference runner's block_tokens")
        weights = weights or WeightsIdentity("", "no weights identity given to the adapter")
        ns = namespace(model, engine, weights=weights, model_config=model.fingerprint())
        if tp.is_first:
            log.info("%s", describe(ns, weights, "reference runner"))
        self.keyer = BlockKeyer(ns)
        if tp.world_size > 1:
            fp = int.from_bytes(self.keyer.root[:7], "little")
            if tp.all_reduce_min(fp) != -tp.all_reduce_min(-fp):
                raise ValueError("TP ranks disagree on the store namespace (model id, dtype, "
                                 "block_tokens, tenant ...): their keys would never match")
        self.layout = BlockLayout.of(model, engine)
        self.heads = shard_bounds(model.num_kv_heads, tp.rank, tp.world_size)
        self._staging: torch.Tensor | None = None
        self._loader: LayerLoader | None = None
        self.writer = (StoreWriter(self.store if tp.is_first else None, self.layout, tp, engine.store_timeout_s,
                                   engine.max_pending_stores) if store is not None else None)

    @property
    def block_tokens(self) -> int:
        return self.engine.block_tokens

    def plan(self, tokens: Seq[int], page_back: bool = True) -> PageBackPlan:
        """Keys, Lookup and the MIN agreement of one prefill (a collective when ``page_back``).

        Never raises for store trouble: a store that fails, misses the lookup deadline
        or has its breaker open is a zero hit (the breaker logs the outage; another
        store error is logged here).
        """
        plan = PageBackPlan(keys=self.keyer.keys(tokens))
        if not page_back:
            return plan
        usable = plan.keys[:(len(tokens) - 1) // self.block_tokens]
        local = 0
        if self.store is not None and usable:
            try:
                local = self.store.lookup(usable, timeout=self.engine.lookup_timeout_s).hit_blocks
            except KVStoreError as e:
                plan.problems.append(f"lookup failed: {e}")
                if not isinstance(e, StoreUnavailable):
                    log.warning("prefix lookup failed (%s); prefilling the whole prompt", e)
        plan.local_hit_blocks = local
        plan.hit_blocks = self.tp.all_reduce_min(local)
        return plan

    def start_load(self, plan: PageBackPlan, seq: Sequence) -> PageBackGate:
        """Start paging back the agreed hit; returns the model hook of the prefill."""
        assert self.store is not None and plan.hit_blocks > 0
        loader = LayerLoader(self.store, plan.keys[:plan.hit_blocks], self.layout, self.heads,
                             self.engine.store_timeout_s, staging=self._staging_for(plan.hit_blocks))
        self._loader = loader.start()
        return PageBackGate(loader, self.cache, seq, plan.hit_blocks, self.tp,
                            time.monotonic() + self.engine.load_timeout_s)

    def _staging_for(self, blocks: int) -> torch.Tensor:
        """The staging tensor of a page back of ``blocks`` blocks (this rank's heads).

        One buffer is kept and reused (page faults on fresh memory cost as much as the
        copy itself); it is at most the size of this rank's paged cache, since a hit
        never exceeds it. It is replaced, never shared, while the previous loader's
        thread still runs (abandoned on a timeout, it may still write into it). Pinned
        host memory when the cache is on a GPU.
        """
        shape = (blocks,) + self.layout.block_shape(heads=self.heads[1] - self.heads[0])
        numel = math.prod(shape)
        buf = self._staging
        if buf is None or buf.numel() < numel or (self._loader is not None and self._loader.running):
            buf = self._staging = torch.empty(numel, dtype=self.layout.dtype,
                                              pin_memory=self.cache.device.type == "cuda")
        return buf[:numel].view(shape)

    def extend_keys(self, seq: Sequence) -> None:
        """Append the keys of full blocks of ``seq.tokens[:seq.num_computed]`` not keyed yet."""
        bt = self.block_tokens
        parent = seq.keys[-1] if seq.keys else self.keyer.root
        for i in range(len(seq.keys), seq.num_computed // bt):
            parent = chain_key(parent, seq.tokens[i * bt:(i + 1) * bt])
            seq.keys.append(parent)

    def store_new_blocks(self, seq: Sequence) -> int:
        """Queue the computed full blocks of ``seq`` not yet in the store; returns how many.

        Their KV is copied out of the cache before this returns (the cache blocks may be
        reused at once); the put itself runs in the background.
        """
        if self.writer is None or not seq.store_blocks:
            return 0
        self.extend_keys(seq)
        full = seq.num_computed // self.block_tokens
        first = seq.num_stored_blocks
        if full <= first:
            return 0
        kv = gather_blocks(self.cache.layers, seq.block_table[first:full]).cpu()
        bt = self.block_tokens
        meta = [BlockMeta(engine_hash=seq.keys[i], parent_engine_hash=seq.keys[i - 1] if i else b"",
                          token_ids=tuple(seq.tokens[i * bt:(i + 1) * bt]), block_tokens=bt)
                for i in range(first, full)]
        self.writer.submit(seq.keys[first:full], kv, meta)
        seq.num_stored_blocks = full
        return full - first

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued stores (this rank's part); False on timeout."""
        return self.writer.flush(timeout_s) if self.writer is not None else True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.store is not None:
            self.store.close()
