"""``kvstore agent-demo`` output: a turn that paged nothing back shows no speedup and is left
out of the total's ratio (turn 1 showed 1.90x with ``paged back 0``); a daemon that answers
but refuses the demo is not called absent."""

from __future__ import annotations

import pytest

from engine_adapter.reference.demo import HEADER, DemoOptions, format_row, run_demo, speedup
from support.daemon import daemon_config


def row(turn, paged, store_ms, recompute_ms):
    return dict(turn=turn, prompt=100, paged=paged, prefilled=100 - paged, ttft_store_ms=store_ms,
                ttft_recompute_ms=recompute_ms, same_tokens=True, max_logit_diff=0.0, problems=[])


def test_a_turn_that_paged_nothing_back_shows_no_speedup():
    cols = format_row(row(1, 0, 10.0, 19.0)).split()
    assert cols[6] == "-" and cols[7] == "yes"
    assert format_row(row(2, 80, 10.0, 30.0)).split()[6] == "3.00x"
    assert len(format_row(row(1, 0, 10.0, 19.0))) == len(format_row(row(2, 80, 10.0, 30.0)))
    assert HEADER.split()[-5] == "speedup"


def test_the_total_counts_only_turns_that_paged_back():
    rows = [row(1, 0, 10.0, 19.0), row(2, 80, 10.0, 30.0), row(3, 90, 20.0, 50.0)]
    assert speedup(rows) == pytest.approx(80.0 / 30.0)
    assert speedup(rows[:1]) is None


def test_a_daemon_that_refuses_the_token_is_not_called_absent(tmp_path, capsys):
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, extra={"server": {"auth_token": "0123456789abcdef0123"}}))
    try:
        opts = DemoOptions(target=d.address, model="tiny", checkpoint=None, seed=0, dtype="float32",
                           block_tokens=16, tenant="t", turns=1, system_tokens=16,
                           observation_tokens=16, answer_tokens=1, tool_wait_s=0.0,
                           store_timeout_s=5.0)
        assert run_demo(opts, 2) == 1
    finally:
        d.stop(0)
    out = capsys.readouterr().out
    assert "UNAUTHENTICATED" in out and "refused the demo" in out and "start one with" not in out
