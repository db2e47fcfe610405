"""bench/forward_hooks.py runs its three steps end to end (``--device cpu``: the same hooks,
store and checks as on a GPU, at a size that takes seconds) and prints a figure for each."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_forward_hooks_bench_measures_each_step():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "forward_hooks.py"), "--device", "cpu", "--layers",
                          "3", "--tokens", "64", "--hidden", "128", "--kv-heads", "2", "--head-dim", "16",
                          "--repeats", "2"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {}
    for ln in res.stdout.splitlines()[2:]:
        cells = ln.replace(",", " ").split()
        if cells and cells[0] == "+":
            cells = ["+" + cells[1]] + cells[2:]
        if cells:
            rows[cells[0]] = cells[1:3]                      # ms, ratio to the forward alone
            assert len(cells) == 7, ln                       # and the four parts on the forward's thread
    assert set(rows) == {"forward", "+save", "+load"}, res.stdout
    assert all(float(ms) > 0 and float(ratio) > 0 for ms, ratio in rows.values()), res.stdout
    assert float(rows["forward"][1]) == 1.0
