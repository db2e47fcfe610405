"""``kvstore stats --watch``: the live view's numbers, its redraw, and a daemon that is away."""

from __future__ import annotations

import io

import pytest

from kvstore.client.client import KVStoreClient
from kvstore.tools import stats_cmd
from kvstore.tools.cli import main
from kvstore.tools.stats_cmd import CLEAR, Sample, render, watch

KIB = 1024


def stats(counters: dict, *, used=0, serving=True, problems=()) -> dict:
    return {"tiers": [{"tier": "host", "name": "host", "policy": "lru", "capacity_bytes": 1024 * KIB,
                       "used_bytes": used, "payload_bytes": used, "blocks": used // (64 * KIB)},
                      {"tier": "nvme", "name": "nvme", "policy": "arc", "capacity_bytes": 4096 * KIB,
                       "used_bytes": 0, "payload_bytes": 0, "blocks": 0}],
            "counters": counters, "serving": serving, "problems": list(problems)}


PREV = {"lookups": 10, "lookup_blocks": 60, "lookup_hit_blocks": 45, "reads": 20, "reads_host": 10,
        "reads_nvme": 10, "read_bytes_host": 10 * 64 * KIB, "evictions_host": 2, "blocks_put": 8,
        "bytes_put": 8 * 64 * KIB}
CUR = {"lookups": 14, "lookup_blocks": 100, "lookup_hit_blocks": 75, "reads": 40, "reads_host": 30,
       "reads_nvme": 10, "read_bytes_host": 30 * 64 * KIB, "evictions_host": 6, "blocks_put": 12,
       "bytes_put": 12 * 64 * KIB, "leased_blocks": 5, "table_read_blocks": 16, "corrupt_blocks": 1}


def test_a_frame_states_usage_hit_rates_and_rates_per_second():
    frame = render("unix:s", Sample(stats(CUR, used=256 * KIB), 12.0), Sample(stats(PREV), 10.0)).splitlines()
    host = next(line for line in frame if line.startswith("host")).split()
    # tier policy capacity(2) used(2) used% blocks reads/s read(2) stored(2) evicted/s
    assert host[:2] == ["host", "lru"] and host[4:6] == ["256.00", "KiB"] and host[6] == "25.0%"
    assert host[7] == "4" and host[8] == "10.0"                        # (30 - 10) reads / 2 s
    assert host[9:11] == ["640.00", "KiB/s"]                           # 20 x 64 KiB / 2 s
    assert host[-1] == "2.0"                                           # (6 - 2) evictions / 2 s
    text = "\n".join(frame)
    assert "hit rate 75.0% since start (75 of 100 blocks looked up), 75.0% over the last 2.0 s (30 of 40)" in text
    assert ("reads by tier since start: host 75.0%, nvme 25.0% of 40 blocks served by Get; same node, read in "
            "place: 5 blocks leased, 16 read from the block table") in text
    assert "lookups 2.0  blocks put 2.0 (128.00 KiB/s)  blocks read 10.0  leased 2.5  table reads 8.0" in text
    assert "corrupt_blocks 1" in text and "problems: none" in text and "serving: yes" in text


def test_the_first_frame_has_no_rates_and_a_restart_shows_none():
    first = render("t", Sample(stats(CUR), 5.0), None)
    assert "rates from the next frame" in first and "over the" not in first
    assert "lookups -  blocks put - (-)" in first
    restarted = render("t", Sample(stats(PREV), 7.0), Sample(stats(CUR), 5.0))   # counters went back
    assert "blocks put - (-)" in restarted


def test_a_daemon_with_problems_says_so():
    frame = render("t", Sample(stats(CUR, serving=False, problems=["nvme: disk full"]), 1.0), None)
    assert "serving: NO" in frame and "problem: nvme: disk full" in frame and "problems: none" not in frame


class Screen(io.StringIO):
    """A terminal stand-in: runs ``between`` once, after the first frame is written."""

    def __init__(self, between=None, tty: bool = False):
        super().__init__()
        self.between, self.tty = between, tty

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.between is not None:
            between, self.between = self.between, None
            between()
        return n

    def isatty(self) -> bool:
        return self.tty


def test_watch_follows_a_running_daemon(daemon):
    keys = [bytes([i]) * 32 for i in range(4)]
    missing = [b"\xee" * 32, b"\xef" * 32]
    with KVStoreClient(daemon.address, timeout=10) as c:
        c.put([(k, b"x" * 4096) for k in keys])
        assert c.lookup(keys + missing).hit_blocks == 4
        screen = Screen(between=lambda: c.lookup(keys[:2] + missing))
        assert watch(daemon.address, 0.1, count=2, out=screen) == 0
    first, second = screen.getvalue().split("\n\n")[:2]
    assert "hit rate 66.7% since start (4 of 6 blocks looked up)" in first
    assert "hit rate 60.0% since start (6 of 10 blocks looked up), 50.0% over the last" in second
    assert "(2 of 4)" in second
    assert next(line for line in second.splitlines() if line.startswith("host")).split()[7] == "4"


def test_on_a_terminal_each_frame_replaces_the_last(daemon):
    screen = Screen(tty=True)
    watch(daemon.address, 0.05, count=3, out=screen)
    frames = screen.getvalue().split(CLEAR)
    assert frames[0] == "" and len(frames) == 4 and all(f.startswith("kvstore at ") for f in frames[1:])


def test_a_daemon_that_is_away_shows_and_the_view_goes_on(tmp_path):
    screen = Screen()
    assert watch(f"unix:{tmp_path}/none.sock", 0.01, count=2, timeout=0.5, out=screen) == 0
    assert screen.getvalue().count("not answering") == 2


def test_the_command_line_runs_the_view_until_count(daemon, capsys):
    assert main(["stats", "--target", daemon.address, "--watch", "0.05", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"kvstore at {daemon.address}") == 2


def test_watch_seconds_default_and_validation(monkeypatch):
    seen = {}
    monkeypatch.setattr(stats_cmd, "watch", lambda target, seconds, **kw: seen.update(s=seconds, **kw) or 0)
    assert main(["stats", "--watch"]) == 0 and seen["s"] == stats_cmd.DEFAULT_WATCH_S and seen["count"] is None
    with pytest.raises(SystemExit):
        main(["stats", "--watch", "0"])
