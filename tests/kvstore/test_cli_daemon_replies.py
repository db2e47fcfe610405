"""The CLI against real daemons: output into a closed pipe ends quietly (exit 141, no
BrokenPipeError traceback); ``replay`` counts every block a daemon refuses, with the reason,
refuses blocks larger than the daemon's largest tier up front, and fails when no block
could be put; the "is `kvstore serve` running" hint comes only when no daemon answered,
never for a missing or wrong token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from support.daemon import ROOT, child_env, daemon_config
from kvstore.common.types import PutResult
from kvstore.service.startup import start_server
from kvstore.tools import replay as replay_mod
from kvstore.tools.cli import BROKEN_PIPE, main

TOKEN = "0123456789abcdef0123"


def _trace(tmp_path, *requests):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                         for t, (n, ids) in enumerate(requests)))
    return p


@pytest.fixture
def small_daemon(tmp_path):
    """Host tier 1 MiB, NVMe tier 2 MiB: a 2 MiB block fits neither (NVMe keeps a header)."""
    d = start_server(daemon_config(tmp_path, host="1MiB", nvme="2MiB"))
    yield d
    d.stop(0)


@pytest.fixture
def token_daemon(tmp_path):
    d = start_server(daemon_config(tmp_path, extra={"server": {"auth_token": TOKEN}}))
    yield d
    d.stop(0)


# --------------------------------------------------------------------------- closed pipes


def run_into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``kvstore ARGV`` with stdout a pipe whose reader is already gone."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "kvstore.tools.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                              cwd=ROOT, env=child_env(), timeout=120, text=True)
    finally:
        os.close(w)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--watch", "0.01", "--count", "3"]])
def test_stats_into_a_closed_pipe_exits_quietly(daemon, extra):
    done = run_into_closed_pipe(["stats", "--target", daemon.address, *extra])
    assert done.returncode == BROKEN_PIPE == 141
    assert done.stderr == ""


def test_any_command_into_a_closed_pipe_exits_quietly(tmp_path):
    done = run_into_closed_pipe(["gen-agent-trace", str(tmp_path / "g.jsonl"), "--agents", "2", "--duration", "60"])
    assert (done.returncode, done.stderr) == (BROKEN_PIPE, "")
    assert (tmp_path / "g.jsonl").exists()           # the work was done; only its report was lost
    done = run_into_closed_pipe(["simulate", str(tmp_path / "g.jsonl"), "--no-opt"])
    assert (done.returncode, done.stderr) == (BROKEN_PIPE, "")


# --------------------------------------------------------------------------- replay put failures


def test_every_refused_block_is_counted_with_its_reason_and_the_replay_fails(tmp_path, small_daemon, capsys):
    trace = _trace(tmp_path, (1024, [1, 2]))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--target", small_daemon.address, "--bytes-per-token", "4096", "--quiet",
                 "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["put_failures"] == 2 and rep["blocks_put"] == 0
    (reason, count), = rep["put_failure_reasons"].items()
    assert count == 2 and "a 2097152-byte block is larger than the largest block a tier can hold" in reason
    captured = capsys.readouterr()
    assert "put failures    2" in captured.out and f"  2 refused     {reason}" in captured.out
    assert f"kvstore replay: no block could be put (2 refused; most often: {reason})" in captured.err


def test_blocks_larger_than_the_daemons_largest_tier_are_refused_up_front(tmp_path, small_daemon, capsys,
                                                                         monkeypatch):
    monkeypatch.setattr(replay_mod, "replay", lambda *a, **kw: pytest.fail("replayed blocks no tier can hold"))
    trace = _trace(tmp_path, (1024, [1, 2]))
    assert main(["replay", str(trace), "--target", small_daemon.address, "--bytes-per-token", "8192"]) == 2
    err = capsys.readouterr().err
    assert (f"blocks of 4.00 MiB, larger than the largest tier of the daemon at {small_daemon.address} "
            f"(nvme, 2.00 MiB in all)") in err
    assert "1.00 GiB" not in err


def test_the_replays_own_limit_is_not_called_the_daemons(tmp_path, capsys):
    trace = _trace(tmp_path, (1024, [1, 2]))
    assert main(["replay", str(trace), "--bytes-per-token", str(1 << 22)]) == 2
    assert "a replay makes blocks of at most 1.00 GiB" in capsys.readouterr().err


class _Refusing:
    """A client whose puts store nothing: the first block is not admitted, the second is a
    size conflict; a put of more than one block is refused as a whole."""

    def __init__(self):
        self.calls = []

    def put(self, blocks):
        blocks = list(blocks)
        self.calls.append(len(blocks))
        if len(blocks) > 1:
            raise replay_mod.TierFull("RESOURCE_EXHAUSTED: no tier can hold it")
        first = len(self.calls) == 2
        return PutResult(0, 0, 0, not_admitted=int(first), size_conflicts=int(not first))


def test_refusals_inside_a_put_reply_count_per_block_with_their_kind():
    rep = replay_mod.ReplayReport()
    client = _Refusing()
    replay_mod._put_blocks(client, [b"a" * 32, b"b" * 32], 16, rep)
    assert client.calls == [2, 1, 1]                  # refused as a batch, then one block at a time
    assert rep.put_failures == 2
    assert rep.put_failure_reasons == {replay_mod.NOT_ADMITTED: 1, replay_mod.SIZE_CONFLICT: 1}


def test_the_report_keeps_a_bounded_number_of_reasons():
    rep = replay_mod.ReplayReport()
    for i in range(replay_mod.MAX_FAILURE_REASONS + 5):
        rep.count_put_failures(f"reason {i}", 2)
    assert rep.put_failures == 2 * (replay_mod.MAX_FAILURE_REASONS + 5)
    assert len(rep.put_failure_reasons) == replay_mod.MAX_FAILURE_REASONS + 1
    assert rep.put_failure_reasons[replay_mod.OTHER_REASONS] == 10


def test_a_replay_that_puts_blocks_still_succeeds(tmp_path, daemon):
    trace = _trace(tmp_path, (1000, [1, 2]), (600, [1, 4]))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--target", daemon.address, "--bytes-per-token", "1", "--quiet",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["blocks_put"] == 3 and rep["put_failures"] == 0 and rep["put_failure_reasons"] == {}


# --------------------------------------------------------------------------- hints


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token"])
def test_a_token_error_gets_no_daemon_down_hint(tmp_path, token_daemon, capsys, token):
    trace = _trace(tmp_path, (1024, [1, 2]))
    given = ["--token", token] if token else []
    assert main(["replay", str(trace), "--target", token_daemon.address, "--quiet", *given]) == 1
    assert main(["stats", "--target", token_daemon.address, *given]) == 1
    assert main(["stats", "--target", token_daemon.address, "--watch", "0.01", "--count", "2", *given]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 3 and all("UNAUTHENTICATED" in line for line in lines), captured.err
    hint = "(the --token given is not the daemon's)" if token else "(the daemon needs --token)"
    assert all(line.endswith(hint) for line in lines)
    assert "running" not in captured.err and "not answering" not in captured.out


def test_no_daemon_still_gets_the_hint(tmp_path, capsys):
    trace = _trace(tmp_path, (1024, [1, 2]))
    sock = f"unix:{tmp_path}/none.sock"
    assert main(["replay", str(trace), "--target", sock, "--wait", "0.2", "--quiet"]) == 1
    assert main(["stats", "--target", sock, "--timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert f"(is `kvstore serve` running on {sock}?)" in err
    assert f"(is `kvstore serve` running, listening on {sock}?)" in err
