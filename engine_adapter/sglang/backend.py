"""kvstore as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``)::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "engine_adapter.sglang.backend", "class_name": "KVStoreHiCacheStorage",
        "target": "unix:/run/kvstore/kvstore.sock", "interface_v1": 1}'

Extra config keys besides the factory's: ``target`` (required), ``auth_token``,
``timeout_s`` (deadline of a get or set, seconds), ``lookup_timeout_s`` (of an exists,
default 0.05 s), ``backoff_s`` and ``max_backoff_s`` (the circuit breaker's probe
back-off, :class:`engine_adapter.breaker.BreakerSettings`), ``model_id`` (default:
SGLang's model name), ``tenant``, ``interface_v1`` (SGLang then calls the zero-copy
``batch_get_v1`` / ``batch_set_v1`` with host-pool indices).

Keys: SGLang's page hashes are chained over the prefix and topology-free (token ids,
extra key, cache salt); our key is ``engine_keys.key_from_engine_hash(root, hash)``
under a namespace of the model, KV dtype, page size and the host pool's page format.
One copy serves every TP rank for MLA models and at TP=1; MHA pages at TP>1 hold
one rank's heads, so the namespace then names the rank (a per-rank copy) until the
daemon can assemble a block from ranks' head ranges.

Failures: creating the backend with the daemon unreachable raises (SGLang's attach
expects exceptions, never a silent success); afterwards a store error is a miss
(``exists`` False, ``get`` None, ``batch_get_v1`` False) or a failed write (``set`` False),
so SGLang recomputes and its prefetch and backup threads keep running. The client sits
behind a circuit breaker (:class:`engine_adapter.store_io.GuardedStore`): after a store
failure no call is made until the store answers a probe, and the breaker logs the outage
once and one summary at its end; other store errors are logged once until a call works.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.common.errors import KVStoreError, StoreUnavailable

from engine_adapter import store_io
from engine_adapter.breaker import BreakerSettings
from engine_adapter.engine_keys import engine_namespace, key_from_engine_hash

log = logging.getLogger("engine_adapter.sglang")

_FACTORY_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
_OUR_KEYS = {"target", "auth_token", "timeout_s", "lookup_timeout_s", "backoff_s", "max_backoff_s", "model_id",
             "tenant"}


class KVStoreHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage in a kvstore daemon.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (``extra_config`` holds ours).
        kwargs: what the factory passes (unused).
    Raises:
        ValueError: a missing ``target``, an unknown extra config key or a bad number.
        kvstore.common.errors.StoreUnavailable: the daemon does not answer.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - _FACTORY_KEYS - _OUR_KEYS)
        if unknown:
            raise ValueError(f"unknown hicache storage extra config keys {unknown}; known: {sorted(_OUR_KEYS)}")
        if not extra.get("target"):
            raise ValueError("hicache storage extra config needs 'target', the kvstore daemon address")
        self.config = storage_config
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.lookup_timeout_s = float(extra.get("lookup_timeout_s", 0.05))
        if not (self.timeout_s > 0 and self.lookup_timeout_s > 0):
            raise ValueError("hicache storage extra config 'timeout_s' and 'lookup_timeout_s' must be positive")
        breaker = BreakerSettings(backoff_s=float(extra.get("backoff_s", 0.1)),
                                  max_backoff_s=float(extra.get("max_backoff_s", 1.0)))
        self.model_id = extra.get("model_id") or storage_config.model_name or "unknown-model"
        self.tenant = extra.get("tenant", "")
        self.client = store_io.connect(extra["target"], timeout_s=self.timeout_s,
                                       auth_token=extra.get("auth_token", ""))
        self.client.wait_ready(self.timeout_s)
        self.store = store_io.GuardedStore(self.client, breaker)
        self.root: bytes | None = None
        self.mem_pool_host = None
        self._failing = False

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Bind the host KV pool; fixes the namespace (page size, dtype, page format)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.config
        page = mem_pool_host.get_dummy_flat_data_page()
        per_rank = not cfg.is_mla_model and cfg.tp_size > 1
        fmt = f"sglang/{getattr(mem_pool_host, 'layout', 'unknown')}/{'mla' if cfg.is_mla_model else 'mha'}"
        if per_rank:
            fmt += f"/tp{cfg.tp_rank}of{cfg.tp_size}"
        ns = engine_namespace(
            model=self.model_id, dtype=str(page.dtype).removeprefix("torch."), block_tokens=mem_pool_host.page_size,
            num_layers=int(getattr(mem_pool_host, "layer_num", 0)), num_kv_heads=int(getattr(mem_pool_host, "head_num", 0)),
            head_dim=int(getattr(mem_pool_host, "head_dim", 0)), scheme="block_hash", tenant=self.tenant,
            engine="sglang", kv_format=f"{fmt}/{page.numel() * page.element_size()}B")
        self.root = ns.fingerprint()
        self._page_template = page

    def _keys(self, keys: List[str]) -> list[bytes]:
        if self.root is None:
            raise RuntimeError("register_mem_pool_host must be called before storage operations")
        return [key_from_engine_hash(self.root, k.encode("utf-8")) for k in keys]

    def _store_error(self, what: str, e: Exception) -> None:
        if isinstance(e, StoreUnavailable):
            return                      # the breaker logs the outage and counts what it cost
        if not self._failing:
            log.warning("kvstore %s failed (%s); treating as a miss until a call succeeds", what, e)
        self._failing = True

    def _page_rows(self, n: int) -> torch.Tensor:
        t = self._page_template
        return torch.empty((n, t.numel()), dtype=t.dtype)

    # ------------------------------------------------------------ exists

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """Leading pages of ``keys`` that are stored (one Lookup); 0 when the daemon fails."""
        try:
            hit = store_io.lookup_prefix(self.store, self._keys(keys), self.lookup_timeout_s)
        except KVStoreError as e:
            self._store_error("lookup", e)
            return 0
        self._failing = False
        return hit

    # ------------------------------------------------------------ get

    def _load(self, keys: List[str], rows: torch.Tensor) -> list[bool]:
        try:
            ok = store_io.load_blocks(self.store, self._keys(keys), rows, timeout_s=self.timeout_s)
        except KVStoreError as e:
            self._store_error("get", e)
            return [False] * len(keys)
        self._failing = False
        return ok

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Pages as flat tensors (written into ``target_locations`` when given); ``None`` per miss."""
        rows = self._page_rows(len(keys))
        ok = self._load(keys, rows)
        out: list[torch.Tensor | None] = []
        for i, hit in enumerate(ok):
            if not hit:
                out.append(None)
            elif target_locations is not None:
                target_locations[i].view(-1).copy_(rows[i].view(target_locations[i].dtype))
                out.append(target_locations[i])
            else:
                out.append(rows[i])
        return out

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        """Pages straight into the host pool at ``host_indices`` (``page_size`` slots per key)."""
        rows = self._page_rows(len(keys))
        ok = self._load(keys, rows)
        ps = self.mem_pool_host.page_size
        for i, hit in enumerate(ok):
            if hit:
                self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * ps]), rows[i])
        return ok

    # ------------------------------------------------------------ set

    def _save(self, keys: List[str], pages: list[torch.Tensor]) -> bool:
        if not keys:
            return True
        src = torch.stack([p.reshape(-1) for p in pages]).contiguous()
        try:
            store_io.save_blocks(self.store, self._keys(keys), src, timeout_s=self.timeout_s)
        except KVStoreError as e:
            self._store_error("put", e)
            return False
        self._failing = False
        return True

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat pages ``values`` (one per key); True when all were stored or present."""
        return self._save(keys, [v.cpu() for v in values])

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        """Store the host pool's pages at ``host_indices`` (``page_size`` slots per key)."""
        ps = self.mem_pool_host.page_size
        pages = [self.mem_pool_host.get_data_page(int(host_indices[i * ps]), flat=True) for i in range(len(keys))]
        return [self._save(keys, pages)] * len(keys)

    def close(self) -> None:
        self.store.close()
        self.client.close()
