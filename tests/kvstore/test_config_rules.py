"""Config mistakes are refused at load, before anything is opened (issue 19, item 20).

``policy.params`` was checked only when the policy was built, after the NVMe folder had
been created and opened; ``[tiers.host] capacity = 5`` (5 bytes) was accepted; tenant
tokens of any length were accepted.
"""

from __future__ import annotations

import pytest

from kvstore import config
from kvstore.common.errors import ConfigError
from kvstore.config.rules import MIN_TIER_BYTES, MIN_TOKEN_CHARS
from kvstore.service.startup import start_server


@pytest.mark.parametrize("table,needle", [
    ({"policy": {"params": {"bogus": 1}}}, "policy.params: policy 'lru': unknown parameter"),
    ({"policy": {"eviction": "s3fifo", "params": {"small_ratio": "a lot"}}}, "policy.params: "),
    ({"tiers": {"host": {"policy": {"eviction": "arc", "params": {"p": 1}}}}}, "tiers.host.policy.params: "),
    ({"tiers": {"nvme": {"policy": {"eviction": "next_use", "params": {"grace": 1}}}}}, "tiers.nvme.policy.params: "),
])
def test_bad_policy_params_are_refused_before_any_tier_is_opened(tmp_path, table, needle):
    nvme = tmp_path / "nvme"
    table = {**table, "tiers": {**table.get("tiers", {})}}
    table["tiers"]["nvme"] = {**table["tiers"].get("nvme", {}), "path": str(nvme)}
    with pytest.raises(ConfigError, match=needle):
        config.from_dict(table)
    assert not nvme.exists()


def test_policy_params_of_a_config_built_in_code_are_refused_before_the_nvme_folder_is_made(tmp_path):
    import dataclasses
    cfg = config.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme")}, "host": {"capacity": "4MiB"}}})
    bad = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, params={"bogus": 1}))
    with pytest.raises(ConfigError, match="policy.params"):
        start_server(config.validate(bad))
    assert not (tmp_path / "nvme").exists()


def test_good_policy_params_are_accepted():
    cfg = config.from_dict({"policy": {"eviction": "s3fifo", "params": {"small_ratio": 0.25}}})
    assert cfg.policy.params == {"small_ratio": 0.25}


@pytest.mark.parametrize("tier", ["hbm", "host", "nvme", "remote"])
@pytest.mark.parametrize("capacity", [5, "1000KB", MIN_TIER_BYTES - 1])
def test_a_capacity_below_the_minimum_is_refused(tier, capacity):
    with pytest.raises(ConfigError, match=rf"tiers.{tier}.capacity: must be at least 1.00 MiB"):
        config.from_dict({"tiers": {tier: {"enabled": True, "capacity": capacity}}})


def test_the_minimum_capacity_is_accepted():
    assert config.from_dict({"tiers": {"host": {"capacity": "1MiB"}}}).tiers.host.capacity == MIN_TIER_BYTES


@pytest.mark.parametrize("token", ["t", "x" * (MIN_TOKEN_CHARS - 1)])
def test_short_tenant_tokens_are_refused_naming_the_tenant(token):
    with pytest.raises(ConfigError, match=rf"server.tenants.bob: the token has {len(token)} characters; "
                                          rf"at least {MIN_TOKEN_CHARS}"):
        config.from_dict({"server": {"tenants": {"alice": "a" * 32, "bob": token}}})
    with pytest.raises(ConfigError, match="server.auth_token: the token has"):
        config.from_dict({"server": {"auth_token": token}})
    assert config.from_dict({"server": {"tenants": {"bob": "b" * MIN_TOKEN_CHARS}}}).server.tenants


@pytest.mark.parametrize("size", ["2GiB", "3GiB", "63KiB"])
def test_a_message_limit_grpc_cannot_take_is_refused_at_load(size):
    """``[server] max_message_bytes`` of 2 GiB passed the checks and ``kvstore serve`` died
    with grpc's OverflowError (its limit is a signed 32-bit count)."""
    with pytest.raises(ConfigError, match=r"server.max_message_bytes: must be in \[64KiB, 2GiB\)"):
        config.from_dict({"server": {"max_message_bytes": size}})
    assert config.from_dict({"server": {"max_message_bytes": "1GiB"}}).server.max_message_bytes == 1 << 30


def test_an_nvme_path_that_is_a_file_says_so(tmp_path):
    """``[tiers.nvme] path`` naming a file said "cannot create ...: File exists"."""
    f = tmp_path / "blocks.bin"
    f.write_bytes(b"keep me")
    cfg = config.from_dict({"tiers": {"host": {"capacity": "4MiB"}, "nvme": {"path": str(f)}},
                            "server": {"listen": f"unix:{tmp_path}/kv.sock"}})
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        start_server(cfg)
    assert f.read_bytes() == b"keep me"


def test_an_unknown_predictor_is_refused_at_load_with_prefetch_off_too():
    """``prefetch.predictor = "oracle"`` was accepted and refused only when a daemon with
    prefetch on built its scheduler."""
    from kvstore.agent.tool_durations import ESTIMATORS
    from kvstore.config.node import PREDICTOR_CHOICES

    assert set(PREDICTOR_CHOICES) == set(ESTIMATORS)
    for enabled in (False, True):
        with pytest.raises(ConfigError, match="prefetch.predictor: unknown predictor 'oracle'"):
            config.from_dict({"prefetch": {"enabled": enabled, "predictor": "oracle"}})
    assert config.from_dict({"prefetch": {"predictor": "lognormal"}}).prefetch.predictor == "lognormal"
