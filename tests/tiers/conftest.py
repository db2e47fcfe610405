"""Fixtures of the tier tests: the NVMe tier in both I/O modes, and the Mooncake remote
tier (a real master on loopback, tiers ("nodes") connected to it, and a raw client to
tamper with objects; they skip, naming the missing package, when the Mooncake wheel or
libibverbs1 is absent)."""

from __future__ import annotations

import threading
import uuid

import pytest

from tiers.nvme.tier import NVMeTier
from tiers.nvme.files import probe_direct


@pytest.fixture(params=["direct", "buffered"])
def io_mode(request, tmp_path):
    if request.param == "direct" and not probe_direct(str(tmp_path)):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    return request.param


@pytest.fixture
def open_nvme(tmp_path, io_mode):
    """Open (or reopen) an NVMe tier in ``tmp_path/nvme`` in the test's I/O mode."""
    opened = []

    def make(capacity=1 << 30, **kw):
        kw.setdefault("direct", None if io_mode == "direct" else False)
        t = NVMeTier(tmp_path / "nvme", capacity, **kw)
        opened.append(t)
        return t

    yield make
    for t in opened:
        t.close()


def _require_mooncake() -> None:
    from tiers.mooncake.client import mooncake_missing

    reason = mooncake_missing()
    if reason:
        pytest.skip(f"Mooncake unavailable: {reason}")


@pytest.fixture(scope="module")
def mooncake_master():
    """A master (with its HTTP metadata server) on 127.0.0.1, killed after the module."""
    _require_mooncake()
    from tiers.mooncake.local_cluster import LocalMaster

    master = LocalMaster(client_ttl_s=3).start()
    yield master
    master.stop()


@pytest.fixture
def make_tier(mooncake_master):
    """``make_tier(**settings)``: a connected MooncakeTier with a prefix unique to the
    test (so tests never see each other's blocks); closed at teardown."""
    from tiers.mooncake.tier import MooncakeConfig, MooncakeTier

    prefix = f"t{uuid.uuid4().hex[:12]}/"
    made = []

    def make(master=None, wait=True, **settings):
        master = master or mooncake_master
        values = dict(master=master.address, metadata_server=master.metadata_server, capacity_bytes=128 << 20,
                      staging_bytes=32 << 20, prefix=prefix, timeout_s=1.0, cooldown_s=1.0)
        values.update(settings)
        tier = MooncakeTier(MooncakeConfig(**values), name=f"remote{len(made)}")
        made.append(tier)
        if wait:
            assert tier.wait_connected(60), tier.health
        return tier

    yield make
    closers = [threading.Thread(target=tier.close) for tier in made]     # ~1 s each in the library
    for t in closers:
        t.start()
    for t in closers:
        t.join()


@pytest.fixture
def raw_store(mooncake_master):
    """A plain Mooncake client with no segment, to overwrite objects behind the tier."""
    from tiers.mooncake.client import store_class

    store = store_class()()
    rc = store.setup({"local_hostname": "127.0.0.1", "metadata_server": mooncake_master.metadata_server,
                      "global_segment_size": 0, "local_buffer_size": 16 << 20, "protocol": "tcp",
                      "master_server_addr": mooncake_master.address})
    assert rc == 0
    yield store
    store.close()
