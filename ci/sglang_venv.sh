#!/usr/bin/env bash
# Build (or reuse) the venv that holds a real SGLang for the HiCache storage-backend tests.
#
#   ci/sglang_venv.sh          -> prints progress on stderr, the venv's python as the last line of stdout
#
# Env:
#   POF_VENV_ROOT      where venvs live (default: $HOME/.cache/pof/venvs); this one is $POF_VENV_ROOT/sglang
#   POF_PYTHON         interpreter that creates the venv (default: python3)
#   POF_VENV_RECREATE  1 = delete the venv and build it from scratch
#
# SGLang does not serve on a CPU-only machine (its kernels want libcuda), but `import sglang` works and
# so do the classes a storage backend meets: StorageBackendFactory, HiCacheStorageConfig and the host
# KV pools (MHA/MLA, every layout, pin_memory=False). The tests drive those.
#
# torch: sglang 0.5.23 pins torch==2.14.1 exactly. pip's global cap here
# (/etc/xdg/pip/constraints.txt: torch<=2.14.1) admits it, so there is no conflict, but the only
# 2.14.1 reachable is PyPI's CUDA 13 build (with nvidia-*, triton, cuda-*: first build 5-9 min on
# 2 cores, ~11 GB). The CPU wheel on local disk (/opt/wheels, torch 2.13.0+cpu) does not satisfy
# sglang's pin. The CUDA build imports and computes on the CPU without a driver. Should the cap ever
# drop below 2.14.1, this install fails with ResolutionImpossible: raise the cap (or unset it for
# this venv) rather than loosen the pin.
#
# Reuse: the venv holds a stamp with the sha256 of requirements-sglang.txt + this script. When it
# matches, nothing is installed. When it does not, `pip install -r` runs again in the existing venv
# (pip skips what is already satisfied). The editable install of the repo (if it has a
# pyproject.toml) is stamped separately with the sha256 of pyproject.toml and the repo's path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
REQ="$HERE/requirements-sglang.txt"
VENV="${POF_VENV_ROOT:-$HOME/.cache/pof/venvs}/sglang"
PY_BOOT="${POF_PYTHON:-python3}"
STAMP="$VENV/.pof-requirements.sha256"
EDITABLE_STAMP="$VENV/.pof-editable.sha256"
# Must equal sglang's own pin (see above); held by a constraints file so that the editable install
# of the repo can never move it.
TORCH_PIN="torch==2.14.1"
# Unlike the vLLM venv, nothing is uninstalled afterwards: torchvision 0.29.1 here is the CUDA build
# that matches this torch, so `import transformers` works (pip check is clean as well).

log() { printf '[sglang_venv] %s\n' "$*" >&2; }

hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

# pip warns once per package about the missing local index dirs in the global pip config: drop that noise.
quiet_pip() {
    "$VENV/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

# A constraints file that holds torch at sglang's pin whatever else gets installed.
cons=""
make_constraints() {
    if [[ -z "$cons" ]]; then
        cons="$(mktemp)"
        trap 'rm -f "$cons"' EXIT
        echo "$TORCH_PIN" >"$cons"
    fi
}

want="$(hash_of "$REQ" "${BASH_SOURCE[0]}")"
start=$SECONDS

if [[ "${POF_VENV_RECREATE:-0}" == "1" && -d "$VENV" ]]; then
    log "POF_VENV_RECREATE=1: removing $VENV"
    rm -rf "$VENV"
fi

if [[ -x "$VENV/bin/python" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    log "venv at $VENV is broken (its interpreter does not run): rebuilding"
    rm -rf "$VENV"
fi

have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$have" == "$want" ]]; then
    log "venv up to date: $VENV"
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV with $($PY_BOOT --version 2>&1)"
        mkdir -p "$(dirname "$VENV")"
        "$PY_BOOT" -m venv "$VENV"
    else
        log "requirements changed: updating $VENV"
    fi
    rm -f "$STAMP" "$EDITABLE_STAMP"
    make_constraints
    log "pip install -r $(basename "$REQ") (first time: 5-9 min, ~11 GB: CUDA torch)"
    quiet_pip install -c "$cons" -r "$REQ"
    log "checking imports and a host KV pool"
    "$VENV/bin/python" -W ignore::UserWarning - >&2 <<'PYEOF'
import importlib.metadata as md

import torch

import sglang  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401

dev = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                       device="cpu", enable_memory_saver=False)
with host_memory_budget_scope(1 << 30):
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 4, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer)
assert host.page_size == 4 and host.layer_num == 3
print(f"  sglang {md.version('sglang')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}, host pool {tuple(host.kv_buffer.shape)} ok")
PYEOF
    echo "$want" >"$STAMP"
    log "venv ready after $((SECONDS - start)) s"
fi

if [[ -f "$ROOT/pyproject.toml" ]]; then
    ewant="$(hash_of "$ROOT/pyproject.toml")|$ROOT"
    if [[ "$(cat "$EDITABLE_STAMP" 2>/dev/null || true)" == "$ewant" ]]; then
        log "editable install of $ROOT up to date"
    else
        make_constraints
        log "pip install -e $ROOT[test] (torch held at ${TORCH_PIN#torch==})"
        # setuptools writes <name>.egg-info into the source tree while building the editable
        # wheel; remove it afterwards unless it was there before (the install does not need it).
        had_egg_info="$(compgen -G "$ROOT/*.egg-info" || true)"
        quiet_pip install -c "$cons" -e "$ROOT[test]"
        if [[ -z "$had_egg_info" ]]; then
            for d in "$ROOT"/*.egg-info; do
                if [[ -d "$d" ]]; then rm -rf "$d"; fi
            done
        fi
        echo "$ewant" >"$EDITABLE_STAMP"
        log "editable install done"
    fi
fi

echo "$VENV/bin/python"
