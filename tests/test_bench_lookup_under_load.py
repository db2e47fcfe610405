"""bench/lookup_under_load.py runs end to end at a size that takes seconds (a real daemon,
its NVMe tier filled, a prober process, puts meanwhile) and prints both phases' latencies."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_lookup_under_load_bench_measures_both_phases(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "lookup_under_load.py"), "--seconds", "1",
                          "--total", "8MiB", "--nvme", "24MiB", "--fsync", "--dir", str(tmp_path / "scratch")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines() if ln.split()[:1] in (["idle"], ["under"])}
    assert set(rows) == {"idle", "under"}, res.stdout
    assert int(rows["idle"][0]) > 0 and all(float(x) > 0 for x in rows["idle"][1:]), res.stdout
    assert int(rows["under"][1]) > 0 and all(float(x) > 0 for x in rows["under"][2:]), res.stdout
    assert "NVMe fsync on" in res.stdout and "puts meanwhile: " in res.stdout
    assert not any(p.name.startswith("nvme-") for p in (tmp_path / "scratch").iterdir())   # its data removed
