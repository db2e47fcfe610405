"""``kvstore agent-demo``: the subcommand registers and plays a short TP=2 session."""

import argparse

import pytest

from ea_support import start_daemon
from kvstore.tools import agent_demo_cmd as demo


def parse(argv):
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers())
    return parser.parse_args(argv)


@pytest.mark.slow
def test_agent_demo_tp2_prints_turns(tmp_path, capfd):
    daemon = start_daemon(tmp_path)
    try:
        args = parse(["agent-demo", "--target", daemon.address, "--model", "tiny", "--turns", "3",
                      "--system-tokens", "64", "--observation-tokens", "24", "--answer-tokens", "4",
                      "--store-timeout-s", "60", "--lookup-timeout-s", "60"])   # a saturated machine must not turn a page back into a recompute
        assert args.tp == 2
        assert args.func(args) == 0
    finally:
        daemon.stop(0)
    out = capfd.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(cols[0]) for cols in lines] == [1, 2, 3]
    prompt, paged, prefilled = (int(x) for x in lines[1][1:4])
    assert paged == 80 and prefilled == prompt - paged          # turn 2 pages back 5 blocks
    assert all(cols[7] == "yes" for cols in lines)
    assert "greedy tokens identical in every turn" in out


def test_agent_demo_without_daemon_says_so(tmp_path, capsys):
    args = parse(["agent-demo", "--target", f"unix:{tmp_path}/none.sock"])
    assert args.func(args) == 1
    assert "no kvstore daemon answers" in capsys.readouterr().out
