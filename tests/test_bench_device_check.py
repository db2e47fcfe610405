"""bench/device_check.py on this machine: every row of its matrix is measured (a row that raised
is printed as ``(stopped)``, which once hid calls of tier methods that had been renamed)."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_device_check_measures_every_row(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--skip-tests", "--dir",
                          str(tmp_path), "--total-mib", "8", "--block-mib", "1", "--reps", "1"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [ln.split("|")[1:-1] for ln in res.stdout.splitlines() if ln.startswith("| ") and "GB/s" not in ln]
    assert len(rows) >= 6, res.stdout                     # HBM (stand-in) both ways, NVMe both ways, bounces
    for path, ours, _limit, limit_rate, ratio, note in rows:
        assert "(stopped)" not in path, res.stdout
        if "n/a" in (ours.strip(), limit_rate.strip()):        # not measurable here: it says why
            assert note.strip(), (path, res.stdout)              # (a GPU machine without kvikio)
            continue
        assert float(ours) > 0 and float(limit_rate) > 0 and float(ratio) > 0, (path, note)
    assert not list(tmp_path.glob("device-check-*")), "the scratch folder is removed"


def test_a_terminated_device_check_reports_and_removes_its_files(tmp_path):
    """A ``timeout`` around the script (SIGTERM) still prints the table and exit 3, and the
    scratch folder (up to 2 GiB with the defaults) is removed."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "device_check.py"), "--skip-tests", "--dir",
                             str(tmp_path), "--total-mib", "4096", "--block-mib", "1", "--reps", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:                      # measuring starts after the "files:" line
        lines.append(line)
        if line.startswith("files:"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=600) == 3, out
    assert "| (stopped) |" in out and "SIGTERM" in out
    assert "device check: done" in out
    assert not list(tmp_path.glob("device-check-*")), "the scratch folder is removed"
