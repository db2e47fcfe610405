"""bench/throughput.py: its limits do the work they name (a file per block written over a
kept file and renamed into place; raw gRPC with one copy per block on each side), and the
whole bench runs end to end at a size that takes seconds."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import throughput  # noqa: E402


def test_block_files_rewrite_every_block_and_rename_it_into_place(tmp_path):
    size, count = 10_000, 7                       # not a multiple of 4 KiB: written page-aligned
    files = throughput.BlockFiles(tmp_path, size, count)
    try:
        first, second = files.names
        assert sorted(p.name for p in first.iterdir()) == [f"{i:08x}" for i in range(count)]
        for r in range(3):
            files.write()
            into, left = (second, first) if r % 2 == 0 else (first, second)
            assert sorted(p.name for p in into.iterdir()) == [f"{i:08x}" for i in range(count)]
            assert list(left.iterdir()) == []
            for p in into.iterdir():
                assert p.read_bytes() == b"\x02" * files.aligned
    finally:
        files.close()
    assert not (tmp_path / "block-files").exists()


@pytest.fixture
def echo(tmp_path):
    sock = tmp_path / "echo.sock"
    proc, _ = throughput.start([sys.executable, "-c", throughput._ECHO_SERVER, f"unix:{sock}"], "ready")
    yield f"unix:{sock}"
    proc.terminate()
    proc.wait(timeout=30)


def test_raw_grpc_with_copies_moves_every_block(echo):
    size, count = 3000, 5
    put, get, put_copies, get_copies, ch = throughput.echo_calls(echo, size, count)
    try:
        put()
        get()
        put_copies()                               # asserts the server counted every byte
        get_copies.out[:] = 0
        get_copies()
        for i in range(count):
            assert bytes(get_copies.out[i]) == bytes([i % 251 + 1]) * size
    finally:
        ch.close()


def test_throughput_bench_prints_every_limit_and_ratio(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--sizes", "64KiB",
                          "--total", "1MiB", "--rounds", "1", "--batch-latency", "5",
                          "--paths", "gRPC unix,NVMe zero-copy", "--dir", str(tmp_path / "scratch")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    ceiling = [ln.split() for ln in lines[lines.index(next(ln for ln in lines if "file/blk" in ln)) + 1:]][:2]
    assert [row[:2] for row in ceiling] == [["64.00", "KiB"], ["128x32.00", "KiB"]], res.stdout
    assert all(float(x) > 0 for row in ceiling for x in row[2:]), res.stdout
    assert sum("x raw gRPC with the copies" in ln for ln in lines) == 2, res.stdout
    assert sum("x a file per block" in ln for ln in lines) == 2, res.stdout
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())
