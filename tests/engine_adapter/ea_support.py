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

import numpy as np

from kvstore import config
from kvstore.client.buffers import BlockBuffers, host_view
from kvstore.client.client import GetIntoResult
from kvstore.common.errors import InvalidRequest, StoreUnavailable
from kvstore.common.types import LookupResult, PutResult
from tiers.base import TierKind, check_ranges
from tiers.errors import InvalidAccess

from engine_adapter.layout import namespace
from engine_adapter.reference.config import EngineConfig, ModelConfig
from engine_adapter.reference.weights import SeededWeights

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=32)


def engine(tenant: str = "", **kw) -> EngineConfig:
    """Engine settings of the tests: 16-token blocks, timeouts generous enough for a saturated
    machine (a test that wants a timeout sets a short one and makes the store hang)."""
    base = dict(model_id="tiny-llama-test", block_tokens=16, num_cache_blocks=64, tenant=tenant,
                load_timeout_s=60.0, store_timeout_s=60.0, lookup_timeout_s=60.0)
    base.update(kw)
    return EngineConfig(**base)


def runner_namespace(eng: EngineConfig, model: ModelConfig = TINY, seed: int = 0):
    """The namespace a ``Runner`` of seeded weights (``seed``) keys its blocks under."""
    return namespace(model, eng, weights=SeededWeights(model, seed).identity(), model_config=model.fingerprint())


class MemoryStore:
    """In-memory stand-in of the daemon with the client's call signatures (a BlockStore).

    ``get_into`` / ``put_from`` follow :class:`kvstore.client.KVStoreClient`: the same
    buffer handling (:class:`kvstore.client.buffers.BlockBuffers`: one buffer per key, or one
    buffer with blocks back to back or at ``offsets``), ranges concatenated per block,
    a miss for a block too short for the ranges, InvalidRequest for a buffer too small, and with
    ``stop_at_miss`` nothing copied from the first miss on. ``calls`` records the calls.
    """

    def __init__(self):
        self.blocks: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.block_tokens = 0            # the node's [blocks] block_tokens (0: not set)
        self.metas: dict[bytes, object] = {}   # key -> the BlockMeta its put carried

    def check_block_tokens(self, block_tokens: int) -> None:
        if self.block_tokens and self.block_tokens != block_tokens:
            raise InvalidRequest(f"the node is configured for {self.block_tokens}-token blocks")

    def ping(self, timeout: float = 1.0) -> None:
        """Always answers (the breaker's probe)."""

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        self.calls.append("lookup")
        n = 0
        with self.lock:
            while n < len(keys) and keys[n] in self.blocks:
                n += 1
        return LookupResult(n, (TierKind.HOST,) * n)

    def get_into(self, keys, out, *, ranges=None, offsets=None, stop_at_miss=True, timeout=None) -> GetIntoResult:
        self.calls.append("get_into")
        keys = list(keys)
        bufs = BlockBuffers(out, len(keys), writable=True, offsets=offsets)
        sizes, codes = [0] * len(keys), bytearray(len(keys))
        for i, k in enumerate(keys):
            with self.lock:
                data = self.blocks.get(k)
            if data is None:
                if stop_at_miss:
                    break
                continue
            try:
                check_ranges(ranges, len(data))
            except InvalidAccess:                 # too short for the ranges: a miss
                if stop_at_miss:
                    break
                continue
            if ranges:
                data = b"".join(data[o:o + n] for o, n in ranges)
            bufs.slot(i, len(data))[:] = np.frombuffer(data, dtype=np.uint8)
            sizes[i], codes[i] = len(data), TierKind.HOST
        bufs.finish()
        found = 0
        while found < len(keys) and codes[found]:
            found += 1
        return GetIntoResult(found if stop_at_miss else sum(1 for c in codes if c), sizes, bytes(codes))

    def put_from(self, keys, src, *, sizes=None, offsets=None, meta=None, timeout=None) -> PutResult:
        self.calls.append("put_from")
        if meta is not None:
            self.metas.update(zip(map(bytes, keys), meta))
        keys = list(keys)
        bufs = BlockBuffers(src, len(keys), writable=False, offsets=offsets, sizes=sizes)
        stored = present = nbytes = 0
        for i, n in enumerate(bufs.block_sizes()):
            data = bufs.slot(i, n).tobytes()
            with self.lock:
                if keys[i] in self.blocks:
                    present += 1
                    continue
                self.blocks[bytes(keys[i])] = data
            stored, nbytes = stored + 1, nbytes + n
        return PutResult(stored, present, nbytes)

    def delete(self, keys, timeout=None) -> int:
        with self.lock:
            return sum(self.blocks.pop(k, None) is not None for k in keys)


