#!/usr/bin/env python3
"""Prefix lookup at agent scale: block keys, Lookup, and lookup + get_into of a prefix.

Every figure is measured in this run; the keys are compared with the raw chained SHA-256
measured alongside (rounds interleaved, so load on the machine hits both alike):

1. **Keys of a 128k-token prompt** (8,192 blocks of 16 tokens): ``BlockKeyer.keys`` from a
   numpy array and from a list, and the old per-block ``chain_key`` loop, against the raw
   chained SHA-256 (the same hashlib calls over bytes encoded beforehand, untimed).
2. **An agent turn that appends 512 tokens** to that prompt: ``TrajectoryKeyer.keys`` of
   the whole new prompt, after the previous turn (untimed).
3. **Lookup of 8,192 stored keys** through ``KVStoreClient.lookup``, with its parts: the
   request built and serialized on the client, the server handler called directly.
4. **Lookup + get_into of a 128-block prefix of 32 KiB blocks** through the same-node
   shared-memory path, with its parts (the Lookup and Lease round trips, the copy out of
   the arena, issuing the background Release) and the memcpy of the same 4 MiB.

Daemons: in-process (``kvstore.service.startup.start_server``: client and daemon share one GIL) and
in their own process (the sidecar as deployed); ``--daemon`` picks. Figures are p50 /
p99 / min in ms over ``--reps`` repetitions. A benchmark reports; it does not pass or fail.

    python bench/keys_lookup.py [--reps 1000] [--daemon both|inproc|process]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import queue
import random
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import config  # noqa: E402
from kvstore._proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.client.client import KVStoreClient  # noqa: E402
from kvstore.common.keys import BlockKeyer, Namespace, chain_key  # noqa: E402
from kvstore.common.trajectory_keys import TrajectoryKeyer  # noqa: E402

PROMPT_TOKENS = 128 * 1024
BLOCK_TOKENS = 16
TURN_TOKENS = 512
LOOKUP_BLOCKS = 8192
GET_BLOCKS, GET_BLOCK_BYTES = 128, 32 << 10

_DAEMON = r"""
import signal, sys
from kvstore import config
from kvstore.service.startup import start_server
d = start_server(config.load(sys.argv[1]))
print("ready", d.address, flush=True)
signal.sigwait([signal.SIGTERM, signal.SIGINT])
d.stop(0)
"""


# ---------------------------------------------------------------------- timing

def interleaved(fns: dict[str, Callable[[], object]], rounds: int,
                setup: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each function per round; the order is shuffled every round."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        names = list(fns)
        random.shuffle(names)
        for name in names:
            if setup is not None:
                setup(name)
            t0 = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t0)
    return out


def stats_ms(samples: list[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    return (s[len(s) // 2] * 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, s[0] * 1e3)


def row(name: str, samples: list[float], base: list[float] | None = None, target: str = "") -> None:
    p50, p99, low = stats_ms(samples)
    ratio = ""
    if base is not None:
        b50, _, blow = stats_ms(base)
        ratio = f"{p50 / b50:5.2f}x ({low / blow:4.2f}x min)"
    print(f"  {name:<58} {p50:8.3f} {p99:8.3f} {low:8.3f}  {ratio:<20} {target}")


def header(title: str) -> None:
    print(f"\n{title}")
    print(f"  {'':<58} {'p50 ms':>8} {'p99 ms':>8} {'min ms':>8}  {'ratio (p50)':<20} target")


# ---------------------------------------------------------------------- keys

def raw_chain(root: bytes, messages: list[bytes], extra: bytes) -> list[bytes]:
    """The baseline: chain_key's hashlib calls over pre-encoded token fields."""
    sha = hashlib.sha256
    out, parent = [], root
    for field in messages:
        h = sha(b"kvstore.block.v1")
        h.update(parent)
        h.update(field)
        h.update(extra)
        parent = h.digest()
        out.append(parent)
    return out


