"""Review fixes of the CLI: a size conflict during ``replay`` is a counted put failure,
not the end of the replay; ``explain`` answers for two prompts when only one has a full
block; bad plot formats, huge numbers, empty paths and negative windows are refused up
front (exit 2, one line); ``serve`` into a closed stdout still stops its daemon."""

from __future__ import annotations

import json

from kvstore.client.client import KVStoreClient
from kvstore.tools import replay as replay_mod
from kvstore.tools.cli import main


def _trace(tmp_path, *requests):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                         for t, (n, ids) in enumerate(requests)))
    return p


def test_a_size_conflict_is_a_counted_put_failure_and_the_replay_goes_on(tmp_path, daemon, capsys):
    trace = _trace(tmp_path, (1024, [1, 2]), (1024, [3, 4]))
    block_bytes = 512 * 256
    with KVStoreClient(daemon.address) as c:
        c.put([(replay_mod.trace_key(2, block_bytes), b"x" * 1000)])
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--target", daemon.address, "--bytes-per-token", "256", "--quiet",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "STOPPED EARLY" not in captured.out
    rep = json.loads(out.read_text())
    assert rep["requests"] == 2 and rep["error"] == ""
    assert rep["blocks_put"] == 3
    assert rep["put_failures"] == 1
    assert rep["put_failure_reasons"] == {replay_mod.SIZE_CONFLICT: 1}


def _prompt(path, tokens, model):
    ns = {"model": model, "dtype": "bfloat16", "layout": "l", "block_tokens": 4}
    path.write_text(json.dumps({"tokens": tokens, "namespace": ns}))
    return str(path)


def test_explain_compares_when_only_one_prompt_has_a_full_block(tmp_path, capsys):
    short = _prompt(tmp_path / "a_short.json", [1, 2, 3], "m")
    other_ns = _prompt(tmp_path / "b_long.json", list(range(9)), "m2")
    same_ns = _prompt(tmp_path / "b_same.json", [1, 2, 3, 4, 5], "m")
    assert main(["explain", short, other_ns]) == 0
    out = capsys.readouterr().out
    assert "namespace field 'model' differs" in out and "no full block" not in out
    assert main(["explain", same_ns, short]) == 0
    out = capsys.readouterr().out
    assert "block 0 exists in only one prompt" in out and "no full block" not in out
    assert main(["explain", short, short]) == 0
    assert "holds no full block" in capsys.readouterr().out


def test_explain_refuses_a_negative_window(tmp_path, capsys):
    a = _prompt(tmp_path / "a.json", [1, 2, 3, 4], "m")
    b = _prompt(tmp_path / "b.json", [1, 2, 3, 5], "m")
    try:
        main(["explain", a, b, "--window", "-5"])
    except SystemExit as e:
        assert e.code == 2
    assert "--window: must be >= 0" in capsys.readouterr().err


def test_simulate_refuses_a_plot_format_matplotlib_cannot_write_before_the_runs(tmp_path, capsys, monkeypatch):
    from kvstore.tools import simulate_cli

    monkeypatch.setattr(simulate_cli, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    trace = _trace(tmp_path, (1024, [1, 2]))
    assert main(["simulate", str(trace), "--plot", str(tmp_path / "p.txt")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib does not write .txt files" in err and ".png" in err
    assert not (tmp_path / "p.txt").exists()


def test_serve_into_a_closed_stdout_keeps_serving_and_stops_gracefully(tmp_path):
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    from support.daemon import ROOT, child_env, short_socket_dir

    sock_dir = short_socket_dir()
    sock = f"unix:{sock_dir}/kvstore.sock"
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[server]\nlisten = "{sock}"\n[tiers.host]\ncapacity = "4MiB"\n')
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config", str(cfg)],
                            stdout=w, stderr=subprocess.PIPE, cwd=ROOT, env=child_env(), text=True)
    os.close(w)
    try:
        with KVStoreClient(sock) as c:
            c.wait_ready(timeout=120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 0, err
    assert "stdout is closed" in err            # stderr is kept
    assert not pathlib.Path(sock_dir, "kvstore.sock").exists()


def test_huge_numbers_and_empty_paths_are_refused_with_one_line(tmp_path, capsys):
    import pytest

    trace = _trace(tmp_path, (1024, [1, 2]))
    for argv, flag in ((["replay", str(trace), "--wait", "1e308"], "--wait"),
                       (["replay", str(trace), "--timeout", "1e10"], "--timeout"),
                       (["stats", "--wait", "--timeout", "1e308"], "--timeout"),
                       (["simulate", str(trace), "--block-bytes", "99999999999999999999999"], "--block-bytes"),
                       (["repair-index", ""], "path")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert f"argument {flag}:" in capsys.readouterr().err
    assert main(["simulate", str(trace), "--hints", "realistic:sigma=1e308"]) == 2
    assert "sigma must be a number in [0, 10]" in capsys.readouterr().err


def test_a_tools_file_with_a_huge_duration_is_refused():
    import pytest

    from kvstore.tools.agent_trace import Tool

    with pytest.raises(ValueError, match="duration_median_s must be a finite number > 0 and <= 604800"):
        Tool("t", 1e308, 1.0, 10, 1.0, 1.0)
