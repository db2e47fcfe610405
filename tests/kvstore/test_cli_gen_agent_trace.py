"""``kvstore gen-agent-trace`` refuses what it cannot write, before generating: options that
make too many requests (it grew memory without end on ``--duration 1e12``), non-finite
numbers, a missing folder (it was created), and a duration in which no request starts
(it wrote an empty trace and exited 0)."""

from __future__ import annotations

import json
import math

import pytest

from kvstore.tools import agent_trace
from kvstore.tools.agent_trace import (
    MAX_REQUESTS,
    AgentWorkload,
    ChatTraffic,
    TraceTooLarge,
    expected_requests,
    generate,
)
from kvstore.tools.cli import main


@pytest.fixture
def no_generation(monkeypatch):
    """Fail the test if the command starts generating (a refusal must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the workload was generated before the options were refused")
    monkeypatch.setattr(agent_trace, "_Generator", refuse)


def test_a_huge_duration_is_refused_up_front_and_writes_nothing(tmp_path, capsys, no_generation):
    out = tmp_path / "huge.jsonl"
    assert main(["gen-agent-trace", str(out), "--duration", "1e12", "--agents", "1"]) == 2
    err = capsys.readouterr().err
    assert f"at most {MAX_REQUESTS}" in err and "--duration" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, value", [("--chat-rate", "inf"), ("--chat-rate", "nan"), ("--chat-rate", "-1"),
                                         ("--abandon", "nan"), ("--abandon", "1"),
                                         ("--system-tokens", str(10 ** 12)), ("--tools", "")])
def test_non_finite_and_unbounded_values_are_refused(tmp_path, capsys, no_generation, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["gen-agent-trace", str(tmp_path / "g.jsonl"), "--agents", "1", "--duration", "60", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_tools_file_with_a_non_finite_duration_is_refused(tmp_path, capsys, no_generation):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "slow", "duration_median_s": float("inf"), "duration_sigma": 1.0,
                                  "observation_median_tokens": 100, "observation_sigma": 0.5, "weight": 1.0}]))
    assert main(["gen-agent-trace", str(tmp_path / "g.jsonl"), "--tools", str(tools)]) == 2
    err = capsys.readouterr().err
    assert "bad --tools file" in err and "duration_median_s must be a finite number > 0 and <= 604800, got inf" in err


def test_a_missing_folder_is_not_created(tmp_path, capsys, no_generation):
    out = tmp_path / "nonexist" / "g.jsonl"
    assert main(["gen-agent-trace", str(out), "--agents", "1", "--duration", "60"]) == 2
    assert f"cannot write {out}: No such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "nonexist").exists()


def test_a_duration_with_no_request_is_an_error_and_writes_nothing(tmp_path, capsys):
    # seed 0: the only agent starts after its first pause, later than 5 s, and no chat comes
    assert generate(AgentWorkload(agents=1, duration_s=5.0))[0] == []
    out = tmp_path / "g.jsonl"
    assert main(["gen-agent-trace", str(out), "--agents", "1", "--duration", "5"]) == 2
    assert "no request starts within --duration 5 s" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_workload_past_the_request_limit_stops_while_generating(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(agent_trace, "MAX_REQUESTS", 50)      # the generator's own bound
    w = AgentWorkload(agents=4, duration_s=3000.0, seed=3)
    with pytest.raises(TraceTooLarge, match="more than 50 requests"):
        generate(w)
    out = tmp_path / "g.jsonl"
    assert main(["gen-agent-trace", str(out), "--agents", "4", "--duration", "3000", "--seed", "3"]) == 2
    assert "more than 50 requests" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_workload_past_the_block_limit_stops_while_generating(monkeypatch):
    monkeypatch.setattr(agent_trace, "MAX_BLOCKS", 100)
    with pytest.raises(TraceTooLarge, match="more than 100 blocks"):
        generate(AgentWorkload(agents=4, duration_s=3000.0, seed=3))


def test_the_estimate_is_near_the_count_and_grows_with_the_options():
    w = AgentWorkload(agents=32, duration_s=3600.0, seed=1)
    n = len(generate(w)[0])
    assert 0.7 * n < expected_requests(w) < 1.4 * n
    # one agent makes about one call per 35 s; chat adds 0.1 conversations/s of 1/(1-0.37) calls each
    huge = expected_requests(AgentWorkload(agents=1, duration_s=1e12))
    assert huge > 1e10
    no_chat = expected_requests(AgentWorkload(agents=1, duration_s=1e12, chat=None))
    assert huge - no_chat == pytest.approx(1e12 * 0.1 / (1 - 0.37), rel=1e-9)


def test_workload_values_must_be_finite():
    with pytest.raises(ValueError, match="duration_s must be a finite number"):
        AgentWorkload(duration_s=math.inf)
    with pytest.raises(ValueError, match="sessions_per_s must be a finite number"):
        ChatTraffic(sessions_per_s=math.inf)
    with pytest.raises(ValueError, match="system_tokens must be in"):
        AgentWorkload(system_tokens=10 ** 12)
