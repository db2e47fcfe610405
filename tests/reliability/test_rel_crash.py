"""Crash during writes: the daemon (a subprocess) is SIGKILLed at random points while
client threads put blocks concurrently, then restarted, several rounds on one NVMe folder.

After every restart: each block the daemon serves is complete and is its key's payload
(no partial block is ever visible, nothing is served twice under one key), no checksum
fails, and, after a graceful stop, the LMDB index and the block files agree exactly
(the temp files and orphans the kill left behind are cleaned at start).

Blocks acknowledged but only in the host tier at the kill are lost by design (host memory
is volatile); the report counts them (``acked_not_served``). Whether an acknowledged
write-through block survives a crash is checked deterministically at the manager level
(``test_rel_faults.py``).
"""

from __future__ import annotations

import random
import shutil
import threading
import time

import pytest

from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from rel_support import (DaemonProcess, is_payload_of, key, nvme_audit, payload, short_socket_dir,
                         size_for, write_toml)

ROUNDS = 6
WRITERS = 4
MAX_PUTS_PER_WRITER = 120          # bounds the bytes written per round (~30 MB at most)
MAX_BLOCK = 128 << 10


def block_size(k: bytes) -> int:
    return size_for(k, 1024, MAX_BLOCK)


def daemon_config(tmp_path, socket_dir, write: str):
    return write_toml(tmp_path / "node.toml", {
        "server": {"listen": f"unix:{socket_dir}/kvstore.sock", "workers": 8},
        "tiers": {"host": {"capacity": "1MiB"},
                  "nvme": {"path": str(tmp_path / "nvme"), "capacity": "1GiB"}},
        "policy": {"write": write},
    })


class Writers:
    """``WRITERS`` threads putting blocks (own new keys, plus keys shared by all threads)
    until the daemon dies, checking a random acknowledged block after each put."""

    def __init__(self, address: str, round_no: int, rng: random.Random):
        self.address = address
        self.round_no = round_no
        self.seed = rng.randrange(1 << 30)
        self.acked: set[bytes] = set()
        self.attempted: set[bytes] = set()
        self.wrong: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(WRITERS)]

    def start(self) -> "Writers":
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a writer hung after the daemon was killed"

    def _run(self, w: int) -> None:
        rng = random.Random(self.seed + w)
        mine: list[bytes] = []
        try:
            with KVStoreClient(self.address, timeout=10, chunk_bytes=32 << 10) as c:
                for n in range(MAX_PUTS_PER_WRITER):
                    if rng.random() < 0.25:          # a key every writer may put this round
                        keys = [key(rng.randrange(16), f"shared-{self.round_no}")]
                    else:                            # 1-3 new keys of this writer
                        keys = [key(n * 4 + j, f"r{self.round_no}-w{w}") for j in range(rng.randint(1, 3))]
                    with self.lock:
                        self.attempted.update(keys)
                    c.put([(k, payload(k, block_size(k))) for k in keys])
                    with self.lock:
                        self.acked.update(keys)
                    mine.extend(keys)
                    probe = rng.choice(mine)
                    got = c.get([probe])[0]
                    if not (got.found and is_payload_of(probe, got.data, block_size(probe))):
                        with self.lock:
                            self.wrong.append(f"{probe.hex()[:16]} found={got.found} len={len(got.data)}")
        except errors.KVStoreError:
            pass                                     # the daemon was killed under us


def served_blocks(address: str, keys: list[bytes]) -> tuple[set[bytes], list[str]]:
    """Keys the daemon serves, and a description of every block served wrong."""
    found, wrong = set(), []
    with KVStoreClient(address, timeout=120) as c:      # generous: the audit, not a deadline, is tested
        for i in range(0, len(keys), 64):
            batch = keys[i:i + 64]
            for k, got in zip(batch, c.get(batch)):
                assert got.key == k
                if not got.found:
                    continue
                if is_payload_of(k, got.data, block_size(k)):
                    found.add(k)
                else:
                    wrong.append(f"{k.hex()[:16]}: {len(got.data)} bytes, expected {block_size(k)}")
        lookups = c.lookup(sorted(found)).hit_blocks if found else 0
        counters = c.stats()["counters"]
    assert lookups == len(found), "lookup disagrees with get"
    assert counters.get("corrupt_blocks", 0) == 0, counters
    return found, wrong


@pytest.mark.slow
def test_sigkill_at_random_points_during_concurrent_puts(tmp_path):
    rng = random.Random(6_2026)
    socket_dir = short_socket_dir()
    nvme = tmp_path / "nvme"
    attempted: set[bytes] = set()
    report = []
    try:
        for rnd in range(ROUNDS):
            write = "write_through" if rnd % 2 else "write_back"
            cfg = daemon_config(tmp_path, socket_dir, write)
            d = DaemonProcess(cfg, f"unix:{socket_dir}/kvstore.sock", tmp_path / f"daemon-{rnd}.log").start()
            writers = Writers(d.address, rnd, rng).start()
            time.sleep(rng.uniform(0.2, 0.9))
            d.kill()
            writers.join()
            assert not writers.wrong, f"round {rnd}: served wrong bytes during the load: {writers.wrong[:5]}"
            attempted |= writers.attempted
            crashed = nvme_audit(nvme, verify_checksums=False)

            if rnd == 2:                             # a kill during recovery itself
                d.start(wait=False)
                time.sleep(rng.uniform(0.05, 0.4))
                d.kill()

            d.start()
            found, wrong = served_blocks(d.address, sorted(attempted))
            assert not wrong, f"round {rnd}: blocks served with wrong bytes after restart: {wrong[:5]}"
            assert d.stop() == 0
            clean = nvme_audit(nvme)
            problems = {k: clean[k] for k in ("temp", "orphans", "missing", "bad_size", "bad_header",
                                               "bad_checksum", "misplaced", "other") if clean[k]}
            assert not problems, f"round {rnd}: index and files disagree after recovery: {problems}"
            assert clean["keys"] == found, (f"round {rnd}: {len(clean['keys'] - found)} indexed blocks not "
                                            f"served, {len(found - clean['keys'])} served blocks not indexed")
            report.append(dict(round=rnd, write=write, attempted=len(writers.attempted),
                               acked=len(writers.acked), acked_not_served=len(writers.acked - found),
                               temp_at_kill=crashed["temp"],
                               orphans_at_kill=crashed["orphans"], missing_at_kill=crashed["missing"],
                               served_after_restart=len(found)))
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    for r in report:
        print("crash round", r)
    assert len(report) == ROUNDS
    assert sum(r["acked"] for r in report) > 0, "no put was acknowledged in any round"
    assert report[-1]["served_after_restart"] > 0
