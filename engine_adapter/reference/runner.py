"""The reference runner of one TP rank: model, paged KV cache, page-back adapter.

>>> runner = Runner(ModelConfig(), EngineConfig(), TPGroup.single(), store=client)  # doctest: +SKIP
>>> out = runner.generate(prompt_tokens, max_new_tokens=8)                          # doctest: +SKIP
>>> out.tokens, out.stats.paged_tokens, out.stats.prefilled_tokens, out.ttft_s      # doctest: +SKIP

Every TP rank runs the same calls in the same order (they are collectives); each
returns the same tokens and logits. A prefill pages back what the store holds of
the prompt's prefix and computes only the rest (:mod:`engine_adapter.reference.adapter`);
generation is greedy.
"""

from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_adapter.reference.adapter import PageBackAdapter, PageBackShortfall
from engine_adapter.reference.config import EngineConfig, ModelConfig
from engine_adapter.reference.model import LlamaModel
from engine_adapter.reference.paged_cache import PagedKVCache, Sequence
from engine_adapter.reference.tp import TPGroup
from engine_adapter.reference.transfer import BlockStore
from engine_adapter.reference.weights import (
    SafetensorsWeights,
    SeededWeights,
    TensorSource,
    load_rank_weights,
)

log = logging.getLogger("engine_adapter.reference.runner")


@dataclass
class PrefillStats:
    """What one prefill did.

    Attributes:
        prompt_tokens: prompt length.
        lookup_hit_tokens: tokens this rank's Lookup found (before the MIN agreement).
        paged_tokens: tokens whose KV was paged back from the store.
        prefilled_tokens: tokens computed (``prompt_tokens - paged_tokens``).
        restarts: prefill passes abandoned because a page back fell short.
        load_wait_s: time the forward pass spent waiting for layers, seconds.
        problems: store trouble met (each also logged as a warning).
    """

    prompt_tokens: int = 0
    lookup_hit_tokens: int = 0
    paged_tokens: int = 0
    prefilled_tokens: int = 0
    restarts: int = 0
    load_wait_s: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class Generation:
    """Result of :meth:`Runner.generate`.

    Attributes:
        tokens: generated token ids (greedy).
        logits: ``(len(tokens), vocab_size)`` float32: row 0 from the prefill, row ``i``
            from decode step ``i``; ``tokens[i] = argmax(logits[i])``.
        ttft_s: time to first token: from the call to the first token chosen, seconds
            (Lookup, page back and prefill included).
        stats: the prefill's :class:`PrefillStats`.
        stored_blocks: full blocks handed to the store writer (prefill and decode).
    """

    tokens: list[int]
    logits: np.ndarray
    ttft_s: float
    stats: PrefillStats
    stored_blocks: int = 0


def make_weights(model: ModelConfig, checkpoint: str | pathlib.Path | None, seed: int) -> TensorSource:
    """The checkpoint's weights when a path is given, else seeded random weights."""
    return SafetensorsWeights(checkpoint) if checkpoint else SeededWeights(model, seed)


