"""kvstore as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``)::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "engine_adapter.sglang.backend", "class_name": "KVStoreHiCacheStorage",
        "target": "unix:/run/kvstore/kvstore.sock", "interface_v1": 1}'

Extra config keys besides the factory's (:class:`~engine_adapter.sglang.settings.BackendSettings`):
``target`` (required), ``auth_token``, ``timeout_s`` (deadline of a get or set, seconds),
``lookup_timeout_s`` (of an exists, default 0.05 s), ``backoff_s`` and ``max_backoff_s`` (the
circuit breaker's probe back-off, :class:`engine_adapter.breaker.BreakerSettings`), ``model_id``
(default: SGLang's model name), ``weights_revision``, ``tenant``; ``interface_v1`` makes SGLang
call the zero-copy ``batch_get_v1`` / ``batch_set_v1`` with host-pool indices.

Keys: SGLang's page hashes are chained over the prefix and topology-free (token ids,
extra key, cache salt); our key is ``engine_keys.key_from_engine_hash(root, hash)``
under a namespace of the model's weights and attention config, quantization, KV dtype,
page size and the host pool's page format (:func:`engine_adapter.sglang.settings.namespace_of`,
logged at INFO). One copy serves every TP rank for MLA models and at TP=1; MHA pages at
TP>1 hold one rank's heads, so the namespace then names the rank (a per-rank copy) until
the daemon can assemble a block from ranks' head ranges. Binding the host pool refuses a
daemon configured for another block size than the page size. Puts carry each page's hash
and its parent's (``extra_info.prefix_keys``), which the daemon's KV events announce.

Failures: creating the backend with the daemon unreachable raises (SGLang's attach
expects exceptions, never a silent success); afterwards a store error is a miss
(``exists`` False, ``get`` None, ``batch_get_v1`` False) or a failed write (``set`` False),
so SGLang recomputes and its prefetch and backup threads keep running. The client sits
behind a circuit breaker (:class:`engine_adapter.store_io.GuardedStore`): after a store
failure no call is made until the store answers a probe, and the breaker logs the outage
once and one summary at its end; other store errors are logged once until a call works.

Agent hints: SGLang 0.5.23 hands a storage backend no per-request parameter (its calls carry
page hashes and ``extra_info.prefix_keys`` only) and no request's end, so no session hint,
tool call or trajectory reaches the daemon from here (docs/agent_hints.md, "SGLang").
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.common.errors import KVStoreError, StoreUnavailable
from kvstore.common.types import BlockMeta

from engine_adapter import store_io
from engine_adapter.breaker import BreakerSettings
from engine_adapter.engine_keys import EngineHashKeys
from engine_adapter.sglang.settings import BackendSettings, namespace_of, sglang_model_args

log = logging.getLogger("engine_adapter.sglang")


class KVStoreHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage in a kvstore daemon.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (``extra_config`` holds ours).
        kwargs: what the factory passes (unused).
    Raises:
        ValueError: a missing ``target``, an unknown extra config key or a bad value.
        kvstore.common.errors.StoreUnavailable: the daemon does not answer.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.settings = BackendSettings.from_extra(dict(storage_config.extra_config or {}))
        self.config = storage_config
        self.timeout_s = float(self.settings.timeout_s)
        self.lookup_timeout_s = float(self.settings.lookup_timeout_s)
        breaker = BreakerSettings(backoff_s=float(self.settings.backoff_s),
                                  max_backoff_s=float(self.settings.max_backoff_s))
        self.client = store_io.connect(self.settings.target, timeout_s=self.timeout_s,
                                       auth_token=self.settings.auth_token)
        self.client.wait_ready(self.timeout_s)
        self.store = store_io.GuardedStore(self.client, breaker)
        self.namespace = None
        self.root: bytes | None = None
        self._hash_keys: EngineHashKeys | None = None
        self.mem_pool_host = None
        self._failing = False

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Bind the host KV pool; fixes the namespace (weights, attention config, KV dtype,
        page size, page format). Raises ValueError when the daemon is configured for
        another block size than the page size."""
        super().register_mem_pool_host(mem_pool_host)
        store_io.check_block_tokens(self.client, mem_pool_host.page_size, "SGLang page size")
        self.namespace = namespace_of(self.config, mem_pool_host, self.settings, sglang_model_args())
        self.root = self.namespace.fingerprint()
        self._hash_keys = EngineHashKeys(self.root)
        self._page_template = mem_pool_host.get_dummy_flat_data_page()

    def _keys(self, keys: List[str]) -> list[bytes]:
        if self.root is None:
            raise RuntimeError("register_mem_pool_host must be called before storage operations")
        return self._hash_keys.keys([k.encode("utf-8") for k in keys])

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

    @staticmethod
    def _meta(keys: List[str], extra_info) -> list[BlockMeta]:
        """Each page's hash and its parent's (the page before the first: the last of
        ``extra_info.prefix_keys``; empty when SGLang does not say). SGLang gives a
        storage backend no token ids."""
        prefix = getattr(extra_info, "prefix_keys", None) or []
        parents = [prefix[-1] if prefix else ""] + list(keys[:-1])
        return [BlockMeta(engine_hash=k.encode("utf-8"), parent_engine_hash=p.encode("utf-8"))
                for k, p in zip(keys, parents)]

    def _save(self, keys: List[str], pages: list[torch.Tensor], extra_info=None) -> bool:
        if not keys:
            return True
        src = torch.stack([p.reshape(-1) for p in pages]).contiguous()
        try:
            store_io.save_blocks(self.store, self._keys(keys), src, meta=self._meta(keys, extra_info),
                                 timeout_s=self.timeout_s)
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
        return [self._save(keys, pages, extra_info)] * len(keys)

    def close(self) -> None:
        self.store.close()
        self.client.close()
