#!/usr/bin/env bash
# Build (or reuse) the venv that runs LMCache 0.5.6 on the CPU, for pof's LMCache storage plugin
# (pof_connector/adapters/lmcache.py, tests marked `lmcache`); see ci/engine_venv.sh.
#
#   PY=$(bash ci/lmcache_venv.sh | tail -n 1)
#
# Why a venv of its own: lmcache pins numpy<=2.2.6 and declares CUDA-only packages; the vLLM and
# SGLang venvs must not move. Why lmcache is installed with --no-deps: its CUDA-only requirements
# (cupy-cuda13x, cuda-python, cufile-python) are not used on a CPU host (docs/engines/lmcache-0.5.6-storage-plugin.md);
# every other requirement of lmcache is in ci/requirements-lmcache.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ci/engine_venv.sh
source "$HERE/engine_venv.sh"

NAME=lmcache
REQ="$HERE/requirements-lmcache.txt"
LMCACHE_PIN="lmcache==0.5.6"
# Held through every install (a constraints file, one pin a line): the CPU torch, and lmcache's
# numpy ceiling (pip does not see the requirements of a --no-deps install when it resolves later ones).
TORCH_PIN=$'torch==2.13.0\nnumpy==2.2.6'
UNWANTED=()
IMPORT_CHECK='
import numpy, torch
print(f"  torch {torch.__version__}, numpy {numpy.__version__}")
'
built="$(mktemp)"
trap 'rm -f "$built"' EXIT
build_engine_venv "${BASH_SOURCE[0]}" >"$built"
PY="$(tail -n 1 "$built")"

# lmcache itself, without its CUDA-only requirements: an incremental step, so it runs again only
# when the pinned version does not import.
install_no_deps "$PY" lmcache_venv "$LMCACHE_PIN" \
    "from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface; import lmcache.v1.cache_engine"
echo "$PY"
