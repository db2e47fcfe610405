"""The kvstore HiCache backend built by SGLang's own StorageBackendFactory, against a real daemon.

Needs SGLang importable (``.venv-sglang`` of scripts/test-integrations.sh); skips otherwise.
The host KV pool is a small stand-in with the methods the backend calls
(``get_dummy_flat_data_page``, ``get_data_page``, ``set_from_flat_data_page``): SGLang's
real host pools need its model-config stack, which the lean environment leaves out.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/test-integrations.sh builds .venv-sglang)", allow_module_level=True)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore.common.errors import StoreUnavailable  # noqa: E402

PAGE, LAYERS, HEADS, DIM, PAGES = 4, 2, 2, 8, 16


class HostPool:
    """Page-first host KV pool: page ``p`` is ``data[p]``, flat ``(2 * layers * page * heads * dim,)``."""

    page_size, layout, layer_num, head_num, head_dim = PAGE, "page_first", LAYERS, HEADS, DIM

    def __init__(self, seed: int | None):
        n = 2 * LAYERS * PAGE * HEADS * DIM
        gen = torch.Generator().manual_seed(seed or 0)
        self.data = torch.randn((PAGES, n), generator=gen) if seed is not None else torch.zeros((PAGES, n))

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.data.shape[1])

    def get_data_page(self, index, flat=True):
        return self.data[index // PAGE]

    def set_from_flat_data_page(self, index, page):
        self.data[index // PAGE].copy_(page)


def backend(target: str, pool: HostPool, tp_rank=0, tp_size=1, **extra):
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config={"backend_name": "kvstore", "module_path": "engine_adapter.sglang.backend",
                      "class_name": "KVStoreHiCacheStorage", "target": target, "interface_v1": 1,
                      "lookup_timeout_s": 60.0, **extra})     # generous: hits must not miss on a loaded machine
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)])


def test_factory_builds_our_backend_set_exists_get(daemon):
    src = HostPool(seed=1)
    b = backend(daemon.address, src)
    assert type(b).__name__ == "KVStoreHiCacheStorage"
    keys = ["aa01", "aa02", "aa03"]
    assert b.batch_exists(keys) == 0 and not b.exists("aa01")
    assert b.batch_set(keys[:2], [src.get_data_page(0), src.get_data_page(PAGE)])
    assert b.batch_exists(keys) == 2 and b.exists("aa02") and not b.exists("aa03")
    got = b.batch_get(keys, [src.get_dummy_flat_data_page() for _ in keys])
    assert torch.equal(got[0], src.data[0]) and torch.equal(got[1], src.data[1]) and got[2] is None
    assert b.get("zz99") is None
    assert b.set("aa03", src.get_data_page(2 * PAGE)) and b.batch_exists(keys) == 3
    assert torch.equal(b.get("aa03"), src.data[2])


def test_zero_copy_v1_round_trip_and_leading_run(daemon):
    src = HostPool(seed=2)
    b = backend(daemon.address, src)
    keys = ["bb01", "bb02", "bb03", "bb04"]
    assert b.batch_set_v1(keys, indices([5, 6, 7, 8])) == [True] * 4
    b.client.delete([b._keys(["bb03"])[0]])                 # a hole: the leading run stops before it
    assert b.batch_exists(keys) == 2
    dst = HostPool(seed=None)
    d = backend(daemon.address, dst)
    assert d.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True, True, False, True]
    assert torch.equal(dst.data[0], src.data[5]) and torch.equal(dst.data[1], src.data[6])
    assert not dst.data[2].any()


def test_namespaces_keep_tenants_and_tp_ranks_apart(daemon):
    src = HostPool(seed=3)
    b = backend(daemon.address, src)
    assert b.batch_set(["cc01"], [src.get_data_page(0)])
    assert backend(daemon.address, src, tenant="other").batch_exists(["cc01"]) == 0
    # MHA pages at TP=2 hold one rank's heads: another TP size never reads them
    assert backend(daemon.address, src, tp_rank=1, tp_size=2).batch_exists(["cc01"]) == 0


def test_daemon_down(tmp_path, daemon):
    with pytest.raises(StoreUnavailable):
        backend(f"unix:{tmp_path}/absent.sock", HostPool(seed=4), timeout_s=0.5)
    src = HostPool(seed=4)
    b = backend(daemon.address, src, timeout_s=1.0)
    assert b.batch_set(["dd01"], [src.get_data_page(0)])
    daemon.stop(0)                                          # the daemon goes away after attach
    assert b.batch_exists(["dd01"]) == 0
    assert b.get("dd01") is None
    assert b.batch_get_v1(["dd01"], indices([3])) == [False]
    assert b.batch_set(["dd02"], [src.get_data_page(0)]) is False
    assert b.batch_set_v1(["dd02"], indices([1])) == [False]


def test_bad_config_is_a_clear_error(daemon):
    with pytest.raises(ValueError, match="unknown hicache storage extra config keys \\['tagret'\\]"):
        backend(daemon.address, HostPool(seed=5), tagret="x")


# ---------------------------------------------------------------- block size, KV events, namespace

def _daemon(tmp_path, **extra):
    from kvstore.service.startup import start_server
    from support.daemon import daemon_config

    return start_server(daemon_config(tmp_path, extra=extra))


def test_a_daemon_of_another_block_size_is_refused(tmp_path):
    d = _daemon(tmp_path, blocks={"block_tokens": 16})
    try:
        with pytest.raises(ValueError, match=f"SGLang page size {PAGE} does not match the kvstore daemon"):
            backend(d.address, HostPool(seed=6))
    finally:
        d.stop(0)


def test_puts_are_announced_under_sglangs_page_hashes(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from support.kv_events import Subscriber

    d = _daemon(tmp_path, events={"enabled": True, "endpoint": "tcp://127.0.0.1:0"})
    sub = Subscriber(d.events.endpoint)
    try:
        src = HostPool(seed=7)
        b = backend(d.address, src)
        sub.join(b.client)
        keys = ["ee02", "ee03"]
        assert b.batch_set_v1(keys, indices([1, 2]), HiCacheStorageExtraInfo(prefix_keys=["ee00", "ee01"])) == [True] * 2
        assert b.batch_set(["ff01"], [src.get_data_page(3 * PAGE)])
        want = {b"ee02": b"ee01", b"ee03": b"ee02", b"ff01": None}
        events = sub.wait(lambda ev: want.keys() <= {e["block_hashes"][0] for e in ev if e["type"] == "BlockStored"},
                          "3 BlockStored")
        got = {e["block_hashes"][0]: e["parent_block_hash"] for e in events if e["type"] == "BlockStored"}
        assert {k: got[k] for k in want} == want
    finally:
        sub.close()
        d.stop(0)


def test_namespace_says_what_it_covers(daemon, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="engine_adapter.sglang"):
        b = backend(daemon.address, HostPool(seed=8))
    [line] = [r.getMessage() for r in caplog.records if "kvstore namespace" in r.getMessage()]
    assert "of this SGLang instance" in line and f"{PAGE}-token blocks" in line
    assert "weights NOT fingerprinted" in line                 # model 'tiny' is no checkpoint here
    assert b.namespace.block_tokens == PAGE
