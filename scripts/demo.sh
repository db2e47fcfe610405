#!/usr/bin/env bash
# The main job: start the daemon on the built-in default config (1 GiB host tier +
# 16 GiB NVMe tier under ./kvstore-data, emptied first so the run starts cold), replay
# the Mooncake conversation trace through it, print the report, stop the daemon.
#   scripts/demo.sh [TRACE] [replay options, e.g. --limit 2000 --bytes-per-token 32]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
trace=${1:-$repo/../shared/data/traces/mooncake_conversation_trace.jsonl}
shift || true
if [ ! -f "$trace" ]; then
  echo "trace not found: $trace" >&2
  echo "usage: scripts/demo.sh TRACE [replay options]" >&2
  echo "get the traces from the Mooncake repository (FAST25-release/traces/)" >&2
  exit 2
fi
trace=$(realpath -- "$trace")
cd "$repo"
bash scripts/setup.sh
. .venv/bin/activate
if [ -d kvstore-data ]; then
  echo "removing ./kvstore-data from an earlier run (the demo starts from an empty store)" >&2
  rm -rf kvstore-data
fi
mkdir -p kvstore-data
kvstore serve > kvstore-data/serve.log 2>&1 &
pid=$!
stop() {
  if kill -0 "$pid" 2>/dev/null; then
    echo "stopping the daemon: a graceful stop copies the blocks held only in memory to NVMe first" \
         "(progress in kvstore-data/serve.log)" >&2
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null || true
  fi
}
trap stop EXIT
kvstore stats --wait --timeout 60 >/dev/null 2>&1 || { cat kvstore-data/serve.log; exit 1; }
grep -v "^INFO\|^[0-9-]* [0-9:,]* INFO" kvstore-data/serve.log | head -n 4
kvstore replay "$trace" --json kvstore-data/replay.json "$@"
