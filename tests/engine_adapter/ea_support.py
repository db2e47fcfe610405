"""Test support for engine_adapter: an in-memory store, fault injection, a daemon on a socket.

Not a test module (no ``test_`` prefix); the TP=2 worker in ``ea_tp_worker.py`` and
the tests import it.
"""

from __future__ import annotations

import pathlib
import tempfile
import threading
import time
from typing import Sequence

from kvstore import config
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.types import GetResult, LookupResult
from tiers.base import TierKind, check_ranges

from engine_adapter.config import EngineConfig, ModelConfig

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=32)


def engine(tenant: str = "", **kw) -> EngineConfig:
    """Engine settings of the tests: 16-token blocks, timeouts generous enough for a saturated
    machine (a test that wants a timeout sets a short one and makes the store hang)."""
    base = dict(model_id="tiny-llama-test", block_tokens=16, num_cache_blocks=64, tenant=tenant,
                load_timeout_s=60.0, store_timeout_s=60.0)
    base.update(kw)
    return EngineConfig(**base)


class MemoryStore:
    """In-memory stand-in of the daemon with the client's call signatures (a BlockStore)."""

    def __init__(self):
        self.blocks: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.block_tokens = 0            # the node's [blocks] block_tokens (0: not set)

    def check_block_tokens(self, block_tokens: int) -> None:
        if self.block_tokens and self.block_tokens != block_tokens:
            raise InvalidRequest(f"the node is configured for {self.block_tokens}-token blocks")

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        self.calls.append("lookup")
        n = 0
        with self.lock:
            while n < len(keys) and keys[n] in self.blocks:
                n += 1
        return LookupResult(n, (TierKind.HOST,) * n)

    def get(self, keys, ranges=None, stop_at_miss=False, timeout=None) -> list[GetResult]:
        self.calls.append("get")
        out = []
        for k in keys:
            with self.lock:
                data = self.blocks.get(k)
            if data is None:
                out.append(GetResult(k, False))
                if stop_at_miss:
                    break
                continue
            check_ranges(ranges, len(data))
            if ranges:
                data = b"".join(data[o:o + n] for o, n in ranges)
            out.append(GetResult(k, True, TierKind.HOST, data))
        return out

    def put(self, blocks, timeout=None):
        self.calls.append("put")
        with self.lock:
            for k, data in blocks:
                self.blocks.setdefault(bytes(k), bytes(data))

    def delete(self, keys, timeout=None) -> int:
        with self.lock:
            return sum(self.blocks.pop(k, None) is not None for k in keys)


class FaultyStore:
    """Wraps a store and injects one kind of fault into Get calls once armed.

    ``arm(mode, key=..., after_gets=n)``: the fault applies from the ``n``-th Get after
    arming (``n = 2``: layers 0 and 1 load fine, layer 2 on fail), until disarmed.

    Modes: ``"missing"`` (``key`` reported not found; with ``in_lookup`` the Lookup also
    stops before it), ``"corrupt"`` (``key``'s bytes
    truncated), ``"down"`` (StoreUnavailable), ``"hang"`` (waits until :meth:`release`
    or ``hang_s``, then StoreUnavailable, like a deadline; ``hanging`` is set meanwhile).
    ``hold_puts()`` makes every Put wait until :meth:`release` (``put_started`` is set
    when one waits, ``put_done`` when one returned).
    """

    def __init__(self, inner):
        self.inner = inner
        self.mode: str | None = None
        self.key: bytes | None = None
        self.after_gets = 0
        self.gets_since_armed = 0
        self.hang_s = 0.0
        self.in_lookup = False
        self.put_started = threading.Event()
        self.put_done = threading.Event()
        self.hanging = threading.Event()
        self._gate = threading.Event()
        self._gate.set()

    def hold_puts(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        """End every hang and held Put now."""
        self._gate.set()

    def arm(self, mode: str, key: bytes | None = None, after_gets: int = 0, hang_s: float = 0.0,
            in_lookup: bool = False) -> None:
        self.mode, self.key, self.after_gets, self.hang_s = mode, key, after_gets, hang_s
        self.in_lookup = in_lookup
        self.gets_since_armed = 0

    def disarm(self) -> None:
        self.mode = None

    def check_block_tokens(self, block_tokens: int) -> None:
        self.inner.check_block_tokens(block_tokens)

    def lookup(self, keys, timeout=None):
        if self.mode == "down" and self.gets_since_armed >= self.after_gets:
            raise StoreUnavailable("UNAVAILABLE: injected")
        if self.mode == "missing" and self.in_lookup and self.key in keys:
            keys = keys[:list(keys).index(self.key)]
        return self.inner.lookup(keys, timeout=timeout)

    def get(self, keys, ranges=None, stop_at_miss=False, timeout=None):
        active = self.mode is not None and self.gets_since_armed >= self.after_gets
        self.gets_since_armed += 1
        if active and self.mode == "down":
            raise StoreUnavailable("UNAVAILABLE: injected")
        if active and self.mode == "hang":
            self._gate.clear()
            self.hanging.set()
            self._gate.wait(self.hang_s)
            self.hanging.clear()
            raise StoreUnavailable("DEADLINE_EXCEEDED: injected")
        res = self.inner.get(keys, ranges=ranges, stop_at_miss=stop_at_miss, timeout=timeout)
        if not active or self.key is None:
            return res
        out = []
        for r in res:
            if r.key == self.key and self.mode == "missing":
                out.append(GetResult(r.key, False))
                if stop_at_miss:
                    break
            elif r.key == self.key and self.mode == "corrupt":
                out.append(GetResult(r.key, True, r.tier, r.data[: len(r.data) // 2]))
            else:
                out.append(r)
        return out

    def put(self, blocks, timeout=None):
        self.put_started.set()
        self._gate.wait(60)
        try:
            if self.mode == "down":
                raise StoreUnavailable("UNAVAILABLE: injected")
            return self.inner.put(blocks, timeout=timeout)
        finally:
            self.put_done.set()

    def delete(self, keys, timeout=None):
        return self.inner.delete(keys, timeout=timeout)


def short_dir(prefix: str = "ea-") -> pathlib.Path:
    """A short folder for a unix socket (paths are limited to ~107 bytes)."""
    return pathlib.Path(tempfile.mkdtemp(prefix=prefix))


def daemon_config(data_dir: pathlib.Path) -> config.Config:
    """Host + NVMe tiers, NVMe files under ``data_dir``, a unix socket in a short folder.

    Falls back to the host tier alone while the NVMe tier module is not there yet.
    """
    try:
        import tiers.nvme  # noqa: F401
        nvme = {"enabled": True, "path": str(data_dir / "nvme"), "capacity": "256MiB"}
    except ImportError:
        nvme = {"enabled": False}
    return config.from_dict({
        "server": {"listen": f"unix:{short_dir()}/kvstore.sock", "workers": 4},
        "tiers": {"host": {"capacity": "64MiB"}, "nvme": nvme},
    })


def start_daemon(data_dir: pathlib.Path):
    """Start the real daemon in this process; returns the Daemon (``.address``, ``.stop()``)."""
    from kvstore.serve import start_server

    return start_server(daemon_config(data_dir))
