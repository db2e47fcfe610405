"""``[tiers.remote]``: validation, the tier built last, a clear error without the Mooncake
client, and a daemon that starts at once and keeps serving with its master down."""

from __future__ import annotations

import time

import pytest

from support.daemon import daemon_config
from support.cluster_nodes import require_mooncake

from kvstore import config
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import ConfigError
from kvstore.service.build import build_tiers
from kvstore.service.startup import start_server


def remote_config(**remote):
    return config.from_dict({"tiers": {"remote": {"enabled": True, **remote}}})


def test_off_by_default_and_the_daemon_runs_as_before(tmp_path):
    cfg = daemon_config(tmp_path)
    assert cfg.tiers.remote.enabled is False
    names = [n for n, _ in build_tiers(cfg)]
    assert names == ["host", "nvme"]


@pytest.mark.parametrize("key, value, message", [
    ("kind", "redis", "tiers.remote.kind: 'redis' is not one of mooncake"),
    ("protocol", "udp", "tiers.remote.protocol"),
    ("publish", "sometimes", "tiers.remote.publish: 'sometimes' is not one of demoted, all"),
    ("master", "localhost", "tiers.remote.master: 'localhost' is not HOST:PORT"),
    ("segment", "1MiB", "tiers.remote.segment: must be 0 (a pure client) or at least 16MiB"),
    ("staging", "4KiB", "tiers.remote.staging: must be at least 1MiB"),
    ("timeout_s", 0, "tiers.remote.timeout_s: must be > 0 seconds"),
    ("lookup_timeout_s", -1.0, "tiers.remote.lookup_timeout_s"),
    ("failure_threshold", 0, "tiers.remote.failure_threshold: must be >= 1"),
    ("min_throughput", "0", "tiers.remote.min_throughput"),
    ("capacity", "lots", "tiers.remote.capacity"),
    ("replicas", True, "tiers.remote.replicas: expected an integer"),
    ("prefix", "", "tiers.remote.prefix: must not be empty"),
    ("masterr", "x:1", "tiers.remote.masterr: unknown key"),
])
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        remote_config(**{key: value})


def test_sizes_and_the_policy_override_parse():
    cfg = remote_config(capacity="2GiB", segment="0", staging="32MiB", min_throughput="100MB",
                        publish="all", policy={"eviction": "s3fifo"})
    r = cfg.tiers.remote
    assert (r.capacity, r.segment, r.staging, r.min_throughput) == (2 << 30, 0, 32 << 20, 100_000_000)
    assert cfg.tier_policy("remote").eviction == "s3fifo"


def test_missing_client_library_is_a_config_error_naming_the_setup_script(monkeypatch):
    import tiers.mooncake.client as mc

    monkeypatch.setattr(mc, "mooncake_missing", lambda: "libibverbs1 is missing (apt-get install -y libibverbs1)")
    cfg = config.from_dict({"tiers": {"host": {"capacity": "16MiB"}, "nvme": {"enabled": False},
                                      "remote": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"tiers.remote: .*libibverbs1 is missing.*scripts/setup-mooncake.sh"):
        build_tiers(cfg)


def test_daemon_with_its_master_down_starts_at_once_and_keeps_serving(tmp_path):
    require_mooncake()
    from tiers.mooncake.local_cluster import LocalMaster

    master = LocalMaster()                                         # its ports, not started
    cfg = daemon_config(tmp_path, extra={"tiers": {"remote": {
        "enabled": True, "master": master.address, "metadata_server": master.metadata_server,
        "capacity": "64MiB", "segment": "32MiB", "staging": "8MiB", "timeout_s": 1.0, "lookup_timeout_s": 0.3}}})
    t0 = time.monotonic()
    d = start_server(cfg)
    try:
        assert time.monotonic() - t0 < 30                          # nothing waits on the master
        assert [t.name for t in d.manager.tiers] == ["host", "nvme", "remote"]
        with KVStoreClient(d.address, timeout=30) as c:
            c.wait_ready(timeout=30)
            keys = [bytes([i]) * 32 for i in range(3)]
            t0 = time.monotonic()
            assert c.put([(k, b"x" * 4096) for k in keys]).stored == 3
            assert c.lookup(keys + [b"\xff" * 32]).hit_blocks == 3      # local hits; the cluster: a miss
            assert [bytes(r.data) for r in c.get(keys)] == [b"x" * 4096] * 3
            assert not c.get([b"\xff" * 32])[0].found
            assert time.monotonic() - t0 < 5
            stats = c.stats()
            assert stats["serving"] is True
            assert any(p.startswith("remote: not connected to the Mooncake master") for p in stats["problems"])
            master.start()                                          # the master comes up later
            assert d.manager.tiers[-1].wait_connected(60)
            deadline = time.monotonic() + 30
            while c.stats()["problems"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.stats()["problems"] == []
    finally:
        d.stop(0, persist_s=0)
        master.stop()
