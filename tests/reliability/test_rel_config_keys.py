"""Config keys that do nothing (issue 9, item 10): every accepted key is read by the code
that it configures or is rejected; ``[blocks] block_tokens`` is published by Info and
checked by the clients that compute keys; size strings parse exactly.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT, daemon_config
from kvstore import config
from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from kvstore.tools.replay import replay
from kvstore.service.startup import start_server
from kvstore.common.units import parse_size

SOURCES = [p for folder in ("kvstore", "tiers", "engine_adapter") for p in (ROOT / folder).rglob("*.py")
           if p.name != "config.py" and "_proto" not in p.parts]


def leaf_keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def test_every_accepted_key_is_read_outside_the_config_module():
    code = "\n".join(re.sub(r"#.*", "", p.read_text()) for p in SOURCES)
    unread = [dotted for dotted, name in leaf_keys(config.Config) if not re.search(rf"\.{name}\b", code)]
    assert not unread, f"config keys that nothing reads: {unread}"
    for cls in (config.HBMConfig, config.HostConfig, config.NVMeConfig):   # [tiers.X.policy]: eviction, params
        assert {f.name for f in dataclasses.fields(config.TierPolicyConfig)} == {"eviction", "params"}, cls


@pytest.mark.parametrize("table,match", [
    ({"blocks": {"hash": "xxh3_128"}}, "blocks.hash"),
    ({"tiers": {"host": {"policy": {"write": "write_through"}}}}, r"tiers.host.policy.write: unknown key"),
    ({"blocks": {"block_tokens": -1}}, "blocks.block_tokens"),
    ({"prefetch": {"expire_factor": 0.5}}, "prefetch.expire_factor"),
    ({"prefetch": {"max_wait_s": float("inf")}}, "prefetch.max_wait_s"),
    ({"prefetch": {"max_waiting": 0}}, "prefetch.max_waiting"),
])
def test_keys_without_an_effect_are_rejected(table, match):
    with pytest.raises(errors.ConfigError, match=match):
        config.from_dict(table)


@pytest.mark.parametrize("text,nbytes", [
    ("4.1GB", 4_100_000_000), ("1234567890123456", 1_234_567_890_123_456), (1234567890123457, 1234567890123457),
    ("9999999999999999B", 9_999_999_999_999_999), ("1.5KiB", 1536), ("0.001MB", 1000), ("8GiB", 8 << 30),
])
def test_size_strings_parse_exactly(text, nbytes):
    assert parse_size(text) == nbytes
    assert config.from_dict({"tiers": {"nvme": {"capacity": text}}}).tiers.nvme.capacity == nbytes


def test_a_fraction_of_a_byte_is_refused():
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size("0.5B")


@pytest.fixture
def node16(tmp_path):
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None, extra={"blocks": {"block_tokens": 16}}))
    yield d
    d.stop(0)


def test_block_tokens_is_published_and_checked_by_clients(node16):
    with KVStoreClient(node16.address, timeout=20) as c:
        assert c.info().block_tokens == 16
        c.check_block_tokens(16)
        with pytest.raises(errors.InvalidRequest, match=r"512-token blocks .* configured for 16"):
            c.check_block_tokens(512)


def test_an_unset_block_size_is_not_enforced(tmp_path):
    assert config.from_dict({}).blocks.block_tokens == 0
    d = start_server(daemon_config(tmp_path, host="16MiB", nvme=None))
    try:
        with KVStoreClient(d.address, timeout=20) as c:
            assert c.info().block_tokens == 0
            c.check_block_tokens(512)
    finally:
        d.stop(0)


class _Request:
    input_length = 1024
    hash_ids = [1, 2]


def test_replay_refuses_a_node_with_another_block_size_before_sending_blocks(node16, tmp_path):
    with KVStoreClient(node16.address, timeout=20) as c:
        with pytest.raises(errors.InvalidRequest, match="block_tokens"):
            replay([_Request()], c, progress=False)              # the Mooncake traces' 512-token blocks
        assert c.stats()["counters"].get("blocks_put", 0) == 0
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n')
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "replay", str(trace), "--target", node16.address,
                          "--quiet"], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 2 and "configured for 16" in out.stderr, out.stderr


def test_the_engine_adapter_refuses_a_node_with_another_block_size():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "engine_adapter"))
    from ea_support import TINY, MemoryStore, engine
    from engine_adapter.reference.runner import Runner
    from engine_adapter.reference.tp import TPGroup

    store = MemoryStore()
    store.block_tokens = engine().block_tokens * 2
    with pytest.raises(ValueError, match="configured for"):
        Runner(TINY, engine(), TPGroup.single(), store=store)
    store.block_tokens = engine().block_tokens
    Runner(TINY, engine(), TPGroup.single(), store=store).close()
