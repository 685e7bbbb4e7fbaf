# Build (or reuse) one engine venv; sourced by ci/vllm_venv.sh and ci/sglang_venv.sh, which set:
#
#   NAME          venv name under $POF_VENV_ROOT (default $HOME/.cache/pof/venvs)
#   REQ           the pinned requirements file
#   TORCH_PIN     e.g. torch==2.13.0; held by a constraints file through every install
#   UNWANTED      packages to uninstall after installing (an array; may be empty)
#   IMPORT_CHECK  Python code run once after a (re)install; it fails the build when it fails
#
# then call build_engine_venv "$CALLER_SCRIPT". Progress goes to stderr; the venv's python is
# the last line of stdout.
#
# Reuse: the venv holds a stamp with the sha256 of the requirements, the caller and this file;
# when it matches nothing is installed, otherwise `pip install -r` runs again in the existing venv
# (pip skips what is satisfied). POF_VENV_RECREATE=1 rebuilds from scratch. The editable install of
# the repository is stamped separately with the sha256 of pyproject.toml and the repository's path
# (CI clones main to a fresh path each time). POF_PYTHON picks the interpreter that creates the venv.

build_engine_venv() {
    local caller="$1"
    local here root venv stamp editable_stamp want start
    here="$(cd "$(dirname "$caller")" && pwd)"
    root="$(dirname "$here")"
    venv="${POF_VENV_ROOT:-$HOME/.cache/pof/venvs}/$NAME"
    stamp="$venv/.pof-requirements.sha256"
    editable_stamp="$venv/.pof-editable.sha256"
    want="$(cat "$REQ" "$caller" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
    start=$SECONDS

    _log() { printf '[%s_venv] %s\n' "$NAME" "$*" >&2; }
    # pip warns once per package about the missing local index dirs in the global pip config: drop that noise.
    _pip() {
        "$venv/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 \
            | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    }
    local cons
    cons="$(mktemp)"
    echo "$TORCH_PIN" >"$cons"

    if [[ "${POF_VENV_RECREATE:-0}" == "1" && -d "$venv" ]]; then
        _log "POF_VENV_RECREATE=1: removing $venv"
        rm -rf "$venv"
    fi
    if [[ -x "$venv/bin/python" ]] && ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
        _log "venv at $venv is broken (its interpreter does not run): rebuilding"
        rm -rf "$venv"
    fi

    if [[ "$(cat "$stamp" 2>/dev/null || true)" == "$want" ]]; then
        _log "venv up to date: $venv"
    else
        if [[ ! -x "$venv/bin/python" ]]; then
            _log "creating venv $venv with $("${POF_PYTHON:-python3}" --version 2>&1)"
            mkdir -p "$(dirname "$venv")"
            "${POF_PYTHON:-python3}" -m venv "$venv"
        else
            _log "requirements changed: updating $venv"
        fi
        rm -f "$stamp" "$editable_stamp"
        _log "pip install -r $(basename "$REQ") (the first time takes minutes and gigabytes)"
        _pip install -c "$cons" -r "$REQ"
        if [[ ${#UNWANTED[@]} -gt 0 ]]; then
            _log "removing ${UNWANTED[*]}"
            "$venv/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 2>/dev/null || true
        fi
        _log "checking imports"
        "$venv/bin/python" -W ignore::UserWarning -c "$IMPORT_CHECK" >&2
        echo "$want" >"$stamp"
        _log "venv ready after $((SECONDS - start)) s"
    fi

    if [[ -f "$root/pyproject.toml" ]]; then
        local ewant had_egg_info
        ewant="$(sha256sum <"$root/pyproject.toml" | cut -d' ' -f1)|$root"
        if [[ "$(cat "$editable_stamp" 2>/dev/null || true)" == "$ewant" ]]; then
            _log "editable install of $root up to date"
        else
            _log "pip install -e $root[test] (${TORCH_PIN} held)"
            # setuptools writes <name>.egg-info into the source tree while building the editable
            # wheel; remove it afterwards unless it was there before (the install does not need it).
            had_egg_info="$(compgen -G "$root/*.egg-info" || true)"
            _pip install -c "$cons" -e "$root[test]"
            if [[ -z "$had_egg_info" ]]; then
                for d in "$root"/*.egg-info; do
                    if [[ -d "$d" ]]; then rm -rf "$d"; fi
                done
            fi
            if [[ ${#UNWANTED[@]} -gt 0 ]]; then   # in case the project's dependencies dragged them back in
                "$venv/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 2>/dev/null || true
            fi
            echo "$ewant" >"$editable_stamp"
            _log "editable install done"
        fi
    fi
    rm -f "$cons"
    echo "$venv/bin/python"
}

# install_no_deps PY TAG PIN IMPORT: `pip install --no-deps PIN` (name==version) into PY unless the
# python statement IMPORT already runs there with that version installed. An incremental step after
# build_engine_venv, for a package whose declared requirements must not move the venv's pins (NIXL's
# bare `torch`, LMCache's CUDA-only packages).
install_no_deps() {
    local py=$1 tag=$2 pin=$3 import=$4
    if "$py" - "${pin%%==*}" "${pin#*==}" >/dev/null 2>&1 <<PYCHECK
import importlib.metadata, sys
$import
sys.exit(importlib.metadata.version(sys.argv[1]) != sys.argv[2])
PYCHECK
    then
        echo "[$tag] $pin present" >&2
    else
        echo "[$tag] pip install --no-deps $pin" >&2
        "$py" -m pip install --no-deps --quiet --disable-pip-version-check "$pin" 2>&1 \
            | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
        "$py" -c "$import" >&2
    fi
}