class FaultyStore:
    """Wraps a store and injects one kind of fault into ``get_into`` calls once armed.

    ``arm(mode, key=..., after_gets=n)``: the fault applies from the ``n``-th
    ``get_into`` after arming (the page back makes one call per layer group of
    :func:`engine_adapter.reference.transfer.layer_groups`: with 4 layers ``n = 1`` lets layer
    0 load and faults layers 1-3), until disarmed.

    Modes: ``"missing"`` (``key`` reported not found, and with ``stop_at_miss`` the
    blocks after it too, as the daemon does; with ``in_lookup`` the Lookup also stops
    before it), ``"corrupt"`` (only half of ``key``'s bytes delivered, the rest of its
    slot zeroed), ``"down"`` (StoreUnavailable), ``"hang"`` (waits ``hang_s`` or until
    ``unhang`` is set, then StoreUnavailable, like a deadline; ``hanging`` is set meanwhile). While ``puts_released``
    is clear, every put waits for it (``put_started`` tells one began).
    """

    def __init__(self, inner):
        self.inner = inner
        self.mode: str | None = None
        self.key: bytes | None = None
        self.after_gets = 0
        self.gets_since_armed = 0
        self.hang_s = 0.0
        self.in_lookup = False
        self.unhang = threading.Event()
        self.hanging = threading.Event()             # set while a get_into hangs
        self.puts_released = threading.Event()
        self.puts_released.set()
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

    def ping(self, timeout: float = 1.0) -> None:
        if self.mode == "down":
            raise StoreUnavailable("UNAVAILABLE: injected")
        self.inner.ping(timeout)

    def lookup(self, keys, timeout=None):
        if self.mode == "down" and self.gets_since_armed >= self.after_gets:
            raise StoreUnavailable("UNAVAILABLE: injected")
        if self.mode == "missing" and self.in_lookup and self.key in keys:
            keys = keys[:list(keys).index(self.key)]
        return self.inner.lookup(keys, timeout=timeout)

    def get_into(self, keys, out, *, ranges=None, offsets=None, stop_at_miss=True, timeout=None):
        active = self.mode is not None and self.gets_since_armed >= self.after_gets
        self.gets_since_armed += 1
        if active and self.mode == "down":
            raise StoreUnavailable("UNAVAILABLE: injected")
        if active and self.mode == "hang":
            self.hanging.set()
            self.unhang.wait(self.hang_s)
            self.hanging.clear()
            raise StoreUnavailable("DEADLINE_EXCEEDED: injected")
        res = self.inner.get_into(keys, out, ranges=ranges, offsets=offsets, stop_at_miss=stop_at_miss,
                                  timeout=timeout)
        keys = list(keys)
        if not active or self.key not in keys or self.mode not in ("missing", "corrupt"):
            return res
        j = keys.index(self.key)
        if j >= res.found or not res.sizes[j]:
            return res
        sizes, codes = list(res.sizes), bytearray(res.tier_codes)
        if self.mode == "missing":
            for i in range(j, len(keys) if stop_at_miss else j + 1):
                sizes[i], codes[i] = 0, 0
            found = j if stop_at_miss else res.found - 1
        else:
            half = sizes[j] // 2
            view = host_view(out, writable=True).array
            start = offsets[j] if offsets is not None else sum(sizes[:j])
            view[start + half:start + sizes[j]] = 0
            sizes[j], found = half, res.found
        return GetIntoResult(found, sizes, bytes(codes))

    def put_from(self, keys, src, *, sizes=None, offsets=None, meta=None, timeout=None):
        self.put_started.set()
        self.puts_released.wait(60)
        if self.mode == "down":
            raise StoreUnavailable("UNAVAILABLE: injected")
        return self.inner.put_from(keys, src, sizes=sizes, offsets=offsets, meta=meta, timeout=timeout)

    def delete(self, keys, timeout=None):
        return self.inner.delete(keys, timeout=timeout)


def run_step(worker, layer_names: Sequence[str], plan, flush_s: float = 60.0) -> set[int]:
    """One engine step of a vLLM ``WorkerTransfers`` as vLLM drives it: bind ``plan``, start
    the loads, wait for and save each layer, end the step; then wait up to ``flush_s`` for
    its puts. Returns the cache block ids whose load failed."""
    worker.bind(plan)
    worker.start_load()
    for name in layer_names:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.end_step()
    assert worker.flush(flush_s)
    return worker.take_load_errors()


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
    from kvstore.service.startup import start_server

    return start_server(daemon_config(data_dir))
