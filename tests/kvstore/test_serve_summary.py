"""``kvstore serve`` says where its data lives and how big each tier may grow."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from kvstore import config
from kvstore.tools.serve_summary import data_lines
from support.daemon import ROOT, short_socket_dir


def test_without_a_config_the_data_lives_under_the_current_folder(tmp_path):
    text = "\n".join(data_lines(config.load(None), None, cwd=tmp_path))
    assert "host   up to 1.00 GiB of shared memory (memfd), allocated at start" in text
    assert f"nvme   up to 16.00 GiB of files in {tmp_path}/kvstore-data/nvme (" in text
    assert f"socket {tmp_path}/kvstore-data/kvstore.sock" in text
    assert f"no --config: built-in defaults, so the data lives under the current folder ({tmp_path})" in text
    assert '[tiers.nvme] path = "/var/lib/kvstore/nvme"' in text


def test_a_config_with_absolute_paths_gets_no_advice(tmp_path):
    cfg = config.from_dict({"server": {"listen": f"unix:{tmp_path}/k.sock"},
                            "tiers": {"host": {"capacity": "64MiB", "shared": False},
                                      "nvme": {"path": str(tmp_path / "nvme"), "capacity": "2GiB"}}})
    lines = data_lines(cfg, tmp_path / "node.toml", cwd=tmp_path / "elsewhere")
    assert lines[1:] == [
        "    host   up to 64.00 MiB of host memory, allocated at start (copied to NVMe on a graceful stop)",
        next(line for line in lines if line.startswith("    nvme")),
        f"    socket {tmp_path}/k.sock"]
    assert lines[2].startswith(f"    nvme   up to 2.00 GiB of files in {tmp_path}/nvme (")
    assert lines[2].endswith("free there now); kept across restarts")


def test_relative_paths_and_a_capacity_beyond_the_free_space_are_named(tmp_path):
    cfg = config.from_dict({"server": {"listen": "127.0.0.1:50051"},
                            "tiers": {"host": {"enabled": False},
                                      "nvme": {"path": "data/nvme", "capacity": "1000000TiB"}}})
    text = "\n".join(data_lines(cfg, "node.toml", cwd=tmp_path))
    assert f"files in {tmp_path}/data/nvme (" in text and "the capacity is more than that" in text
    assert f"relative paths ([tiers.nvme] path = 'data/nvme') resolve against the current folder ({tmp_path})" in text
    assert "socket" not in text and "host" not in text


def test_serve_prints_the_summary_at_start(tmp_path):
    sock = f"unix:{short_socket_dir()}/kvstore.sock"
    (tmp_path / "node.toml").write_text(f'[server]\nlisten = "{sock}"\n[tiers.host]\ncapacity = "4MiB"\n'
                                        '[tiers.nvme]\npath = "data/nvme"\ncapacity = "16MiB"\n')
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", "node.toml"],
                                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "resolve against the current folder" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    text = log_path.read_text()
    assert re.search(rf"nvme   up to 16\.00 MiB of files in {re.escape(str(tmp_path))}/data/nvme \(", text)
    assert (tmp_path / "data" / "nvme").is_dir()                  # where the summary said
