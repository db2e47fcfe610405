#!/usr/bin/env bash
# The main job: start the daemon on the built-in default config (1 GiB host tier +
# 16 GiB NVMe tier under ./kvstore-data), replay the Mooncake conversation trace
# through it, print the report, stop the daemon.
#   scripts/demo.sh [TRACE] [extra replay args...]
set -euo pipefail
cd "$(dirname "$0")/.."
trace=${1:-../shared/data/traces/mooncake_conversation_trace.jsonl}
shift || true
if [ ! -f "$trace" ]; then
  echo "trace not found: $trace" >&2
  echo "get it from the Mooncake repository (FAST25-release/traces/) and pass its path" >&2
  exit 2
fi
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p kvstore-data
kvstore serve > kvstore-data/serve.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
kvstore stats --wait --timeout 60 >/dev/null 2>&1 || { cat kvstore-data/serve.log; exit 1; }
head -n 6 kvstore-data/serve.log
kvstore replay "$trace" --json kvstore-data/replay.json "$@"
