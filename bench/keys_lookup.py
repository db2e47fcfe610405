#!/usr/bin/env python3
"""Prefix lookup at agent scale: block keys, Lookup, and lookup + get_into of a prefix.

Every figure is measured in this run; the keys are compared with the raw chained SHA-256
measured alongside (rounds interleaved, so load on the machine hits both alike):

1. **Keys of a 128k-token prompt** (8,192 blocks of 16 tokens): ``BlockKeyer.keys`` from a
   numpy array and from a list, and the old per-block ``chain_key`` loop, against the raw
   chained SHA-256 (the same hashlib calls over bytes encoded beforehand, untimed).
2. **An agent turn that appends 512 tokens** to that prompt: ``TrajectoryKeyer.keys`` of
   the whole new prompt, after the previous turn (untimed).
3. **Lookup of 8,192 stored keys** through ``KVStoreClient.lookup`` (a LOOKUP control frame
   on the arena session), next to the same lookup by gRPC (the path before control frames),
   with its parts: the request built and serialized on the client, the server handler called
   directly.
4. **Lookup + get_into of a 128-block prefix of 32 KiB blocks** through the same-node
   shared-memory path: both answered from the daemon's block table (no round trip; the
   daemon is told in frames it does not answer), next to the same calls as LOOKUP and LEASE
   control frames (the path before the table: ``KVSTORE_BLOCK_TABLE=0``) and by gRPC (Lookup
   and Lease RPCs), all measured in the same rounds, with its parts (the table lookup, the
   frames, the copy out of the arena) and the memcpy of the same 4 MiB; and Mooncake's in-process ``batch_is_exist`` + ``batch_get_into`` of the same
   prefix when its wheel is installed (a line says why not otherwise), with our p50 / its p50.
   The load average before and after the rounds is printed: the machine may be shared. The
   same-node arms are then measured again in rounds of their own, without the gRPC arms (a
   gRPC call leaves the client's gRPC threads busy for a while, which slows what follows).

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
import random
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import config  # noqa: E402
from kvstore._proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.client.client import KVStoreClient  # noqa: E402
from kvstore.common.host_copy import copy_spans, words_enabled  # noqa: E402
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


def grpc_control(c: KVStoreClient) -> KVStoreClient:
    """``c`` with its arena mapped but its block table and control frames off: Lookup and
    Lease go by gRPC, the path before same-node control frames (the "before" rows, measured
    in the same run)."""
    arena = without_table(c).arena()
    if arena is not None:
        arena.control = None
    return c


def without_table(c: KVStoreClient) -> KVStoreClient:
    """``c`` with its arena mapped but the block table unused: every read takes a LEASE
    frame, every lookup a LOOKUP frame (the path before the table)."""
    arena = c.arena()
    if arena is not None and arena.table is not None:
        arena.table.close()
        arena.table = None
    return c


def bench_daemon(kind: str, reps: int) -> None:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    daemon, address, stop = (start_inproc if kind == "inproc" else start_process)(folder)
    label = "in-process daemon" if kind == "inproc" else "daemon in its own process"
    try:
        with KVStoreClient(address, timeout=60) as c, KVStoreClient(address, timeout=60) as before, \
                KVStoreClient(address, timeout=60) as frames:
            bench_lookup(without_table(frames), grpc_control(before), daemon, label, reps)
            bench_get(c, frames, before, daemon, label, reps)
    finally:
        stop()


def bench_lookup(c: KVStoreClient, before: KVStoreClient, daemon, label: str, reps: int) -> None:
    keys = [os.urandom(32) for _ in range(LOOKUP_BLOCKS)]
    c.put_from(keys, np.zeros(LOOKUP_BLOCKS * 64, np.uint8), sizes=64)
    assert c.lookup(keys).hit_blocks == LOOKUP_BLOCKS == before.lookup(keys).hit_blocks
    fns: dict[str, Callable[[], object]] = {
        "lookup": lambda: c.lookup(keys),
        "before": lambda: before.lookup(keys),
        "one": lambda: c.lookup(keys[:1]),
        "one_before": lambda: before.lookup(keys[:1]),
        "request": lambda: pb.LookupRequest(keys=keys).SerializeToString(),
    }
    if daemon is not None:
        wire = pb.LookupRequest(keys=keys).SerializeToString()
        fns["handler"] = lambda: daemon.service.Lookup(pb.LookupRequest.FromString(wire), None)
    t = interleaved(fns, reps)
    header(f"Lookup of {LOOKUP_BLOCKS:,} stored keys, {label}, {reps} rounds")
    row("KVStoreClient.lookup, end to end (a control frame)", t["lookup"], t["before"], "< 3 ms")
    row("  the same by gRPC (before: the Lookup RPC)", t["before"], t["before"])
    row("  lookup of 1 key (the control frame round trip)", t["one"])
    row("  lookup of 1 key by gRPC (the RPC round trip)", t["one_before"])
    row("  client: LookupRequest built + serialized", t["request"])
    if "handler" in t:
        row("  server: request parsed + Lookup handler (no gRPC)", t["handler"])


def mooncake_batch_get(reps: int) -> list[float] | None:
    """Seconds per ``batch_is_exist`` + ``batch_get_into`` of the prefix in an in-process
    Mooncake store (its segment in this process), or None (printed why) without the wheel."""
    from tiers.mooncake.client import mooncake_missing, store_class
    why = mooncake_missing()
    if why:
        print(f"\n(Mooncake in-process batch get skipped: {why})")
        return None
    from tiers.mooncake.local_cluster import LocalMaster
    master = LocalMaster().start()
    try:
        store = store_class()()
        assert store.setup({"local_hostname": "127.0.0.1", "metadata_server": master.metadata_server,
                            "global_segment_size": 256 << 20, "local_buffer_size": 64 << 20, "protocol": "tcp",
                            "master_server_addr": master.address}) == 0
        src = np.random.default_rng(1).integers(0, 256, GET_BLOCKS * GET_BLOCK_BYTES, dtype=np.uint8)
        out = np.zeros_like(src)
        for b in (src, out):
            assert store.register_buffer(b.ctypes.data, b.nbytes) == 0
        names = [f"bench/{i}" for i in range(GET_BLOCKS)]
        ptrs = [src.ctypes.data + i * GET_BLOCK_BYTES for i in range(GET_BLOCKS)]
        assert store.batch_put_from(names, ptrs, [GET_BLOCK_BYTES] * GET_BLOCKS) == [0] * GET_BLOCKS
        dst = [out.ctypes.data + i * GET_BLOCK_BYTES for i in range(GET_BLOCKS)]

        def get():
            hit = next((i for i, e in enumerate(store.batch_is_exist(names)) if e != 1), GET_BLOCKS)
            assert store.batch_get_into(names[:hit], dst[:hit], [GET_BLOCK_BYTES] * hit) == [GET_BLOCK_BYTES] * hit
        get()
        assert np.array_equal(out, src)
        samples = interleaved({"get": get}, reps)["get"]
        store.close()
        return samples
    finally:
        master.stop()


GET_ROWS = (          # (label, arm, its baseline arm, target): the rows of the arms a pass measured
    ("lookup + get_into, end to end (block table, no round trip)", "target", "frames", "p50 <= 0.5, p99 <= 1.5"),
    ("  the same by control frames (before: LOOKUP and LEASE)", "frames", "frames", ""),
    ("  the same by gRPC (Lookup and Lease RPCs)", "before", "frames", ""),
    ("get_into alone (block table)", "get_only", "get_frames", ""),
    ("  the same by a LEASE frame (before; its prefix lease is the lookup)", "get_frames", "get_frames", ""),
    ("  the same by gRPC", "get_before", "get_frames", ""),
    ("  lookup of the 128 keys in the block table (and its NO_REPLY note)", "table_lookup", "lookup", ""),
    ("  LOOKUP frame of the 128 keys", "lookup", "lookup", ""),
    ("  LEASE frame + RELEASE frame answered (synchronous)", "lease", "lease_before", ""),
    ("  Lease RPC + Release RPC (before)", "lease_before", "lease_before", ""),
    ("  server: manager.lease + release of the 128 blocks", "manager", None, ""),
    ("  copy of the 128 blocks out of the mapped arena", "copy", "memcpy", ""),
    ("    the same by one memcpy per block (slice assignment)", "copy_memcpy", "memcpy", ""),
    ("  memcpy of the same 4 MiB (np.copyto, the floor)", "memcpy", "memcpy", ""),
)


def get_rows(t: dict[str, list[float]]) -> None:
    for label, arm, base, target in GET_ROWS:
        if arm in t:
            row(label, t[arm], t[base] if base else None, target)


def bench_get(c: KVStoreClient, frames: KVStoreClient, before: KVStoreClient, daemon, label: str,
              reps: int) -> None:
    if not c.shared_memory:
        print(f"\n(no shared arena on the {label}: lookup + get_into skipped)")
        return
    keys = [os.urandom(32) for _ in range(GET_BLOCKS)]
    src = np.random.default_rng(1).integers(0, 256, GET_BLOCKS * GET_BLOCK_BYTES, dtype=np.uint8)
    c.put_from(keys, src, sizes=GET_BLOCK_BYTES)
    out = np.zeros_like(src)
    hot = np.empty_like(src)
    arena = c.arena()

    def lookup_get(client: KVStoreClient):
        hit = client.lookup(keys).hit_blocks
        return client.get_into(keys[:hit], out)

    assert arena.control is not None, "the daemon serves no control frames"
    table = arena.table
    print(f"\n(block table: {'mapped' if table is not None else 'not handed out: the table rows repeat the frames'})")
    for client in (c, frames, before):
        out[:] = 0
        assert lookup_get(client).found == GET_BLOCKS and np.array_equal(out, src)
    grant = c.lease(keys)
    spans = list(zip(grant.offsets, grant.sizes))

    def arena_copy():
        copy_spans(out, [j * GET_BLOCK_BYTES for j in range(len(spans))], arena.array,
                   [off for off, _ in spans], [size for _, size in spans])

    def arena_memcpy():
        for j, (off, size) in enumerate(spans):
            out[j * GET_BLOCK_BYTES:j * GET_BLOCK_BYTES + size] = arena.array[off:off + size]

    fns = {
        "target": lambda: lookup_get(c),
        "frames": lambda: lookup_get(frames),
        "before": lambda: lookup_get(before),
        "get_only": lambda: c.get_into(keys, out),
        "get_frames": lambda: frames.get_into(keys, out),
        "get_before": lambda: before.get_into(keys, out),
        "table_lookup": lambda: c.lookup(keys),
        "lookup": lambda: frames.lookup(keys),
        "lease": lambda: c.release([c.lease(keys).lease_id]),
        "lease_before": lambda: before.release([before.lease(keys).lease_id]),
        "copy": arena_copy,
        "copy_memcpy": arena_memcpy,
        "memcpy": lambda: np.copyto(hot, src),
    }
    if daemon is not None:
        m = daemon.manager
        fns["manager"] = lambda: m.release(m.lease(keys, 30.0, "").lease_id, "")
    load0 = os.getloadavg()[0]
    t = interleaved(fns, reps)
    load1 = os.getloadavg()[0]
    c.release([grant.lease_id])
    mib = GET_BLOCKS * GET_BLOCK_BYTES / (1 << 20)
    header(f"Lookup + get_into of a {GET_BLOCKS}-block prefix of {GET_BLOCK_BYTES >> 10} KiB blocks "
           f"({mib:.0f} MiB, shared memory), {label}, {reps} interleaved rounds, load {load0:.1f} -> {load1:.1f}")
    get_rows(t)
    print(f"  (block copies take {'the word loop where memcpy is slow here' if words_enabled() else 'memcpy'}: "
          "kvstore.common.host_copy; KVSTORE_HOST_COPY=memcpy|words forces either)")
    # The same-node arms again without the gRPC ones: a gRPC call leaves the client's gRPC
    # threads busy for a while after it (they take the GIL), which slows whatever runs next.
    local = ("target", "frames", "get_only", "get_frames", "table_lookup", "lookup", "copy", "memcpy")
    load0 = os.getloadavg()[0]
    u = interleaved({name: fns[name] for name in local}, reps)
    header(f"The same, same-node arms only (no gRPC call in these rounds), {reps} interleaved rounds, "
           f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    get_rows(u)
    mooncake = mooncake_batch_get(reps)
    if mooncake is not None:
        row("Mooncake in-process batch_is_exist + batch_get_into", mooncake)
        ours, theirs = stats_ms(u["target"])[0], stats_ms(mooncake)[0]
        print(f"  our p50 (same-node arms only) / Mooncake's p50: {ours / theirs:.2f} (goal <= 0.6)")


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
