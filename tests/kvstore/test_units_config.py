import dataclasses
import pathlib

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvstore import config
from kvstore.common.errors import ConfigError
from kvstore.common.units import parse_size


@pytest.mark.parametrize("text,expected", [("8GiB", 8 << 30), ("500MB", 500_000_000), ("4096", 4096),
                                           (1024, 1024), ("1.5KiB", 1536), ("2 mib", 2 << 20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "8 parsecs", "", "1.3B", True, -5, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_default_config_is_valid():
    cfg = config.load(None)
    assert cfg.tiers.host.capacity == 1 << 30
    assert cfg.tiers.nvme.enabled
    assert cfg.tier_policy("host").eviction == "lru"


def test_full_config_round_trip(tmp_path):
    p = tmp_path / "node.toml"
    p.write_text("""
[server]
listen = "127.0.0.1:0"
max_message_bytes = "32MiB"
[tiers.host]
capacity = "2GiB"
[tiers.host.policy]
eviction = "lru"
[tiers.nvme]
path = "/tmp/x"
capacity = "10GB"
fsync = true
[policy]
write = "write_through"
""")
    cfg = config.load(p)
    assert cfg.server.max_message_bytes == 32 << 20
    assert cfg.tiers.host.capacity == 2 << 30
    assert cfg.tiers.nvme.capacity == 10_000_000_000
    assert cfg.tiers.nvme.fsync is True
    assert cfg.policy.write == "write_through"


@pytest.mark.parametrize("text,needle", [
    ("[tiers.host]\ncapcity = '1GiB'", "tiers.host.capcity"),
    ("[tiers.host]\ncapacity = '-1GiB'", "tiers.host.capacity"),
    ("[tiers.host]\ncapacity = 'lots'", "tiers.host.capacity"),
    ("[server]\nworkers = 'eight'", "server.workers"),
    ("[server]\nworkers = 0", "server.workers"),
    ("[policy]\neviction = 'random'", "policy.eviction"),
    ("[tiers.nvme]\nio = 'magic'", "tiers.nvme.io"),
    ("[tiers.nvme]\nfsync = 'yes'", "tiers.nvme.fsync"),
    ("[bogus]\nx = 1", "bogus"),
    ("[tiers.host]\nenabled = false\n[tiers.nvme]\nenabled = false", "at least one tier"),
    ("[server]\ntls_cert = 'a.pem'", "tls"),
    ("not toml = = =", "TOML"),
])
def test_bad_config_names_the_key(text, needle):
    with pytest.raises(ConfigError) as e:
        config.loads(text)
    assert needle in str(e.value)


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.toml")


REFERENCE = pathlib.Path(config.__file__).with_name("reference.toml")


def _leaves(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _leaves(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_the_reference_file_names_every_key_with_its_default():
    assert config.load(REFERENCE) == config.load(None)
    table = tomllib.loads(REFERENCE.read_text())
    named = set()

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("params", "tenants", "hop_bandwidth"):
                walk(v, f"{prefix}{k}.")
            else:
                named.add(f"{prefix}{k}")
    walk(table)
    no_default_value = {"tiers.hbm.policy", "tiers.host.policy", "tiers.nvme.policy", "tiers.remote.policy",
                        "tiers.remote.segment"}          # None by default: commented out in the file
    assert set(_leaves(config.Config)) - no_default_value == named

