#!/usr/bin/env bash
# Build (or reuse) the venv of the docs stage: MkDocs + Material and pytest, pinned in
# ci/requirements-docs.txt, plus pof-connector from this checkout (the generated references import
# its config classes and its `pof` parsers).
# Prints the venv's python as the last line of stdout; progress goes to stderr.
#
# Reuse: dependencies are installed again only when ci/requirements-docs.txt, pyproject.toml or this
# script changed (a stamp in the venv holds their sha256). The editable install of *this* checkout
# is redone every time (seconds).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${POF_VENV_ROOT:-$HOME/.cache/pof/venvs}/docs"
REQ="$HERE/requirements-docs.txt"
STAMP="$VENV/.pof-deps.sha256"
log() { printf '[docs_venv] %s\n' "$*" >&2; }
quiet_pip() {
    "$VENV/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}
want="$(cat "$REQ" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    log "creating $VENV"
    rm -rf "$VENV"
    "${POF_PYTHON:-python3}" -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]]; then
    log "installing dependencies (requirements-docs.txt or pyproject.toml changed, or new venv)"
    quiet_pip install --upgrade pip setuptools wheel
    quiet_pip install -r "$REQ"
    quiet_pip install -e "$ROOT"
    echo "$want" > "$STAMP"
fi
quiet_pip install --no-deps --no-build-isolation -e "$ROOT"
log "ready: $VENV"
echo "$VENV/bin/python"
