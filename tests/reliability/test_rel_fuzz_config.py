"""Fuzzing the config loader (hypothesis): random tables over the real section and key
names plus unknown ones, values of every TOML type (negative and huge sizes, unknown
units, NaN), random TOML text, and unreadable paths.

Expected: a valid :class:`kvstore.config.Config` or a :class:`ConfigError` whose message
names the offending key; never another exception, never a value outside its range.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.daemon import daemon_config
from kvstore import config
from kvstore.common.errors import ConfigError
from kvstore.service.startup import start_server

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "250"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CASES = {"n": 0}

SECTIONS = {
    "server": ["listen", "max_message_bytes", "max_chunk_bytes", "workers", "auth_token", "tls_cert",
               "tls_key", "tenants", "stop_grace_s", "eviction_log_blocks", "max_streams", "stream_timeout_s",
               "stream_idle_timeout_s"],
    "events": ["max_queue", "buffer_steps", "batch_ms", "snapshot_interval_s"],
    "blocks": ["block_tokens", "hash"],
    "tiers": ["hbm", "host", "nvme"],
    "policy": ["eviction", "write", "params", "promote_on_get"],
    "store": ["writer_wait_s", "transfer_timeout_s", "stop_persist_s"],
    "prefetch": ["enabled", "predictor", "lead_time_s", "quantile", "window", "hop_bandwidth", "measure_bandwidth",
                 "headroom_fraction", "active_protect_s", "poll_s", "refresh_s", "retry_s", "margin_s", "dedupe_s",
                 "victim_margin", "repromote", "protect_s", "confidence", "horizon_s"],
    "sessions": ["calibrate", "default_gap_s", "window", "max_sessions", "max_keys"],
    "health": ["period_s", "window_s"],
}
TIER_KEYS = ["enabled", "capacity", "device", "pinned", "path", "io", "fsync", "policy"]
UNKNOWN = st.sampled_from(["capcity", "Capacity", "", " ", "x" * 200, "tiers", "__class__", "ünïcode"])

sizes = st.one_of(
    st.integers(-(1 << 70), 1 << 70),
    st.from_regex(r"\A-?[0-9]{0,400}(\.[0-9]{0,6})?\s?([kKmMgGtT]i?[bB]?|[bB]|parsec|e3)?\Z", fullmatch=True),
    st.sampled_from(["8GiB", "1.5KiB", "0", "-1GiB", "1e9", "inf", "nan", "9" * 500, "0x10", "1_000"]),
)
scalars = st.one_of(st.booleans(), st.integers(-(1 << 64), 1 << 64), st.floats(allow_nan=True),
                    st.text(max_size=30), sizes)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


@st.composite
def tables(draw):
    data: dict = {}
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS) + ["bogus"]), max_size=4, unique=True)):
        if section == "tiers":
            tiers = {}
            for tier in draw(st.lists(st.sampled_from(["hbm", "host", "nvme", "ssd"]), max_size=3, unique=True)):
                names = draw(st.lists(st.one_of(st.sampled_from(TIER_KEYS), UNKNOWN), max_size=4, unique=True))
                tiers[tier] = {n: draw(sizes if n == "capacity" else values) for n in names}
            data["tiers"] = draw(st.one_of(st.just(tiers), values)) if draw(st.booleans()) else tiers
            continue
        names = draw(st.lists(st.one_of(st.sampled_from(SECTIONS.get(section, ["x"])), UNKNOWN),
                              max_size=4, unique=True))
        data[section] = {n: draw(sizes if "bytes" in n else values) for n in names}
    return data


VALID = {
    "server": {"listen": "unix:/tmp/kvs/kvstore.sock", "max_message_bytes": "64MiB", "max_chunk_bytes": "4MiB",
               "workers": 8, "auth_token": "", "tls_cert": "", "tls_key": "", "tenants": {"a": "token-of-tenant-a"},
               "max_streams": 6, "stream_timeout_s": 120.0, "stream_idle_timeout_s": 30.0},
    "events": {"max_queue": 1000, "buffer_steps": 100, "batch_ms": 10.0, "snapshot_interval_s": 0.0},
    "blocks": {"block_tokens": 16, "hash": "sha256"},
    "tiers": {"hbm": {"enabled": False, "capacity": "1GiB", "device": 0},
              "host": {"capacity": "1GiB", "pinned": "auto", "policy": {"eviction": "lru"}},
              "nvme": {"enabled": True, "path": "/tmp/kvs/nvme", "capacity": "16GiB", "io": "auto", "fsync": False}},
    "policy": {"eviction": "lru", "write": "write_back", "params": {}},
    "prefetch": {"enabled": False, "predictor": "quantile", "lead_time_s": 0.05, "quantile": 0.5, "window": 64,
                 "hop_bandwidth": {"nvme:hbm": "3GB"}, "poll_s": 0.05, "refresh_s": 2.0, "retry_s": 0.5,
                 "headroom_fraction": 0.0, "confidence": 0.7, "horizon_s": 30.0, "repromote": False},
    "store": {"writer_wait_s": 10.0, "transfer_timeout_s": 30.0, "stop_persist_s": 60.0},
    "sessions": {"calibrate": True, "default_gap_s": 60.0, "window": 256, "max_sessions": 100, "max_keys": 1000},
    "health": {"period_s": 1.0, "window_s": 10.0},
}


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("tenants", "params"):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


LEAVES = sorted(_leaves(VALID))
hostile_text = st.one_of(st.text(max_size=20), st.sampled_from(["\x00", "a\x00b", "unix:", "unix:/", "unix://",
                                                                 "0.0.0.0:1", " ", "nan", "-1"]))


@st.composite
def mutated_valid(draw):
    """The valid config above with one leaf replaced by a hostile value."""
    import copy
    data = copy.deepcopy(VALID)
    path = draw(st.sampled_from(LEAVES))
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = draw(st.one_of(values, sizes, hostile_text, st.floats(allow_nan=True, allow_infinity=True)))
    return ".".join(path), data


def check_config(cfg: config.Config) -> None:
    """Ranges that :func:`config.validate` promises once a config is accepted."""
    s = cfg.server
    assert s.workers >= 2 and 64 << 10 <= s.max_message_bytes <= config.MAX_SIZE
    assert 0 <= s.max_streams < s.workers and 0 < s.stream_timeout_s < math.inf and 0 < s.stream_idle_timeout_s
    assert 0 <= cfg.events.snapshot_interval_s < math.inf and cfg.events.max_queue >= 1
    assert 0 < s.max_chunk_bytes < s.max_message_bytes
    for name in ("hbm", "host", "nvme"):
        t = getattr(cfg.tiers, name)
        assert 0 <= t.capacity <= config.MAX_SIZE and isinstance(t.capacity, int)
        if t.enabled:
            assert t.capacity > 0
    assert 0 < cfg.prefetch.quantile < 1 and math.isfinite(cfg.prefetch.lead_time_s)
    assert cfg.tiers.hbm.device >= 0
    p = cfg.prefetch
    assert 0 < p.poll_s and 0 < p.refresh_s and 0 < p.retry_s and 0 < p.horizon_s
    assert 0 <= p.headroom_fraction < 1 and 0 <= p.confidence <= 1 and p.victim_margin >= 0
    assert all(rate > 0 and hop.count(":") == 1 for hop, rate in p.hop_bandwidth.items())
    assert 0 < cfg.store.writer_wait_s and 0 < cfg.store.transfer_timeout_s and cfg.store.stop_persist_s >= 0
    assert min(cfg.sessions.window, cfg.sessions.max_sessions, cfg.sessions.max_keys) >= 1
    assert cfg.health.period_s > 0 and cfg.health.window_s >= 0
    strings = [s.listen, s.auth_token, s.tls_cert, s.tls_key, cfg.tiers.nvme.path, *s.tenants, *s.tenants.values()]
    assert not any("\x00" in v for v in strings)
    if s.listen.startswith("unix:"):
        assert s.listen[len("unix:"):].strip("/")


def check_error(e: ConfigError) -> None:
    msg = str(e)
    assert msg and "Traceback" not in msg
    first = msg.split(":", 1)[0]
    known_roots = tuple(SECTIONS) + ("bogus", "config", "tiers", "policy")
    assert first.startswith(known_roots) or any(s in msg for s in ("unknown key", "TOML")), msg


@pytest.mark.slow
@FUZZ
@given(data=tables())
def test_fuzz_config_tables(data):
    CASES["n"] += 1
    try:
        cfg = config.from_dict(data)
    except ConfigError as e:
        check_error(e)
    else:
        check_config(cfg)


@FUZZ
@given(case=mutated_valid())
def test_fuzz_one_bad_field_in_a_valid_config(case):
    path, data = case
    CASES["n"] += 1
    try:
        cfg = config.from_dict(data)
    except ConfigError as e:
        check_error(e)
        # the message names the field that was changed (or, for cross-field rules, its section)
        assert path.split(".")[0] in str(e) or path.rsplit(".", 1)[-1] in str(e), (path, str(e))
    else:
        check_config(cfg)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


@pytest.mark.slow
@FUZZ
@given(data=tables(), noise=st.text(max_size=40), where=st.integers(0, 1000))
def test_fuzz_config_text(data, noise, where):
    lines = []
    for section, body in data.items():
        lines.append(f"{_toml(section)} = {_toml(body)}")
    text = "\n".join(lines)
    if noise:
        text = text[:where] + noise + text[where:]
    CASES["n"] += 1
    try:
        cfg = config.loads(text)
    except ConfigError as e:
        check_error(e)
    else:
        check_config(cfg)


@FUZZ
@given(size=sizes)
def test_fuzz_sizes(size):
    CASES["n"] += 1
    try:
        cfg = config.from_dict({"tiers": {"host": {"capacity": size}}})
    except ConfigError as e:
        assert "tiers.host.capacity" in str(e), str(e)
    else:
        assert 0 < cfg.tiers.host.capacity <= config.MAX_SIZE


def test_huge_sizes_are_refused_with_the_key():
    for bad in ("9" * 400, "99999999999999999999TiB", 1 << 64, "8000000000PiB"):
        with pytest.raises(ConfigError, match="tiers.nvme.capacity"):
            config.from_dict({"tiers": {"nvme": {"capacity": bad}}})


def test_unreadable_config_paths(tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage\x80")
    cases = {tmp_path / "missing.toml": "cannot read", tmp_path: "cannot read", binary: "not UTF-8",
             tmp_path / "missing-dir" / "x.toml": "cannot read"}
    if os.geteuid() != 0:                                  # root reads mode-000 files anyway
        locked = tmp_path / "locked.toml"
        locked.write_text("[server]\n")
        locked.chmod(0)
        cases[locked] = "cannot read"
    for path, needle in cases.items():
        with pytest.raises(ConfigError, match=needle):
            config.load(path)


def test_unusable_paths_fail_at_start_with_a_config_error(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad = [
        {"tiers": {"nvme": {"path": str(a_file)}}},                              # a file, not a folder
        {"tiers": {"nvme": {"path": str(a_file / "below")}}},                    # below a file
        {"server": {"listen": f"unix:{a_file}/kvstore.sock"}},                   # socket below a file
    ]
    for extra in bad:
        cfg = daemon_config(tmp_path, extra=extra)
        with pytest.raises(ConfigError):
            d = start_server(cfg)
            d.stop(0)


def test_config_fuzz_case_count():
    """Reports how many generated configs the fuzz tests above checked (run with -s)."""
    print(f"\nconfig fuzz: {CASES['n']} cases checked")
    assert CASES["n"] == 0 or CASES["n"] >= EXAMPLES


def test_valid_defaults_survive_every_round_trip():
    cfg = config.load(None)
    again = config.from_dict({f.name: {} for f in dataclasses.fields(cfg) if f.name != "tiers"})
    assert again.server == cfg.server and again.tiers == cfg.tiers
