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

from support.daemon import ROOT, daemon_config
from kvstore import config
from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from kvstore.tools.replay import replay
from kvstore.service.startup import start_server
from kvstore.common.units import parse_size

CONFIG_PACKAGE = ROOT / "kvstore" / "config"
SOURCES = [p for folder in ("kvstore", "tiers", "engine_adapter") for p in (ROOT / folder).rglob("*.py")
           if CONFIG_PACKAGE not in p.parents and "_proto" not in p.parts]


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
    ("9999999999999999B", 9_999_999_999_999_999), ("1.5MiB", 1536 << 10), ("1.001MB", 1_001_000), ("8GiB", 8 << 30),
    ("1.5KiB", 1536), ("0.001MB", 1000),
])
def test_size_strings_parse_exactly(text, nbytes):
    assert parse_size(text) == nbytes
    if nbytes >= 1 << 20:                            # the smallest capacity a tier takes
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


# ---------------------------------------------------------------- every knob of the daemon is a key

PREFETCH_KNOBS = {          # [prefetch] key -> a value other than its default
    "measure_bandwidth": False, "headroom_fraction": 0.25, "active_protect_s": 12.0, "poll_s": 0.2,
    "refresh_s": 3.0, "retry_s": 0.75, "margin_s": 2.5, "dedupe_s": 0.1, "victim_margin": 4.0,
    "repromote": True, "protect_s": 7.0, "confidence": 0.5, "horizon_s": 45.0,
}
KNOB_TOML = """
[policy]
promote_on_get = false
[store]
writer_wait_s = 11.0
transfer_timeout_s = 12.0
stop_persist_s = 0.0
[sessions]
calibrate = false
default_gap_s = 20.0
window = 32
max_sessions = 500
max_keys = 9000
[health]
period_s = 0.5
window_s = 4.0
[server]
eviction_log_blocks = 777
[prefetch]
enabled = true
""" + "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in PREFETCH_KNOBS.items()) + """
[prefetch.hop_bandwidth]
"nvme:hbm" = "3GB"
"""


def _spy(monkeypatch, owner, name: str) -> list[dict]:
    """Record the keyword arguments every construction of ``owner.name`` gets."""
    calls: list[dict] = []
    real = getattr(owner, name)

    def construct(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, construct)
    return calls


def test_the_new_keys_parse_to_their_values():
    cfg = config.loads(KNOB_TOML)
    for key, value in PREFETCH_KNOBS.items():
        assert getattr(cfg.prefetch, key) == value, key
    assert cfg.prefetch.hop_bandwidth == {"nvme:hbm": 3_000_000_000}
    assert cfg.store == config.StoreConfig(writer_wait_s=11.0, transfer_timeout_s=12.0, stop_persist_s=0.0)
    assert cfg.sessions == config.SessionsConfig(False, 20.0, 32, 500, 9000)
    assert (cfg.health.period_s, cfg.health.window_s, cfg.policy.promote_on_get) == (0.5, 4.0, False)


def test_toml_values_reach_the_running_daemons_parts(tmp_path, monkeypatch):
    import kvstore.agent.prefetch as prefetch
    import kvstore.service.build as build
    import kvstore.service.explain as explain
    import kvstore.service.startup as startup
    from tiers.base import TierKind

    scheduler = _spy(monkeypatch, prefetch, "PrefetchScheduler")
    manager = _spy(monkeypatch, build, "TierManager")
    sessions = _spy(monkeypatch, startup, "SessionTable")
    monitor = _spy(monkeypatch, startup, "HealthMonitor")
    log = _spy(monkeypatch, explain, "EvictionLog")
    base = daemon_config(tmp_path, host="16MiB", nvme="16MiB")
    knobs = config.loads(KNOB_TOML)
    cfg = config.replace(knobs, tiers=base.tiers, server=dataclasses.replace(
        base.server, eviction_log_blocks=knobs.server.eviction_log_blocks))
    d = start_server(cfg)
    try:
        assert d.service.hints is not None and len(scheduler) == 1
        for key, value in PREFETCH_KNOBS.items():
            assert scheduler[0][key] == value, key
        assert scheduler[0]["hop_bandwidth"] == {(TierKind.NVME, TierKind.HBM): 3e9}
        assert {k: manager[0][k] for k in ("promote_on_get", "writer_wait_s", "transfer_timeout_s")} == {
            "promote_on_get": False, "writer_wait_s": 11.0, "transfer_timeout_s": 12.0}
        assert sessions[0] == {"calibrate": False, "default_gap_s": 20.0, "window": 32, "max_sessions": 500,
                               "max_keys": 9000}
        assert (monitor[0]["period_s"], monitor[0]["window_s"]) == (0.5, 4.0)
        assert log[0]["capacity"] == 777
        assert d.persist_s == 0.0
    finally:
        d.stop(0)


def test_the_simulator_takes_the_prefetch_and_session_keys_from_the_config(monkeypatch):
    import kvstore.tools.simulate as simulate
    from kvstore.tools.trace import Request

    scheduler = _spy(monkeypatch, simulate, "PrefetchScheduler")
    sessions = _spy(monkeypatch, simulate, "SessionTable")
    cfg = config.loads(KNOB_TOML)
    simulate.run([Request(0.0, 512, 1, [1])], [simulate.TierSpec("host", 1 << 20, "lru")], events=[],
                 prefetch=cfg.prefetch, session_config=cfg.sessions, promote_on_get=cfg.policy.promote_on_get)
    for key, value in PREFETCH_KNOBS.items():
        if key not in ("measure_bandwidth", "dedupe_s"):      # virtual time; one lookup per request
            assert scheduler[0][key] == value, key
    assert (scheduler[0]["measure_bandwidth"], scheduler[0]["dedupe_s"]) == (False, 0.0)
    assert sessions[0]["max_sessions"] == 500 and sessions[0]["calibrate"] is False


@pytest.mark.parametrize("table,match", [
    ({"prefetch": {"poll_s": 0}}, r"prefetch.poll_s: must be in \(0, 60\] seconds"),
    ({"prefetch": {"refresh_s": -1.0}}, "prefetch.refresh_s"),
    ({"prefetch": {"retry_s": 0.0}}, "prefetch.retry_s"),
    ({"prefetch": {"headroom_fraction": 1.0}}, r"prefetch.headroom_fraction: must be in \[0, 1\)"),
    ({"prefetch": {"confidence": 1.5}}, r"prefetch.confidence: must be in \[0, 1\]"),
    ({"prefetch": {"horizon_s": 0}}, "prefetch.horizon_s"),
    ({"prefetch": {"victim_margin": -2.0}}, "prefetch.victim_margin"),
    ({"prefetch": {"protect_s": float("nan")}}, "prefetch.protect_s: expected a finite number"),
    ({"prefetch": {"margin_s": -0.5}}, "prefetch.margin_s"),
    ({"prefetch": {"active_protect_s": 1e9}}, "prefetch.active_protect_s"),
    ({"prefetch": {"dedupe_s": "0.5"}}, "prefetch.dedupe_s: expected a number"),
    ({"prefetch": {"repromote": 1}}, "prefetch.repromote: expected true or false"),
    ({"prefetch": {"measure_bandwidth": "yes"}}, "prefetch.measure_bandwidth: expected true or false"),
    ({"prefetch": {"hop_bandwidth": {"host:ssd": "1GB"}}}, "prefetch.hop_bandwidth.host:ssd: not a hop"),
    ({"prefetch": {"hop_bandwidth": {"host:hbm": "0"}}}, "prefetch.hop_bandwidth.host:hbm: must be > 0"),
    ({"prefetch": {"hop_bandwidth": {"host:hbm": "fast"}}}, "prefetch.hop_bandwidth.host:hbm"),
    ({"prefetch": {"hop_bandwidth": "1GB"}}, "prefetch.hop_bandwidth: expected a table"),
    ({"policy": {"promote_on_get": "no"}}, "policy.promote_on_get: expected true or false"),
    ({"store": {"writer_wait_s": 0}}, "store.writer_wait_s"),
    ({"store": {"transfer_timeout_s": -1.0}}, "store.transfer_timeout_s"),
    ({"store": {"stop_persist_s": -1.0}}, "store.stop_persist_s"),
    ({"store": {"writer_wait": 1.0}}, "store.writer_wait: unknown key"),
    ({"sessions": {"max_keys": 0}}, r"sessions.max_keys: must be in \[1, 4294967296\]"),
    ({"sessions": {"max_sessions": 0}}, "sessions.max_sessions"),
    ({"sessions": {"window": 0}}, "sessions.window"),
    ({"sessions": {"default_gap_s": 0.0}}, "sessions.default_gap_s"),
    ({"health": {"period_s": 0}}, "health.period_s"),
    ({"health": {"window_s": -1.0}}, "health.window_s"),
    ({"server": {"stop_grace_s": -1.0}}, "server.stop_grace_s"),
    ({"server": {"eviction_log_blocks": 0}}, "server.eviction_log_blocks"),
    ({"tiers": {"remote": {"publish_backlog": 0}}}, "tiers.remote.publish_backlog"),
    ({"tiers": {"remote": {"page_in_chunk": "-1MiB"}}}, "tiers.remote.page_in_chunk"),
])
def test_a_bad_value_of_a_new_key_is_a_config_error_naming_it(table, match):
    with pytest.raises(errors.ConfigError, match=match):
        config.from_dict(table)
