"""Huge pages for the shared host arena (issue 21): what each ``huge_pages`` choice gets on
this system, the fallbacks, and a client mapping such an arena.

``hugetlb`` needs the kernel's pool (``vm.nr_hugepages``) to hold the arena and falls back
to ``thp`` and then to 4 KiB pages; ``thp`` needs ``shmem_enabled`` to allow it. The
expectations below are computed from the system the test runs on, so the test states the
right value on a machine with a pool, with THP for shmem, or with neither.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore import config
from kvstore.common.errors import ConfigError
from tiers import memory
from tiers.host import HostTier

ARENA = 8 << 20


def expected(choice: str, nbytes: int) -> str:
    pool = memory.hugetlb_free_bytes() >= -(-nbytes // memory.HUGE_PAGE_BYTES) * memory.HUGE_PAGE_BYTES
    thp = "thp" if memory.thp_shmem_allowed() else ""
    return {"off": "", "thp": thp, "hugetlb": "hugetlb" if pool else thp, "auto": "hugetlb" if pool else thp}[choice]


def roundtrip(tier: HostTier) -> None:
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    tier.reserve(b"k" * 32, data.size)
    tier.write(b"k" * 32, 0, data)
    tier.commit(b"k" * 32)
    out = np.zeros_like(data)
    assert tier.read_into(b"k" * 32, out) == data.size and np.array_equal(out, data)


@pytest.mark.parametrize("choice", ["auto", "hugetlb", "thp", "off"])
def test_each_choice_gets_what_the_system_offers_and_the_arena_works(choice):
    tier = HostTier(ARENA + 4096, shared=True, huge_pages=choice)
    try:
        assert tier.huge_pages == expected(choice, tier.capacity_bytes)
        seg = tier.segment()
        assert seg.size >= tier.capacity_bytes
        if tier.huge_pages == "hugetlb":
            assert seg.size % memory.HUGE_PAGE_BYTES == 0          # whole huge pages, mapped by clients
        assert ("huge pages" in tier.describe()) == bool(tier.huge_pages)
        roundtrip(tier)
    finally:
        tier.close()


def test_the_thp_path_advises_the_mapping_where_the_kernel_allows_it(monkeypatch):
    monkeypatch.setattr(memory, "thp_shmem_allowed", lambda: True)   # the path of a system that allows it
    tier = HostTier(ARENA, shared=True, huge_pages="thp")
    try:
        assert tier.huge_pages == "thp"
        roundtrip(tier)
    finally:
        tier.close()


def test_a_hugetlb_pool_too_small_falls_back(monkeypatch):
    monkeypatch.setattr(memory, "hugetlb_free_bytes", lambda: 0)
    monkeypatch.setattr(memory, "thp_shmem_allowed", lambda: False)
    for choice in ("auto", "thp", "off"):
        tier = HostTier(ARENA, shared=True, huge_pages=choice)
        assert tier.huge_pages == ""
        tier.close()
    if memory.hugetlb_free_bytes() == 0:                   # no pool here: the hugetlb mapping is refused
        tier = HostTier(ARENA, shared=True, huge_pages="hugetlb")
        assert tier.huge_pages == ""
        roundtrip(tier)
        tier.close()


def test_the_config_key_is_checked():
    assert config.from_dict({}).tiers.host.huge_pages == "auto"
    assert config.from_dict({"tiers": {"host": {"huge_pages": "off"}}}).tiers.host.huge_pages == "off"
    with pytest.raises(ConfigError, match="tiers.host.huge_pages"):
        config.from_dict({"tiers": {"host": {"huge_pages": "2MiB"}}})
    with pytest.raises(ValueError, match="huge_pages"):
        memory.allocate_host_buffer(4096, shared=True, huge_pages="yes")


@pytest.mark.parametrize("choice", ["hugetlb", "off"])
def test_a_client_maps_the_arena_whatever_its_pages(tmp_path, choice):
    from kvstore.client.client import KVStoreClient
    from kvstore.service.startup import start_server
    from support.daemon import daemon_config

    d = start_server(daemon_config(tmp_path, nvme=None, extra={"tiers": {"host": {"capacity": "8MiB",
                                                                                  "huge_pages": choice}}}))
    try:
        keys = [os.urandom(32) for _ in range(16)]
        data = np.random.default_rng(1).integers(0, 256, (16, 128 << 10), dtype=np.uint8)
        with KVStoreClient(d.address, timeout=30) as c:
            assert c.put_from(keys, data).stored == 16
            assert c.arena().size == d.manager.tiers[d.manager.shared_tier].capabilities.shared.segment().size
            out = np.zeros_like(data)
            assert c.get_into(keys, out).found == 16 and np.array_equal(out, data)
    finally:
        d.stop(0)
