"""Daemons joined into one Mooncake cluster on loopback, for the cluster tests.

``mooncake_master`` (a fixture) starts a master; :func:`node_config` gives a daemon's
config with ``[tiers.remote]`` pointing at it; :class:`Timed` wraps a client and records
how long each call took (fault tests bound them); :func:`ideal_hit_rate` is the
single-node ideal of a trace (an unbounded cache, prefix semantics). Everything skips,
naming the missing package, when the Mooncake wheel or libibverbs1 is absent.
"""

from __future__ import annotations

import pathlib
import tempfile
import threading
import time

import pytest

from kvstore import config
from kvstore.tools.replay import block_token_counts


def require_mooncake() -> None:
    from tiers.mooncake.client import mooncake_missing

    reason = mooncake_missing()
    if reason:
        pytest.skip(f"Mooncake unavailable: {reason}")


@pytest.fixture
def mooncake_master():
    """A master (and its HTTP metadata server) on 127.0.0.1 for one test."""
    require_mooncake()
    from tiers.mooncake.local_cluster import LocalMaster

    master = LocalMaster(client_ttl_s=3).start()
    yield master
    master.stop()


def remote_section(master, **overrides) -> dict:
    """``[tiers.remote]`` for a daemon of ``master``'s cluster (deadlines of a second)."""
    section = {"enabled": True, "master": master.address, "metadata_server": master.metadata_server,
               "capacity": "256MiB", "segment": "64MiB", "staging": "16MiB", "timeout_s": 1.0,
               "cooldown_s": 1.0, "lookup_timeout_s": 0.5}
    section.update(overrides)
    return section


def node_config(folder: pathlib.Path, master, *, host: str = "128MiB", write: str = "write_back",
                listen: str | None = None, **remote) -> config.Config:
    """A daemon with a host tier (no NVMe) and the cluster tier; its files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = pathlib.Path(tempfile.mkdtemp(prefix="kvc-")) / "kvstore.sock"      # short: unix socket paths
    return config.from_dict({
        "server": {"listen": listen or f"unix:{sock}", "workers": 8},
        "tiers": {"host": {"capacity": host}, "nvme": {"enabled": False},
                  "remote": remote_section(master, **remote)},
        "policy": {"write": write},
    })


def wait_connected(*daemons, timeout_s: float = 60.0) -> None:
    """Wait until every daemon's remote tier has its session with the master."""
    for d in daemons:
        tier = d.manager.tiers[-1]
        assert tier.wait_connected(timeout_s), tier.health


def stop_all(daemons) -> None:
    """Stop daemons in parallel (closing a Mooncake client takes about a second)."""
    threads = [threading.Thread(target=d.stop, args=(0,), kwargs={"persist_s": 0}) for d in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


class Timed:
    """A client whose lookup, get and put calls are timed (``seconds``: (name, s) pairs)."""

    def __init__(self, client):
        self.client = client
        self.seconds: list[tuple[str, float]] = []

    def _timed(self, name, fn, *args, **kw):
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            self.seconds.append((name, time.monotonic() - t0))

    def check_block_tokens(self, block_tokens):
        return self.client.check_block_tokens(block_tokens)

    def lookup(self, keys, **kw):
        return self._timed("lookup", self.client.lookup, keys, **kw)

    def get(self, keys, **kw):
        return self._timed("get", lambda: list(self.client.get(keys, **kw)))

    def put(self, blocks, **kw):
        return self._timed("put", self.client.put, list(blocks), **kw)

    @property
    def slowest(self) -> tuple[str, float]:
        return max(self.seconds, key=lambda x: x[1], default=("", 0.0))


def ideal_hit_rate(requests) -> float:
    """Token hit rate of an unbounded single cache with prefix semantics (the bound any
    replay of ``requests`` can reach)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        tokens = block_token_counts(r.input_length, len(r.hash_ids))
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hit += sum(tokens[:n])
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0
