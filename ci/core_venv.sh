#!/usr/bin/env bash
# Build (or reuse) the venv for the core tests: pof-connector[test], editable from this checkout,
# plus NIXL (installed --no-deps) for the fabric tests.
# Prints the venv's python as the last line of stdout; progress goes to stderr.
#
# Reuse: dependencies are installed again only when pyproject.toml or this script changed (a
# stamp in the venv holds their sha256). The editable install of *this* checkout is redone every
# time (seconds): CI clones main to a fresh path.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${POF_VENV_ROOT:-$HOME/.cache/pof/venvs}/core"
STAMP="$VENV/.pof-deps.sha256"
log() { printf '[core_venv] %s\n' "$*" >&2; }
quiet_pip() {
    "$VENV/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}
want="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    log "creating $VENV"
    rm -rf "$VENV"
    "${POF_PYTHON:-python3}" -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]]; then
    log "installing dependencies (pyproject.toml changed or new venv)"
    quiet_pip install --upgrade pip setuptools wheel
    quiet_pip install -e "$ROOT[test]"
    # NIXL for the fabric tests, without its declared torch (a 5.9 GB CUDA stack the core never
    # imports); the pin is the one of pyproject.toml's `nixl` extra.
    nixl_req="$(grep -o '"nixl-cu13==[^"]*"' "$ROOT/pyproject.toml" | head -n 1 | tr -d '"')"
    [[ -n "$nixl_req" ]] || { log "no nixl-cu13 pin in pyproject.toml"; exit 1; }
    quiet_pip install --no-deps "$nixl_req"
    echo "$want" > "$STAMP"
fi
quiet_pip install --no-deps --no-build-isolation -e "$ROOT"
log "ready: $VENV"
echo "$VENV/bin/python"
