"""Command-line values checked before the work: every output path (``simulate --json`` and
``--plot`` crashed with FileNotFoundError after the whole run), empty paths and addresses
(``serve --listen ""`` served on the default socket; ``simulate --events ""`` read the
default events file), and ``explain`` on a prompt shorter than one block."""

from __future__ import annotations

import json

import pytest

from kvstore.tools import serve_cmd, simulate_cli
from kvstore.tools.cli import main
from kvstore.tools.cliargs import output_error

TRACE_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(TRACE_LINE)
    return p


@pytest.fixture
def no_simulation(monkeypatch):
    """Fail the test if a simulation runs (the refusal must come before the work)."""
    def refuse(*args, **kwargs):
        raise AssertionError("simulated before the outputs were checked")
    monkeypatch.setattr(simulate_cli, "run", refuse)


@pytest.mark.parametrize("flag, name", [("--json", "x.json"), ("--plot", "x.png")])
def test_simulate_checks_its_outputs_before_the_runs(tmp_path, trace, capsys, no_simulation, flag, name):
    missing = tmp_path / "nonexistent" / name
    assert main(["simulate", str(trace), flag, str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"kvstore simulate: cannot write {flag} {missing}: No such file or directory" in err
    assert main(["simulate", str(trace), flag, str(tmp_path)]) == 2
    assert "it is a folder" in capsys.readouterr().err
    assert not missing.parent.exists()


def test_simulate_writes_both_outputs_when_they_can_be_written(tmp_path, trace, monkeypatch):
    checked = []
    monkeypatch.setattr(simulate_cli, "output_error", lambda out: checked.append(out))   # None: writable
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["simulate", str(trace), "--json", str(out), "--plot", str(png), "--no-opt"]) == 0
    assert checked == [str(out), str(png)]                         # both checked before the run
    assert json.loads(out.read_text())[0]["hit_rate"] == 0.0      # two blocks, never seen before
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_output_check_leaves_no_file_and_keeps_an_existing_one(tmp_path):
    new = tmp_path / "new.json"
    assert output_error(new) is None and not new.exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    assert output_error(old) is None and old.read_text() == "kept"
    assert output_error(tmp_path / "no" / "x.json") == "No such file or directory"


@pytest.mark.parametrize("argv, flag", [
    (["replay", "T", "--target", ""], "--target"),
    (["replay", "T", "--json", ""], "--json"),
    (["stats", "--target", ""], "--target"),
    (["stats", "--target", "unix:"], "--target"),
    (["simulate", "T", "--events", ""], "--events"),
    (["simulate", "T", "--config", ""], "--config"),
    (["simulate", "T", "--json", ""], "--json"),
    (["simulate", "T", "--plot", ""], "--plot"),
    (["explain", "P", "--target", ""], "--target"),
    (["explain", "P", "P", "--namespace", ""], "--namespace"),
    (["gen-agent-trace", ""], "out"),
    (["agent-demo", "--target", ""], "--target"),
    (["agent-demo", "--checkpoint", ""], "--checkpoint"),
])
def test_empty_paths_and_addresses_are_refused_not_taken_as_the_default(trace, capsys, argv, flag):
    argv = [str(trace) if a in ("T", "P") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and ("names no file" in err or "names no address or socket path" in err)


@pytest.mark.parametrize("listen", ["", "unix:", "  "])
def test_serve_refuses_an_empty_listen_flag_as_it_refuses_an_empty_listen_key(monkeypatch, capsys, listen):
    def refuse(cfg):
        raise AssertionError(f"a daemon was started on {cfg.server.listen!r}")
    monkeypatch.setattr(serve_cmd, "start_server", refuse)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--listen", listen])
    assert e.value.code == 2
    assert f"argument --listen: {listen!r} names no address or socket path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--config", ""])


# --------------------------------------------------------------------------- explain


def _namespace_file(tmp_path):
    ns = tmp_path / "ns.json"
    ns.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "layout": "l", "block_tokens": 16}))
    return ns


def test_explain_a_prompt_shorter_than_a_block_says_there_is_nothing_to_look_up(tmp_path, capsys):
    short = tmp_path / "short.json"
    short.write_text(json.dumps(list(range(5))))
    # no daemon at this address: a prompt without a full block must not need one
    assert main(["explain", str(short), "--namespace", str(_namespace_file(tmp_path)),
                 "--target", f"unix:{tmp_path}/none.sock"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{short} holds no full block (5 tokens, blocks of 16): nothing of it is stored")
    assert "all 0 blocks" not in out


def test_explain_two_prompts_compares_when_one_has_no_full_block(tmp_path, capsys):
    ns = _namespace_file(tmp_path)
    long, short = tmp_path / "long.json", tmp_path / "short.json"
    long.write_text(json.dumps(list(range(40))))
    short.write_text(json.dumps(list(range(10))))
    assert main(["explain", str(long), str(short), "--namespace", str(ns)]) == 0
    assert "block 0 exists in only one prompt" in capsys.readouterr().out   # the real answer, no shortcut
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": []}))
    assert main(["explain", str(keys), "--target", f"unix:{tmp_path}/none.sock"]) == 0
    assert capsys.readouterr().out.startswith(f"{keys} holds no block key: nothing to look up")
