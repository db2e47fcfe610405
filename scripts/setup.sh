#!/usr/bin/env bash
# Create ./.venv and install kvstore with its test/benchmark extras (torch==2.13.0).
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.kvstore-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import kvstore" 2>/dev/null; then
  exit 0
fi
echo "setting up .venv (pip install -e '.[dev]') ..." >&2
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
