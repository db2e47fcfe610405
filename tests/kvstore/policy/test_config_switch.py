"""One implementation: the daemon and the simulator build the policy named in the config."""

from __future__ import annotations

import pytest

from kvstore import config
from kvstore.tools import simulate
from kvstore.policy import POLICIES, make_policy
from kvstore.policy.next_use import NextUsePolicy
from kvstore.policy.s3fifo import S3FIFOPolicy


def test_registry_has_every_policy_and_rejects_unknown_names():
    assert {"lru", "arc", "s3fifo", "next_use", "opt"} <= set(POLICIES)
    with pytest.raises(config.ConfigError):
        make_policy("mru", 10)


def test_a_config_change_switches_the_daemons_policy(tmp_path):
    from kvstore.service.build import build_manager

    managers = []
    try:
        for eviction, cls in (("next_use", NextUsePolicy), ("s3fifo", S3FIFOPolicy)):
            cfg = config.from_dict({
                "tiers": {"host": {"capacity": "1MiB"}, "nvme": {"enabled": False}},
                "policy": {"eviction": eviction},
            })
            m = build_manager(cfg)
            managers.append(m)
            assert type(m.policies[0]) is cls
            assert m.usage()[0].policy == eviction
            # the simulator builds the same class from the same config
            spec = simulate.tiers_from_config(cfg)[0]
            assert type(make_policy(spec.policy, spec.capacity_bytes, spec.params)) is cls
    finally:
        for m in managers:
            m.close()


def test_per_tier_override_and_params_reach_the_policy(tmp_path):
    from kvstore.service.build import build_manager

    cfg = config.from_dict({
        "tiers": {"host": {"capacity": "1MiB", "policy": {"eviction": "s3fifo", "params": {"small_ratio": 0.25}}},
                  "nvme": {"enabled": True, "path": str(tmp_path / "nvme"), "capacity": "4MiB"}},
        "policy": {"eviction": "arc"},
    })
    m = build_manager(cfg)
    try:
        assert [p.name for p in m.policies] == ["s3fifo", "arc"]
        assert m.policies[0].small_ratio == 0.25
    finally:
        m.close()