class Runner:
    """One TP rank's runner.

    Args:
        model: architecture.
        engine: engine settings.
        tp: this rank's collectives (``TPGroup.single()`` for TP=1).
        store: the store (e.g. a :class:`kvstore.client.KVStoreClient`), or ``None``.
        weights: where weights come from (default: ``SeededWeights(model, seed)``).
        seed: seed of the default weights.
    Raises:
        ValueError: heads or MLP width do not split over the TP size.
    """

    def __init__(self, model: ModelConfig, engine: EngineConfig, tp: TPGroup, store: BlockStore | None = None,
                 weights: TensorSource | None = None, seed: int = 0):
        self.model_cfg = model
        self.engine = engine
        self.tp = tp
        source = weights if weights is not None else SeededWeights(model, seed)
        device = torch.device(engine.device)
        if device.type == "cuda" and device.index is None and tp.world_size > 1:
            device = torch.device("cuda", tp.rank)
        self.device = device
        self.model = LlamaModel(model, load_rank_weights(model, source, tp.rank, tp.world_size,
                                                         engine.torch_dtype, device), tp)
        self.cache = PagedKVCache(model.num_layers, engine.num_cache_blocks, engine.block_tokens,
                                  model.num_kv_heads // tp.world_size, model.head_dim, engine.torch_dtype,
                                  device)
        self.adapter = PageBackAdapter(store, model, engine, tp, self.cache, weights=source.identity())

    # ------------------------------------------------------------------ steps

    def _forward_chunks(self, seq: Sequence, start: int, hook) -> torch.Tensor:
        tokens = torch.as_tensor(seq.tokens, dtype=torch.long, device=self.device)
        end = len(seq.tokens)
        step = self.engine.max_prefill_tokens
        logits = None
        for s in range(start, end, step):
            e = min(s + step, end)
            logits = self.model.forward(tokens[s:e], s, seq, self.cache, hook=hook if s == start else None)
        assert logits is not None
        return logits

    def prefill(self, tokens: list[int], *, page_back: bool = True,
                store: bool = True) -> tuple[Sequence, torch.Tensor, PrefillStats]:
        """Prefill a new sequence, paging its cached prefix back when ``page_back``.

        Args:
            tokens: the prompt (at least one token).
            page_back: look the prefix up in the store and page it back.
            store: store the prompt's new full blocks afterwards (in the background).
        Returns:
            ``(seq, logits, stats)``: the sequence (holding cache blocks until
            :meth:`release`), float32 logits ``(vocab_size,)`` of the last prompt token.
        Raises:
            CacheFull: the paged cache cannot hold the prompt.
        """
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        stats = PrefillStats(prompt_tokens=len(tokens))
        seq = Sequence(tokens=list(tokens))
        self.cache.reserve(seq, len(tokens))
        try:
            logits = self._prefill(seq, stats, page_back, store)
        except BaseException:
            self.cache.release(seq)
            raise
        return seq, logits, stats

    def _prefill(self, seq: Sequence, stats: PrefillStats, page_back: bool, store: bool) -> torch.Tensor:
        tokens = seq.tokens
        bt = self.engine.block_tokens
        plan = self.adapter.plan(tokens, page_back=page_back and self.adapter.store is not None)
        seq.keys = plan.keys
        stats.lookup_hit_tokens = plan.local_hit_blocks * bt
        stats.problems += plan.problems
        hit = plan.hit_blocks
        gate = self.adapter.start_load(plan, seq) if hit else None
        try:
            while True:
                try:
                    logits = self._forward_chunks(seq, hit * bt, gate if hit else None)
                    break
                except PageBackShortfall as e:
                    log.warning("%s; recomputing %d tokens", e, (plan.hit_blocks - e.blocks) * bt)
                    stats.problems.append(e.reason)
                    stats.restarts += 1
                    hit = e.blocks
        finally:
            if gate is not None:
                gate.loader.cancel()
                stats.load_wait_s = gate.wait_s
        seq.num_computed = len(tokens)
        seq.num_stored_blocks = hit
        stats.paged_tokens = hit * bt
        stats.prefilled_tokens = len(tokens) - hit * bt
        seq.store_blocks = store
        self.adapter.store_new_blocks(seq)
        return logits

    def decode(self, seq: Sequence, token: int) -> torch.Tensor:
        """Feed ``token`` at the next position; returns float32 logits ``(vocab_size,)``.

        When the token completes a block, the block is queued for storing.
        """
        pos = seq.num_computed
        seq.tokens.append(token)
        self.cache.reserve(seq, pos + 1)
        logits = self.model.forward(torch.tensor([token], dtype=torch.long, device=self.device), pos, seq,
                                    self.cache)
        seq.num_computed = pos + 1
        if seq.num_computed % self.engine.block_tokens == 0:
            self.adapter.store_new_blocks(seq)
        return logits

    def release(self, seq: Sequence) -> None:
        """Free the sequence's cache blocks (the store keeps what was stored)."""
        self.cache.release(seq)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: list[int], max_new_tokens: int, *, page_back: bool = True,
                 store: bool = True) -> Generation:
        """Greedy generation of ``max_new_tokens`` (>= 1) tokens; the sequence is released after.

        The last generated token is not fed back (its KV is not computed), so the
        cache holds ``len(prompt) + max_new_tokens - 1`` tokens at the end.
        TTFT is measured from a barrier of all TP ranks.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.tp.barrier()
        t0 = time.perf_counter()
        seq, logits, stats = self.prefill(prompt, page_back=page_back, store=store)
        rows = [logits]
        out = [int(torch.argmax(logits))]
        ttft = time.perf_counter() - t0
        try:
            for _ in range(max_new_tokens - 1):
                logits = self.decode(seq, out[-1])
                rows.append(logits)
                out.append(int(torch.argmax(logits)))
        finally:
            self.release(seq)
        stored = seq.num_stored_blocks - stats.paged_tokens // self.engine.block_tokens if store else 0
        return Generation(out, torch.stack(rows).cpu().numpy(), ttft, stats, stored)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued store finished on every rank (a collective)."""
        ok = self.adapter.flush(timeout_s)
        self.tp.barrier()
        return ok

    def close(self) -> None:
        self.adapter.close()
