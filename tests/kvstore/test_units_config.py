import pytest

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