def bench_keys(reps: int) -> None:
    keyer = BlockKeyer(Namespace("bench/model", "bfloat16", "layer.kv.head.token.dim/v1", BLOCK_TOKENS))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS)
    prompt_list = prompt.tolist()
    enc = prompt.astype("<u4").tobytes()
    step = 4 * BLOCK_TOKENS
    messages = [struct.pack("<Q", step) + enc[i:i + step] for i in range(0, len(enc), step)]
    no_extra = struct.pack("<Q", 0)
    want = raw_chain(keyer.root, messages, no_extra)
    assert keyer.keys(prompt) == want and keyer.keys(prompt_list) == want

    def old_loop():
        parent, out = keyer.root, []
        for i in range(PROMPT_TOKENS // BLOCK_TOKENS):
            parent = chain_key(parent, prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            out.append(parent)

    rounds = max(10, reps // 25)
    t = interleaved({"raw": lambda: raw_chain(keyer.root, messages, no_extra), "np": lambda: keyer.keys(prompt),
                     "list": lambda: keyer.keys(prompt_list)}, rounds)
    old = interleaved({"old": old_loop}, max(3, rounds // 10))["old"]
    header(f"Keys of a {PROMPT_TOKENS:,}-token prompt ({PROMPT_TOKENS // BLOCK_TOKENS:,} blocks of {BLOCK_TOKENS}), "
           f"{rounds} interleaved rounds")
    row("raw chained SHA-256 over pre-encoded bytes (baseline)", t["raw"], t["raw"])
    row("BlockKeyer.keys, numpy int64 array", t["np"], t["raw"], "<= 2x raw")
    row("BlockKeyer.keys, Python list", t["list"], t["raw"], "<= 2x raw")
    row("per-block chain_key loop (the path before this change)", old, t["raw"])

    new = rng.integers(0, 150_000, (reps, TURN_TOKENS))
    turn_msgs = messages[:TURN_TOKENS // BLOCK_TOKENS]
    primed: dict[str, TrajectoryKeyer] = {}
    turn = {"i": 0}

    def prime(name: str) -> None:          # untimed: the previous turn, then the next turn's prompt
        tk = primed[name] = TrajectoryKeyer(keyer)
        tk.keys(prompt if name == "np" else prompt_list)
        nxt = np.concatenate([prompt, new[turn["i"] % reps]])
        primed[name + "_arg"] = nxt if name == "np" else nxt.tolist()
        turn["i"] += 1

    t = interleaved({"np": lambda: primed["np"].keys(primed["np_arg"]),
                     "list": lambda: primed["list"].keys(primed["list_arg"]),
                     "raw": lambda: raw_chain(keyer.root, turn_msgs, no_extra)},
                    max(20, reps // 5), setup=lambda name: prime(name) if name != "raw" else None)
    assert primed["np"].hashed_blocks == TURN_TOKENS // BLOCK_TOKENS
    header(f"An agent turn appending {TURN_TOKENS} tokens to that prompt (TrajectoryKeyer), {max(20, reps // 5)} rounds")
    row(f"raw chained SHA-256 of the {TURN_TOKENS // BLOCK_TOKENS} new blocks (baseline)", t["raw"], t["raw"])
    row("TrajectoryKeyer.keys(whole new prompt), numpy int64 array", t["np"], t["raw"], "< 1 ms")
    row("TrajectoryKeyer.keys(whole new prompt), Python list", t["list"], t["raw"], "< 1 ms")


# ---------------------------------------------------------------------- daemons

def daemon_dict(folder: pathlib.Path) -> dict:
    return {"server": {"listen": f"unix:{folder}/kvstore.sock", "workers": 8},
            "tiers": {"host": {"capacity": "256MiB"}, "nvme": {"enabled": False}}}


def start_inproc(folder: pathlib.Path):
    from kvstore.service.startup import start_server
    d = start_server(config.from_dict(daemon_dict(folder)))
    return d, d.address, lambda: d.stop(0)


def start_process(folder: pathlib.Path):
    cfg = folder / "node.toml"
    cfg.write_text(f'[server]\nlisten = "unix:{folder}/kvstore.sock"\nworkers = 8\n'
                   '[tiers.host]\ncapacity = "256MiB"\n[tiers.nvme]\nenabled = false\n')
    proc = subprocess.Popen([sys.executable, "-c", _DAEMON, str(cfg)], stdout=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")

    def stop() -> None:
        proc.terminate()
        proc.wait(30)
    return None, line.split()[1], stop


class DeferredReleaseClient(KVStoreClient):
    """What-if prototype (not the shipped client): leases are released by one long-lived
    thread instead of a gRPC future per get_into (each future may start a thread)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._pending: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _release(self, lease_id: str) -> None:
        self._pending.put(lease_id)

    def _drain(self) -> None:
        while True:
            ids = [self._pending.get()]
            while not self._pending.empty():
                ids.append(self._pending.get_nowait())
            try:
                self.release(ids)
            except Exception:  # noqa: BLE001 - leases end by their TTL anyway
                pass


def bench_daemon(kind: str, reps: int) -> None:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    daemon, address, stop = (start_inproc if kind == "inproc" else start_process)(folder)
    label = "in-process daemon" if kind == "inproc" else "daemon in its own process"
    try:
        with KVStoreClient(address, timeout=60) as c, DeferredReleaseClient(address, timeout=60) as c2:
            bench_lookup(c, daemon, label, reps)
            bench_get(c, c2, daemon, label, reps)
    finally:
        stop()


def bench_lookup(c: KVStoreClient, daemon, label: str, reps: int) -> None:
    keys = [os.urandom(32) for _ in range(LOOKUP_BLOCKS)]
    c.put_from(keys, np.zeros(LOOKUP_BLOCKS * 64, np.uint8), sizes=64)
    assert c.lookup(keys).hit_blocks == LOOKUP_BLOCKS
    fns: dict[str, Callable[[], object]] = {
        "lookup": lambda: c.lookup(keys),
        "one": lambda: c.lookup(keys[:1]),
        "request": lambda: pb.LookupRequest(keys=keys).SerializeToString(),
    }
    if daemon is not None:
        wire = pb.LookupRequest(keys=keys).SerializeToString()
        fns["handler"] = lambda: daemon.service.Lookup(pb.LookupRequest.FromString(wire), None)
    t = interleaved(fns, reps)
    header(f"Lookup of {LOOKUP_BLOCKS:,} stored keys, {label}, {reps} rounds")
    row("KVStoreClient.lookup, end to end", t["lookup"], None, "< 3 ms")
    row("  Lookup of 1 key (the gRPC round trip)", t["one"])
    row("  client: LookupRequest built + serialized", t["request"])
    if "handler" in t:
        row("  server: request parsed + Lookup handler (no gRPC)", t["handler"])


def bench_get(c: KVStoreClient, c2: KVStoreClient, daemon, label: str, reps: int) -> None:
    if not c.shared_memory:
        print(f"\n(no shared arena on the {label}: lookup + get_into skipped)")
        return
    keys = [os.urandom(32) for _ in range(GET_BLOCKS)]
    src = np.random.default_rng(1).integers(0, 256, GET_BLOCKS * GET_BLOCK_BYTES, dtype=np.uint8)
    c.put_from(keys, src, sizes=GET_BLOCK_BYTES)
    out = np.zeros_like(src)
    hot = np.empty_like(src)
    arena = c.arena().array

    def lookup_get(client: KVStoreClient):
        hit = client.lookup(keys).hit_blocks
        return client.get_into(keys[:hit], out)

    assert lookup_get(c).found == GET_BLOCKS and np.array_equal(out, src)
    grant = c.lease(keys)
    spans = list(zip(grant.offsets, grant.sizes))

    def arena_copy():
        for j, (off, size) in enumerate(spans):
            out[j * GET_BLOCK_BYTES:j * GET_BLOCK_BYTES + size] = arena[off:off + size]

    def lease_release():
        c.release([c.lease(keys).lease_id])
    fns = {
        "target": lambda: lookup_get(c),
        "get_only": lambda: c.get_into(keys, out),
        "lookup": lambda: c.lookup(keys),
        "lease": lease_release,
        "copy": arena_copy,
        "memcpy": lambda: np.copyto(hot, src),
        "deferred": lambda: lookup_get(c2),
        "deferred_get": lambda: c2.get_into(keys, out),
    }
    setup = None
    if daemon is not None:
        m, service = daemon.manager, daemon.service
        request = pb.LeaseRequest(keys=keys, ttl_seconds=30.0, prefix=True)
        fns["handler"] = lambda: m.release(service.Lease(request, None).lease_id, "")
        fns["manager"] = lambda: m.release(m.lease(keys, 30.0, "").lease_id, "")
        fns["uncounted"] = fns["manager"]
        fns["uncounted_get"] = fns["deferred_get"]
        counting = m.counters.inc

        def setup(name: str) -> None:   # what-if rows run with the daemon's counters off
            m.counters.inc = (lambda name, n=1: None) if name.startswith("uncounted") else counting
    try:
        t = interleaved(fns, reps, setup)
    finally:
        if daemon is not None:
            vars(m.counters).pop("inc", None)
    futures_s = []
    for _ in range(min(reps, 200)):
        lease_id = c.lease(keys).lease_id
        t0 = time.perf_counter()
        c._arena_path.releaser.add(lease_id)
        futures_s.append(time.perf_counter() - t0)
    c.release([grant.lease_id])
    mib = GET_BLOCKS * GET_BLOCK_BYTES / (1 << 20)
    header(f"Lookup + get_into of a {GET_BLOCKS}-block prefix of {GET_BLOCK_BYTES >> 10} KiB blocks "
           f"({mib:.0f} MiB, shared memory), {label}, {reps} rounds")
    row("lookup + get_into, end to end", t["target"], t["memcpy"], "p50 < 1, p99 < 5")
    row("get_into alone (its prefix lease is the lookup)", t["get_only"], t["memcpy"])
    row("  Lookup RPC of the 128 keys", t["lookup"])
    row("  Lease RPC + Release RPC (synchronous)", t["lease"])
    if "handler" in t:
        row("  server: Lease handler + release (no gRPC)", t["handler"])
        row("  server: manager.lease + release of the 128 blocks", t["manager"])
        row("  what-if: manager.lease + release, counters off", t["uncounted"])
    row("  copy of the 128 blocks out of the mapped arena", t["copy"], t["memcpy"])
    row("  issuing the background Release (a gRPC future)", futures_s)
    row("  memcpy of the same 4 MiB (np.copyto, the floor)", t["memcpy"], t["memcpy"])
    row("what-if: lookup + get_into, releases by one thread", t["deferred"], t["memcpy"])
    row("what-if: get_into alone, releases by one thread", t["deferred_get"], t["memcpy"])
    if "uncounted_get" in t:
        row("what-if: get_into alone, one release thread, counters off", t["uncounted_get"], t["memcpy"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000, help="repetitions of each daemon figure (default 1000)")
    ap.add_argument("--daemon", choices=("both", "inproc", "process", "none"), default="both")
    args = ap.parse_args(argv)
    print(f"kvstore prefix lookup bench: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    bench_keys(args.reps)
    for kind in (("inproc", "process") if args.daemon == "both" else () if args.daemon == "none" else (args.daemon,)):
        bench_daemon(kind, args.reps)


if __name__ == "__main__":
    main()
