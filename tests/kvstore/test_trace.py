"""Mooncake trace reader."""

from __future__ import annotations

import json

import pytest

from kvstore.tools.trace import Request, TraceError, block_key, parse_lines, read_mooncake_trace


def line(**kw) -> str:
    d = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    d.update(kw)
    return json.dumps(d)


def test_reads_and_sorts_by_timestamp(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([line(timestamp=30), "", line(timestamp=10, hash_ids=[7, 8])]) + "\n")
    reqs = read_mooncake_trace(p)
    assert [r.timestamp_ms for r in reqs] == [10.0, 30.0]
    assert reqs[0] == Request(10.0, 600, 5, [7, 8])
    assert reqs[0].time_s == 0.01
    assert reqs[0].block_tokens(0) == 512 and reqs[0].block_tokens(1) == 88
    assert reqs[0].prefix_tokens(1) == 512 and reqs[0].prefix_tokens(2) == 600


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"input_length": 5, "output_length": 1, "hash_ids": [1]}), "missing field 'timestamp'"),
    (line(timestamp=-1), "timestamp must be"),
    (line(input_length="600"), "'input_length' must be an integer"),
    (line(hash_ids=[1]), "1 hash_ids for input_length 600"),
    (line(hash_ids=[1, -2]), "hash_ids must hold integers >= 0"),
    (line(hash_ids=[]), "non-empty list"),
    (line(output_length=-3), "output_length must be >= 0"),
])
def test_malformed_lines_name_the_line(text, message):
    with pytest.raises(TraceError, match=message) as e:
        parse_lines([line(), text], name="x.jsonl")
    assert "x.jsonl:2" in str(e.value)


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_mooncake_trace(tmp_path / "absent.jsonl")


def test_block_key_is_stable_and_matches_replay():
    from kvstore.tools.replay import trace_key

    assert len(block_key(5)) == 32
    assert block_key(5) == block_key(5) != block_key(6)
    assert block_key(12345) == trace_key(12345)


CSV = "timestamp,input_length,output_length,hash_ids\n0,600,5,\"[1, 2]\"\n"


def test_a_csv_trace_says_what_format_is_expected_and_what_was_found(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(CSV)
    with pytest.raises(TraceError) as e:
        read_mooncake_trace(p)
    message = str(e.value)
    assert f"{p}:1: " in message                                          # which line
    assert "found 'timestamp,input_length,output_length,hash_ids'" in message     # what was found
    assert "expected one JSON object per line (Mooncake JSONL)" in message       # what is expected
    assert '"hash_ids": [0, 1, 2]' in message and "looks like CSV" in message


def test_kvstore_replay_of_a_csv_trace_explains_the_format(tmp_path, capsys):
    from kvstore.tools.cli import main
    p = tmp_path / "t.csv"
    p.write_text(CSV)
    assert main(["replay", str(p), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "expected one JSON object per line" in err and "looks like CSV" in err


def test_an_events_file_that_is_not_json_lines_says_what_is_expected(tmp_path):
    from kvstore.tools.agent_events import read_tool_events
    p = tmp_path / "x.events.jsonl"
    p.write_text("time,event,trajectory\n")
    with pytest.raises(TraceError, match=r"x.events.jsonl:1: not valid JSON .*found 'time,event,trajectory'; "
                                         r"expected one JSON object per line"):
        read_tool_events(p)


GOOD_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("name,text,needle", [
    ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("bigint.jsonl", '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [' + "9" * 5000 + "]}\n",
     "a value out of range"),
])
def test_hostile_json_lines_are_trace_errors_on_every_command(tmp_path, capsys, name, text, needle):
    """A line nested deeper than Python's recursion limit, or an integer of 5,000 digits,
    raised RecursionError / ValueError tracebacks from replay, simulate and explain."""
    from kvstore.tools.cli import main
    p = tmp_path / name
    p.write_text(GOOD_LINE + text)
    with pytest.raises(TraceError, match=rf"{name}:2: not valid JSON \({needle}"):
        read_mooncake_trace(p)
    assert main(["replay", str(p), "--quiet", "--wait", "0.1"]) == 2
    assert main(["simulate", str(p)]) == 2
    prompt = tmp_path / "prompt.json"
    prompt.write_text(text)
    assert main(["explain", str(prompt), str(prompt)]) == 2
    err = capsys.readouterr().err
    assert err.count(needle) == 3 and "Traceback" not in err


def test_bad_command_line_values_are_refused_with_a_message(tmp_path, capsys):
    """Values that ran anyway (``simulate --capacity -5`` printed a table; ``0`` meant the
    default), or that ended in a traceback (``--block-bytes 0``, a binary events file,
    ``gen-agent-trace`` into a folder, a 46 TiB replay block)."""
    from kvstore.tools.cli import main
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINE)
    events = tmp_path / "bin.events.jsonl"
    events.write_bytes(b"\xbf\xff\x00garbage")
    for argv in (["simulate", str(trace), "--capacity", "-5"], ["simulate", str(trace), "--capacity", "0"],
                 ["simulate", str(trace), "--block-bytes", "0"], ["simulate", str(trace), "--limit", "-1"],
                 ["replay", str(trace), "--timeout", "nan"], ["replay", str(trace), "--wait", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    with pytest.raises(SystemExit, match="GBPS a number > 0"):
        main(["simulate", str(trace), "--bandwidth", "nvme:hbm=-1"])
    assert main(["simulate", str(trace), "--events", str(events)]) == 2
    assert main(["gen-agent-trace", str(tmp_path), "--agents", "1", "--duration", "10"]) == 2
    assert main(["replay", str(trace), "--bytes-per-token", str(10 ** 11), "--wait", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "are not UTF-8 text" in err and "it is a folder" in err and "at most 1.00 GiB" in err
    assert "Traceback" not in err
