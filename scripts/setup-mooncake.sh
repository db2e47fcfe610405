#!/usr/bin/env bash
# Install what the Mooncake remote tier ([tiers.remote] kind = "mooncake") needs:
#   - the system library libibverbs1 (the wheel links libibverbs.so.1 even for TCP), via apt
#     when it is usable (root, or sudo without a password);
#   - the pinned Mooncake wheel into a virtual environment (default: ./.venv);
# then checks that the client loads and prints how to start a master.
#
#   scripts/setup-mooncake.sh [VENV]
#
# Exit status: 0 when the Mooncake client loads in VENV, 1 otherwise (the reason is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"

have_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }

apt_install() {
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; else return 1; fi
  fi
  command -v apt-get >/dev/null || return 1
  $sudo apt-get install -y -q "$@" >&2 || { $sudo apt-get update -q >&2 && $sudo apt-get install -y -q "$@" >&2; }
}

missing=()
have_lib libibverbs.so.1 || missing+=(libibverbs1)
have_lib libnuma.so.1 || missing+=(libnuma1)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} ..." >&2
  apt_install "${missing[@]}" || echo "warning: could not install ${missing[*]} (no usable apt-get): install them" \
    "with the system's package manager (rdma-core provides libibverbs elsewhere)" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "no virtual environment at $VENV (run scripts/setup.sh first, or pass one)" >&2
  exit 1
fi
"$VENV/bin/python" -m pip install -q "$WHEEL" >&2

if ! "$VENV/bin/python" -c '
import sys
from tiers.mooncake.client import mooncake_missing
reason = mooncake_missing()
print("Mooncake client: " + (reason or "ok"), file=sys.stderr)
sys.exit(1 if reason else 0)'; then
  exit 1
fi

cat <<MSG
Start a master (metadata server included) on this machine, e.g. in its own terminal or as a service:

  $VENV/bin/mooncake_master -rpc_address 127.0.0.1 -rpc_port 50051 \\
      -enable_http_metadata_server=true -http_metadata_server_host 127.0.0.1 -http_metadata_server_port 8080 \\
      -metrics_host 127.0.0.1 -metrics_port 9003 -default_kv_lease_ttl 5000

(-default_kv_lease_ttl in ms: keep it seconds, not 100 ms, or large batch gets fail with LEASE_EXPIRED.
For other nodes, bind -rpc_address to an address they reach; the HTTP metadata server listens on all
addresses whatever its host flag.) Or, for a throwaway loopback master on free ports:

  $VENV/bin/python -m tiers.mooncake.local_cluster master

Then give each daemon:

  [tiers.remote]
  kind = "mooncake"
  master = "127.0.0.1:50051"
  metadata_server = "http://127.0.0.1:8080/metadata"
MSG
