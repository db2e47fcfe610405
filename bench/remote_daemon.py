"""Daemon-level cluster throughput for ``bench/remote.py``: two ``kvstore serve`` processes
joined to the benchmark's loopback cluster as pure clients (every byte crosses the
Transfer Engine to the storage node), measured through their gRPC clients:

- ``daemon get (remote)``: a client of daemon B gets blocks that only the cluster holds
  (B pages them into its host arena, verifies them, streams them back);
- ``daemon get_into (remote)``: the same through the shared arena (Lease: page-in, one
  copy into the caller's buffer);
- ``daemon put (write-through)``: a client of daemon A puts blocks; A answers once the
  cluster holds them too (``[policy] write = "write_through"``);

and, as in-run baselines, the same calls on blocks B already holds (``daemon get
(local)``) and puts to B, which does not write through (``daemon put (local)``).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from kvstore.client.client import KVStoreClient


def _config(sock: pathlib.Path, master, host: int, write: str, staging: int) -> str:
    return f"""
[server]
listen = "unix:{sock}"
max_message_bytes = "64MiB"
[tiers.host]
capacity = {host}
[tiers.nvme]
enabled = false
[tiers.remote]
enabled = true
master = "{master.address}"
metadata_server = "{master.metadata_server}"
capacity = "64GiB"
segment = 0
staging = {staging}
timeout_s = 5.0
[policy]
write = "{write}"
"""


class Daemons:
    """Daemon A (write-through) and daemon B (write-back) of ``master``'s cluster, in
    their own processes; ``host_bytes`` of arena each."""

    def __init__(self, master, host_bytes: int, staging_bytes: int):
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix="kvsrd-"))
        self.procs: list[subprocess.Popen] = []
        self.clients: list[KVStoreClient] = []
        for name, write in (("a", "write_through"), ("b", "write_back")):
            sock = self.folder / name / "kvstore.sock"
            sock.parent.mkdir()
            cfg = sock.parent / "node.toml"
            cfg.write_text(_config(sock, master, host_bytes, write, staging_bytes))
            log = open(sock.parent / "daemon.log", "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(cfg)],
                                               cwd=sock.parent, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL))
            log.close()
            client = KVStoreClient(f"unix:{sock}", timeout=300)
            client.wait_ready(timeout=120)
            self.clients.append(client)
        self.a, self.b = self.clients
        deadline = time.monotonic() + 120
        for c in self.clients:                       # until each is connected to the master
            while c.stats()["problems"] and time.monotonic() < deadline:
                time.sleep(0.2)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def daemon_rates(d: Daemons, tier, blocks: list, size: int, batch: int, total: int) -> dict[str, float]:
    """GB/s of each daemon call above for ``batch`` blocks of ``size`` bytes per call,
    over ``total`` bytes (one warm-up call first). ``tier`` (the benchmark's own remote
    tier) puts the blocks B then finds only in the cluster, outside the timing."""
    rounds = max(1, total // (size * batch)) + 1
    run = uuid.uuid4().bytes[:8]

    def keys(tag: int, r: int) -> list[bytes]:
        return [run + bytes([tag]) + r.to_bytes(4, "big") + i.to_bytes(4, "big") + bytes(15) for i in range(batch)]

    def timed(fn) -> float:
        fn(0)
        t0 = time.perf_counter()
        for r in range(1, rounds):
            fn(r)
        return (rounds - 1) * size * batch / (time.perf_counter() - t0) / 1e9

    def forget(tag: int, client: KVStoreClient, cluster: bool) -> None:
        """Free blocks from a daemon (and the benchmark's cluster copies), untimed."""
        for r in range(rounds):
            client.delete(keys(tag, r))
            if cluster:
                for k in keys(tag, r):
                    tier.free(k)
        tier.flush(60)

    rates = {}
    for tag in (1, 2):                                 # blocks only the cluster holds
        for r in range(rounds):
            assert tier.put_many(list(zip(keys(tag, r), blocks))) == [True] * batch

    def get_remote(r):
        got = d.b.get(keys(1, r))
        assert all(g.found and g.tier.name == "REMOTE" for g in got), [g.tier for g in got]
    rates["daemon get (remote)"] = timed(get_remote)
    assert all(bytes(g.data) == bytes(b) for g, b in zip(d.b.get(keys(1, 1)), blocks))

    def get_local(r):
        got = d.b.get(keys(1, r))
        assert all(g.found and g.tier.name == "HOST" for g in got)
    rates["daemon get (local)"] = timed(get_local)
    forget(1, d.b, cluster=True)
    out = np.empty(size * batch, np.uint8)

    def get_into(r):
        assert d.b.get_into(keys(2, r), out).found == batch
    rates["daemon get_into (remote)"] = timed(get_into)
    assert out[:size].tobytes() == bytes(blocks[0])
    rates["daemon get_into (local)"] = timed(get_into)
    forget(2, d.b, cluster=True)

    def put_through(r):
        assert d.a.put(list(zip(keys(3, r), blocks))).stored == batch
    rates["daemon put (write-through)"] = timed(put_through)
    forget(3, d.a, cluster=False)                      # A's delete drops its cluster copies too

    def put_local(r):
        assert d.b.put(list(zip(keys(4, r), blocks))).stored == batch
    rates["daemon put (local)"] = timed(put_local)
    forget(4, d.b, cluster=False)
    return rates


__all__ = ["Daemons", "daemon_rates"]
