"""A host tier larger than the memory this machine (or its cgroup) has in all is refused
with the key named, before its arena is made: the arena is populated when it is made, and a
40 GiB tier on a 23 GiB machine got the daemon killed by the kernel's out-of-memory killer,
with no message. One larger than what is available now is warned of, not refused (a stopped
daemon's arena that a client still maps counts as used until the client lets go)."""

from __future__ import annotations

import logging

import pytest

from kvstore.common.errors import ConfigError
from kvstore.service import build
from kvstore.service.build import build_tiers, close_all
from support.daemon import daemon_config
from tiers import memory


def test_a_host_tier_larger_than_the_machine_is_refused_before_it_is_made(tmp_path):
    limits = memory.memory_limits()
    if limits is None:
        pytest.skip("this system does not say how much memory it has (/proc/meminfo)")
    # refused by the check, not by a failed allocation ("cannot allocate ...")
    with pytest.raises(ConfigError, match=r"tiers\.host\.capacity: .* of host memory asked, but this machine has "
                                          r".* in all"):
        build_tiers(daemon_config(tmp_path, host=limits[0] + (1 << 30), nvme=None))


def test_a_host_tier_larger_than_the_memory_available_now_is_warned_of(monkeypatch, caplog):
    monkeypatch.setattr(memory, "memory_limits", lambda: (64 << 30, 8 << 30))
    with caplog.at_level(logging.WARNING, logger="kvstore.service.build"):
        build.check_host_memory(16 << 30)
    assert "16.00 GiB of host memory asked and 8.00 GiB available now" in caplog.text
    caplog.clear()
    build.check_host_memory(4 << 30)
    assert caplog.text == ""


def test_a_host_tier_within_the_free_memory_is_made(tmp_path):
    tiers = build_tiers(daemon_config(tmp_path, host="8MiB", nvme=None))
    try:
        assert [name for name, _ in tiers] == ["host"]
        assert tiers[0][1].capacity_bytes == 8 << 20
    finally:
        close_all(tiers)


def fake_files(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    real_open = open

    def fake_open(p, *a, **k):
        if p in files:
            path = tmp_path / p.strip("/").replace("/", "_")
            path.write_text(files[p])
            return real_open(path, *a, **k)
        if p in memory.CGROUP_FILES:
            raise FileNotFoundError(p)
        return real_open(p, *a, **k)
    monkeypatch.setattr("builtins.open", fake_open)


MEMINFO = ("MemTotal:       24000000 kB\nMemFree:   500 kB\nMemAvailable:    1000 kB\nHugePages_Free:        3\n"
           "Hugepagesize:       2048 kB\n")


def test_memory_limits_read_meminfo(tmp_path, monkeypatch):
    fake_files(tmp_path, monkeypatch, {"/proc/meminfo": MEMINFO})
    huge = 3 * (2 << 20)
    assert memory.memory_limits() == (24000000 * 1024 + huge, 1000 * 1024 + huge)


def test_memory_limits_are_capped_by_the_cgroup(tmp_path, monkeypatch):
    fake_files(tmp_path, monkeypatch, {"/proc/meminfo": MEMINFO, memory.CGROUP_FILES[0]: "8589934592\n",
                                       memory.CGROUP_FILES[1]: "8589000000\n"})
    assert memory.memory_limits() == (8589934592, 934592)
