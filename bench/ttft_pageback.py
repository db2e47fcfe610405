#!/usr/bin/env python3
"""TTFT of a prefill that recomputes a cached prefix vs one that pages it back from the daemon.

For each prefix length (default 1k, 4k, 16k tokens) the prompt is the prefix plus a new
turn's delta (default 128 tokens), as in an agent turn. In one run, against one daemon:

1. the prefix is prefilled once and its blocks stored (and the store flushed);
2. TTFT with **recompute**: the whole prompt is prefilled, store off;
3. TTFT with **page back**: the prefix's blocks are looked up and paged back layer by
   layer (each TP rank its own KV heads), only the delta is prefilled;

4. the same page back **alone** (the rank's ``LayerLoader`` on the prefix's keys, every
   layer waited for, no prefill beside it; a staging tensor reused as the adapter does,
   when the loader takes one);
5. a streaming memcpy of this rank's KV bytes (numpy, buffers touched beforehand): the
   physical limit of a same-node page back, measured in the same run;

steps 2-5 alternate ``--repeats`` times and the median of each is reported: the TTFT
ratio, the KV bytes paged back per rank, the time the forward pass waited for them
(``load wait``), how long the loader thread ran inside the prefill (``load``) and alone
(``alone``), and ``memcpy`` = KV bytes / memcpy bandwidth, with ``wait/memcpy`` and
``alone/memcpy`` (issue #11's target: the load wait within 2x of memcpy at 16k tokens). TTFT is measured from a barrier of the
TP ranks to the first token chosen (Lookup, page back and prefill included). The daemon
runs in its own process (host tier only, sized for the largest prefix); the client uses
its shared arena unless ``--no-shared-memory``. A benchmark reports; it does not pass or
fail on a time.

    python bench/ttft_pageback.py [--prefixes 1024,4096,16384] [--tp 1] [--block-tokens 64]
                                  [--target ADDR]   # an already running daemon instead
                                  [--no-shared-memory]  # blocks by gRPC frames
                                  [--device cuda]       # weights and paged cache in HBM

Before/after comparisons of the adapter: run this file from the other checkout's root
(``python /path/to/this/bench/ttft_pageback.py --root OTHER``) so that checkout's
``engine_adapter`` and ``kvstore`` are imported.

The default model (4 layers, hidden 256, 4 query / 2 KV heads of 64, fp32: 4 KiB of KV
per token) keeps the whole run under 5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
if "--root" in sys.argv:                  # import another checkout (before/after runs)
    ROOT = pathlib.Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
sys.path.insert(0, str(ROOT))

_DAEMON = r"""
import signal, sys
from kvstore import config
from kvstore.service.startup import start_server
d = start_server(config.load(sys.argv[1]))
print("ready", d.address, flush=True)
signal.sigwait([signal.SIGTERM, signal.SIGINT])
d.stop(0)
"""


@dataclass(frozen=True)
class BenchOptions:
    target: str
    prefixes: tuple[int, ...]
    delta_tokens: int
    repeats: int
    block_tokens: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_prefill_tokens: int
    tenant: str
    shared_memory: bool
    device: str = "cpu"


def start_daemon(folder: pathlib.Path, host_bytes: int) -> tuple[subprocess.Popen, str]:
    """A daemon in its own process on a unix socket in ``folder``; returns (process, address)."""
    cfg = folder / "node.toml"
    cfg.write_text(f'[server]\nlisten = "unix:{folder}/kvstore.sock"\nworkers = 8\n'
                   f'[tiers.host]\ncapacity = {host_bytes}\n[tiers.nvme]\nenabled = false\n')
    proc = subprocess.Popen([sys.executable, "-c", _DAEMON, str(cfg)], stdout=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc, line.split()[1]


def _time_loaders(transfer) -> list[float]:
    """Record how long each LayerLoader thread ran (start of its run to its end), seconds:
    the same measure for any version of the adapter."""
    times: list[float] = []
    run = transfer.LayerLoader._run

    def timed(self):
        t0 = time.perf_counter()
        try:
            run(self)
        finally:
            times.append(time.perf_counter() - t0)

    transfer.LayerLoader._run = timed
    return times


def _page_back_alone(transfer, client, keys, adapter, staging) -> float:
    """One page back of ``keys`` (this rank's heads, every layer waited for) with no
    prefill running beside it, seconds. ``staging`` is passed when the loader takes one."""
    kw = {"staging": staging} if staging is not None else {}
    t0 = time.perf_counter()
    loader = transfer.LayerLoader(client, keys, adapter.layout, adapter.heads, 120.0, **kw).start()
    for layer in range(adapter.layout.num_layers):
        got = loader.wait(layer, time.monotonic() + 120)
        if got.valid_blocks != len(keys):
            raise AssertionError(f"page back alone fell short: {got.problem}")
    return time.perf_counter() - t0


def bench_rank(tp, opts: BenchOptions) -> list[dict]:
    """One TP rank: measure every prefix; rank 0's rows are printed by the parent."""
    import inspect

    import numpy as np
    import torch

    from engine_adapter.reference import transfer
    from engine_adapter.reference.config import EngineConfig, ModelConfig
    from engine_adapter.reference.runner import Runner
    from kvstore.client.client import KVStoreClient

    model = ModelConfig(vocab_size=2048, hidden_size=opts.hidden, intermediate_size=3 * opts.hidden,
                        num_layers=opts.layers, num_heads=opts.heads, num_kv_heads=opts.kv_heads,
                        head_dim=opts.head_dim)
    longest = max(opts.prefixes) + opts.delta_tokens
    engine = EngineConfig(model_id=f"bench-llama/{model.fingerprint()}", dtype=opts.dtype,
                          block_tokens=opts.block_tokens, num_cache_blocks=longest // opts.block_tokens + 4,
                          max_prefill_tokens=opts.max_prefill_tokens, tenant=opts.tenant,
                          load_timeout_s=120.0, store_timeout_s=120.0, device=opts.device)
    client = KVStoreClient(opts.target, timeout=120.0, shared_memory=None if opts.shared_memory else False)
    runner = Runner(model, engine, tp, store=client, seed=0)
    loads = _time_loaders(transfer)
    takes_staging = "staging" in inspect.signature(transfer.LayerLoader).parameters
    rng = np.random.default_rng(0)
    runner.generate(rng.integers(0, model.vocab_size, 64).tolist(), 1, page_back=False, store=False)
    rows = []
    for n in opts.prefixes:
        prefix = rng.integers(0, model.vocab_size, n).tolist()
        prompt = prefix + rng.integers(0, model.vocab_size, opts.delta_tokens).tolist()
        runner.generate(prefix, 1, page_back=False, store=True)
        runner.flush(timeout_s=300)
        keys = runner.adapter.keyer.keys(prefix)
        kv_bytes = len(keys) * opts.block_tokens * runner.cache.bytes_per_token   # this rank's heads
        staging = None
        if takes_staging:
            staging = torch.ones((len(keys),) + runner.adapter.layout.block_shape(
                heads=runner.adapter.heads[1] - runner.adapter.heads[0]), dtype=engine.torch_dtype)
        src, dst = np.full(kv_bytes, 1, dtype=np.uint8), np.full(kv_bytes, 2, dtype=np.uint8)  # pages touched
        recompute, page_back, waits, in_prefill, alone, copies = [], [], [], [], [], []
        last = None
        for _ in range(opts.repeats):
            base = runner.generate(prompt, 1, page_back=False, store=False)
            recompute.append(base.ttft_s)
            seen = len(loads)
            last = runner.generate(prompt, 1, page_back=True, store=False)
            page_back.append(last.ttft_s)
            waits.append(last.stats.load_wait_s)
            deadline = time.monotonic() + 10
            while len(loads) == seen and time.monotonic() < deadline:   # the loader thread's last instant
                time.sleep(0.001)
            in_prefill.append(loads[-1] if len(loads) > seen else float("nan"))
            tp.barrier()
            alone.append(_page_back_alone(transfer, client, keys, runner.adapter, staging))
            t0 = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t0)
            if last.tokens != base.tokens or np.abs(last.logits - base.logits).max() > 1e-3:
                raise AssertionError(f"prefix {n}: page back changed the output")
        rows.append(dict(prefix=n, prompt=len(prompt), paged=last.stats.paged_tokens,
                         prefilled=last.stats.prefilled_tokens, problems=last.stats.problems,
                         recompute_s=statistics.median(recompute), page_back_s=statistics.median(page_back),
                         wait_s=statistics.median(waits), load_s=statistics.median(in_prefill),
                         alone_s=statistics.median(alone), memcpy_s=statistics.median(copies),
                         kv_bytes_rank=kv_bytes))
    runner.close()
    client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="1024,4096,16384", help="prefix lengths, tokens")
    ap.add_argument("--delta-tokens", type=int, default=128, help="new tokens after the prefix")
    ap.add_argument("--repeats", type=int, default=3, help="TTFT samples of each kind per prefix (median)")
    ap.add_argument("--tp", type=int, default=1, help="TP size (ranks, processes)")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-prefill-tokens", type=int, default=2048, help="prefill chunk, tokens")
    ap.add_argument("--target", default=None, help="use this running daemon instead of starting one")
    ap.add_argument("--no-shared-memory", action="store_true", help="blocks by gRPC, not the shared arena")
    ap.add_argument("--device", default="cpu",
                    help="torch device of the weights and paged cache: cpu, or cuda (TP > 1: one GPU per rank)")
    ap.add_argument("--root", default=str(ROOT), help="checkout whose engine_adapter and kvstore run")
    args = ap.parse_args(argv)

    from engine_adapter.reference.tp import launch

    prefixes = tuple(int(x) for x in args.prefixes.split(","))
    kv_per_token = args.layers * 2 * args.kv_heads * args.head_dim * (4 if args.dtype == "float32" else 2)
    proc = None
    target = args.target
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ttft-") as tmp:
        if target is None:
            need = 2 * kv_per_token * sum(p + args.delta_tokens for p in prefixes) + (64 << 20)
            proc, target = start_daemon(pathlib.Path(tmp), need)
        try:
            opts = BenchOptions(target, prefixes, args.delta_tokens, args.repeats, args.block_tokens, args.hidden,
                                args.layers, args.heads, args.kv_heads, args.head_dim, args.dtype,
                                args.max_prefill_tokens, tenant=f"bench-{time.time_ns()}",
                                shared_memory=not args.no_shared_memory, device=args.device)
            rows = launch(bench_rank, args.tp, opts, timeout_s=3600)[0]
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads "
          f"x {args.head_dim}, {args.dtype}, {kv_per_token} B of KV per token; TP={args.tp} on {args.device}, "
          f"block_tokens={args.block_tokens}, delta {args.delta_tokens} tokens, median of {args.repeats}; "
          f"code: {ROOT}; data path: {'gRPC' if args.no_shared_memory else 'shared arena when offered'}")
    print(f"{'prefix':>7} {'paged back':>10} {'prefilled':>9} {'TTFT recompute':>15} {'TTFT page back':>15} "
          f"{'ratio':>7} {'KV/rank':>9} {'load wait':>10} {'load':>9} {'alone':>9} {'memcpy':>9} "
          f"{'wait/memcpy':>11} {'alone/memcpy':>12}")
    for r in rows:
        ratio = r["recompute_s"] / r["page_back_s"]
        print(f"{r['prefix']:>7} {r['paged']:>10} {r['prefilled']:>9} {r['recompute_s'] * 1e3:>13.1f}ms "
              f"{r['page_back_s'] * 1e3:>13.1f}ms {ratio:>6.2f}x {r['kv_bytes_rank'] / 2**20:>6.1f}MiB "
              f"{r['wait_s'] * 1e3:>8.1f}ms {r['load_s'] * 1e3:>7.1f}ms {r['alone_s'] * 1e3:>7.1f}ms "
              f"{r['memcpy_s'] * 1e3:>7.1f}ms {r['wait_s'] / r['memcpy_s']:>10.2f}x "
              f"{r['alone_s'] / r['memcpy_s']:>11.2f}x"
              + (f"  [{'; '.join(r['problems'])}]" if r["problems"] else ""))
    print(f"total run time {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
