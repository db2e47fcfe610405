#!/usr/bin/env python3
"""What the vLLM worker's hooks add to a forward pass on a GPU: a step that saves KV, a step
that loads it, against the same forward without hooks, measured in the same run.

A stand-in forward of ``--layers`` layers runs, per layer, two ``--tokens`` x ``--hidden``
matrix products (bf16) and writes the layer's KV into the step's cache blocks (vLLM's
FlashAttention cache layout, ``(2, blocks, block_size, kv_heads, head_dim)``). The hooks are
:class:`engine_adapter.vllm.worker.WorkerTransfers`' as vLLM calls them: ``wait_layer``
before each layer, ``save_layer`` after it, ``end_step`` at the end. The store is a daemon in
this process with a pinned host tier; the puts of a step are waited for outside the timing.

Figures (median of ``--repeats`` steps after a warm-up, each ended by a sync of the
forward's stream): ``forward`` alone; ``+ save``: the step saves its ``--tokens`` tokens'
blocks; ``+ load``: the step pages the same number of blocks back in. The ratio is to
``forward``; 1.00 means the hooks cost the forward nothing.

    python bench/forward_hooks.py [--layers 32] [--tokens 1024] [--hidden 4096] [--repeats 10]
                                  [--device cpu]

Needs a CUDA GPU (torch and CuPy); ``--device cpu`` runs the same steps on the CPU (a check
of the script, not a measurement of interest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the step (a prefill chunk)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="tokens per cache block")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU: torch sees none (--device cpu runs the steps on the CPU)", file=sys.stderr)
        return 2
    from engine_adapter.layout import BlockLayout
    from engine_adapter.vllm.plan import BlockTransfer, StepPlan
    from engine_adapter.vllm.worker import WorkerTransfers
    from kvstore import config
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server

    dev = torch.device(args.device)
    dtype = torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = args.tokens // args.block
    num_blocks = 4 * n
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    layout = BlockLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, block_tokens=args.block,
                         head_dim=args.head_dim, dtype=dtype)
    caches = {name: torch.randn((2, num_blocks, args.block, args.kv_heads, args.head_dim), dtype=dtype, device=dev)
              for name in names}
    x = torch.randn((args.tokens, args.hidden), dtype=dtype, device=dev)
    w = torch.randn((args.hidden, args.hidden), dtype=dtype, device=dev) / args.hidden ** 0.5
    kv = torch.randn((2, n, args.block, args.kv_heads, args.head_dim), dtype=dtype, device=dev)
    step_bytes = layout.block_bytes * n
    sock = tempfile.mkdtemp(prefix="kvfh-")
    cfg = config.from_dict({"server": {"listen": f"unix:{sock}/kvstore.sock"},
                            "tiers": {"host": {"capacity": max(8 * step_bytes, 1 << 30)}, "nvme": {"enabled": False}}})
    daemon = start_server(cfg)
    client = KVStoreClient(daemon.address, timeout=120.0)
    worker = WorkerTransfers(client, names, caches, "kv_first", layout, (0, args.kv_heads), timeout_s=120.0)

    parts: dict[str, list[float]] = {}

    def forward(plan: StepPlan | None, ids: torch.Tensor, what: str = "") -> float:
        sync()
        t0 = time.perf_counter()
        if plan is not None:
            worker.bind(plan)
            worker.start_load()
        t_bound = time.perf_counter()
        for name in names:
            if plan is not None:
                worker.wait_layer(name)
            y = (x @ w) @ w
            del y
            caches[name].index_copy_(1, ids, kv)             # the layer's KV into the step's blocks
            if plan is not None:
                worker.save_layer(name)
        t_layers = time.perf_counter()
        if plan is not None:
            worker.end_step()
        t_end = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        t_done = time.perf_counter()
        if what:
            for part, t in (("bind", t_bound - t0), ("layers", t_layers - t_bound), ("end_step", t_end - t_layers),
                            ("GPU wait", t_done - t_end)):
                parts.setdefault(f"{what} {part}", []).append(t)
        return t_done - t0

    def keys(tag: str) -> tuple[bytes, ...]:
        return tuple(f"fh-{tag}-{i}".encode().ljust(32, b".") for i in range(n))

    save_ids = tuple(range(n))
    load_ids = tuple(range(n, 2 * n))
    ids_dev = torch.tensor(save_ids, device=dev)
    results: dict[str, list[float]] = {"forward": [], "+ save": [], "+ load": []}
    try:
        for r in range(args.repeats + 1):
            base = forward(None, ids_dev, "forward" if r else "")
            k = keys(f"s{r}")
            saved = forward(StepPlan(saves=[BlockTransfer("s", k, save_ids)]), ids_dev, "+ save" if r else "")
            if not worker.flush(120.0):
                raise RuntimeError("the step's puts did not finish in 120 s")
            loaded = forward(StepPlan(loads=[BlockTransfer("l", k, load_ids)]), ids_dev, "+ load" if r else "")
            failed = worker.take_load_errors()
            if failed:
                raise RuntimeError(f"{len(failed)} blocks failed to load")
            if r:                                              # round 0 warms up
                results["forward"].append(base)
                results["+ save"].append(saved)
                results["+ load"].append(loaded)
    finally:
        client.close()
        daemon.stop(0)
    med = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"# {name}, {args.layers} layers, {args.tokens} tokens x hidden {args.hidden} "
          f"bf16, {n} blocks of {layout.block_bytes >> 10} KiB per step ({step_bytes / 2**20:.1f} MiB), "
          f"median of {args.repeats}")
    print(f"{'step':>10} {'ms':>9} {'x forward':>10}   on the forward's thread (ms): bind+start_load, layers, "
          f"end_step, then waiting for the GPU")
    for k, v in med.items():
        split = ", ".join(f"{statistics.median(parts[f'{k} {p}']) * 1e3:.2f}"
                          for p in ("bind", "layers", "end_step", "GPU wait"))
        print(f"{k:>10} {v:9.2f} {v / med['forward']:10.2f}   {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
