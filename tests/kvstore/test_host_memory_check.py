"""A host tier larger than the memory free now is refused with the key named, before its
arena is made (the arena is populated when it is made: a 40 GiB tier on a 23 GiB machine
got the daemon killed by the kernel's out-of-memory killer, with no message)."""

from __future__ import annotations

import pytest

from kvstore.common.errors import ConfigError
from kvstore.service.build import build_tiers, close_all
from support.daemon import daemon_config
from tiers import memory


def test_a_host_tier_larger_than_the_free_memory_is_refused_before_it_is_made(tmp_path):
    free = memory.available_bytes()
    if free is None:
        pytest.skip("this system does not say how much memory is available (/proc/meminfo)")
    # refused by the check, not by a failed allocation ("cannot allocate ...")
    with pytest.raises(ConfigError, match=r"tiers\.host\.capacity: .* of host memory asked, but this machine has "
                                          r".* available now"):
        build_tiers(daemon_config(tmp_path, host=free + (1 << 30), nvme=None))


def test_a_host_tier_within_the_free_memory_is_made(tmp_path):
    tiers = build_tiers(daemon_config(tmp_path, host="8MiB", nvme=None))
    try:
        assert [name for name, _ in tiers] == ["host"]
        assert tiers[0][1].capacity_bytes == 8 << 20
    finally:
        close_all(tiers)


def test_available_bytes_reads_meminfo(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\nHugePages_Free:        3\n"
                    "Hugepagesize:       2048 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/meminfo" else p, *a, **k))
    assert memory.available_bytes() == 1000 * 1024 + 3 * (2 << 20)
