"""Tensor parallelism: the collectives the runner needs, and a launcher for TP ranks.

A :class:`TPGroup` is one TP rank's view: its rank, the world size, sum/MIN
all-reduces on the main process group, and a second process group used only by the
background store thread (so that gathering a block's KV heads for a store never
interleaves with the forward pass's collectives). ``TPGroup.single()`` is TP=1
without ``torch.distributed``.

:func:`launch` starts ``world_size`` processes (spawn), joins them into one gloo
(CPU) or NCCL (GPU) group over TCP on a free loopback port, runs a function in each
and returns what each rank's function returned.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shard_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``total`` items.

    Raises ValueError when ``total`` is not a multiple of ``world_size``.
    """
    if total % world_size:
        raise ValueError(f"{total} does not split evenly over {world_size} TP ranks")
    per = total // world_size
    return rank * per, (rank + 1) * per


@dataclass
class TPGroup:
    """One TP rank's collectives.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: TP size.
        group: main process group (forward all-reduces, hit-length agreement);
            ``None`` at TP=1.
        store_group: gloo process group of the background store thread (host tensors,
            also on GPUs); ``None`` at TP=1.
        device: where the main group's collectives take tensors (``cuda`` for NCCL).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    store_group: Any = None
    device: torch.device = torch.device("cpu")

    @classmethod
    def single(cls) -> "TPGroup":
        """TP=1: every collective is the identity."""
        return cls()

    @classmethod
    def from_default_group(cls) -> "TPGroup":
        """Wrap an initialised ``torch.distributed`` default group; creates the store group
        (a collective call: every rank must call this, in the same order)."""
        store_group = dist.new_group(backend="gloo")
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, store_group, device)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks, in place; returns ``t``."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks (e.g. the agreed hit length, in blocks)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def gather_heads_to_first(self, t: torch.Tensor, head_dim_index: int) -> torch.Tensor | None:
        """Concatenate every rank's ``t`` along ``head_dim_index`` on rank 0 (store group).

        Every rank passes a tensor of the same shape and dtype. Returns the
        concatenation on rank 0 (rank order = head order), ``None`` elsewhere.
        Called from the background store thread only.
        """
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(t, parts, dst=0, group=self.store_group)
        return torch.cat(parts, dim=head_dim_index) if self.is_first else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, threads: int,
               timeout_s: float, results: Any, fn: Callable, args: tuple) -> None:
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            tp = TPGroup.from_default_group()
            out = fn(tp, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           threads_per_rank: int | None = None, collective_timeout_s: float = 120.0,
           timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(tp: TPGroup, *args)`` in ``world_size`` spawned TP ranks; return their results.

    ``fn`` and ``args`` must be picklable (a module-level function); results travel
    back pickled, so return plain data or numpy arrays, not tensors.

    Args:
        world_size: number of TP ranks (processes).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        threads_per_rank: torch intra-op threads per rank (default: cores / ranks).
        collective_timeout_s: a collective waiting this long for a peer fails.
        timeout_s: the whole run; past it the ranks are killed.
    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or
            the run passed ``timeout_s``.
    """
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, backend, threads, collective_timeout_s, results, fn, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"TP run did not finish in {timeout_s}s") from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    time.sleep(0.5)  # let a failing rank's traceback arrive first
                    if results.empty():
                        raise RuntimeError(f"TP rank {dead[0]} died (exit code {procs[dead[0]].exitcode})")
                continue
            if not ok:
                raise RuntimeError(f"TP rank {rank} failed:\n{value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out[r] for r in range(world_size)]
