#!/usr/bin/env bash
# The project's test command (README "Set up"): installs what the tests need into venvs outside
# the repository, reusing them when their pinned requirements did not change, then runs every
# stage — even after one failed, so a red stage does not hide the others — prints a table of the
# stages' results, and fails when any stage failed.
#
#   bash ci/test.sh                 every stage: ruff, mypy, core (pytest with the NIXL fabric tests),
#                                   vllm, torch (the peer_hbm tier on CPU tensors, in the vLLM venv's
#                                   torch), sglang, lmcache (pof as an LMCache storage plugin, in
#                                   its own venv: ci/lmcache_venv.sh), docs (the site built with
#                                   `mkdocs build --strict`, and tests/docs: every `pof` command and
#                                   config key the docs show exists; its own venv: ci/docs_venv.sh)
#   POF_SKIP_ENGINES=1 ...          ruff, mypy, core and docs only (no multi-GB engine venvs)
#   POF_STAGES="core vllm" ...      only these stages (space- or comma-separated names from above)
#   bash ci/test.sh ARGS...         ARGS go to every pytest stage (e.g. -x, -k NAME)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT"

ALL_STAGES=(ruff mypy core vllm torch sglang lmcache docs)
if [[ -n "${POF_STAGES:-}" ]]; then
    read -r -a STAGES <<< "${POF_STAGES//,/ }"
elif [[ "${POF_SKIP_ENGINES:-0}" == "1" ]]; then
    STAGES=(ruff mypy core docs)
else
    STAGES=("${ALL_STAGES[@]}")
fi
if [[ ${#STAGES[@]} == 0 ]]; then
    echo "POF_STAGES: no stage named; allowed: ${ALL_STAGES[*]}" >&2
    exit 2
fi
for s in "${STAGES[@]}"; do
    if [[ " ${ALL_STAGES[*]} " != *" $s "* ]]; then
        echo "POF_STAGES: unknown stage '$s'; allowed: ${ALL_STAGES[*]}" >&2
        exit 2
    fi
done

wanted() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

RESULTS=()    # "stage|result|seconds", in the order run

record() {    # record STAGE RESULT SECONDS
    RESULTS+=("$1|$2|$3")
}

run_stage() {  # run_stage STAGE COMMAND...: runs it if the stage is wanted, records the outcome
    local stage="$1" t0 rc
    shift
    wanted "$stage" || return 0
    echo "== $stage: $*"
    t0=$SECONDS
    "$@"
    rc=$?
    if [[ $rc == 0 ]]; then
        record "$stage" passed $((SECONDS - t0))
    elif [[ $rc == 5 ]]; then    # pytest: nothing collected (a marked stage that tests nothing is broken)
        record "$stage" "FAILED (no tests collected)" $((SECONDS - t0))
    else
        record "$stage" "FAILED (exit $rc)" $((SECONDS - t0))
    fi
}

not_run() {    # not_run WHY STAGE...: wanted stages that cannot run count as failed
    local why="$1" s
    shift
    for s in "$@"; do
        if wanted "$s"; then record "$s" "FAILED ($why)" 0; fi
    done
}

venv() {       # venv SCRIPT: the venv's python (last line of the script's output), or nothing
    local out
    out="$(bash "$1" | tail -n 1)" || return 1
    [[ -x "$out" ]] || return 1
    echo "$out"
}

if wanted ruff || wanted mypy || wanted core; then
    if PY="$(venv ci/core_venv.sh)"; then
        BIN="$(dirname "$PY")"
        run_stage ruff "$BIN/ruff" check pof_connector tests ci examples
        run_stage mypy "$BIN/mypy"
        POF_REQUIRE_NIXL=1 run_stage core "$PY" -m pytest -m "not vllm and not sglang and not torch and not lmcache and not docs" "$@"
    else
        not_run "core venv build failed" ruff mypy core
    fi
fi

if wanted vllm || wanted torch || wanted sglang; then
    VPY="$(venv ci/vllm_venv.sh)" || VPY=""
    if [[ -n "$VPY" ]]; then
        # NIXL is installed there too (ci/vllm_venv.sh): the vLLM fabric tests must run, not skip.
        POF_REQUIRE_NIXL=1 run_stage vllm "$VPY" -m pytest -m vllm "$@"
        run_stage torch "$VPY" -m pytest -m torch "$@"
    else
        not_run "vLLM venv build failed" vllm torch
    fi
    if wanted sglang; then
        if [[ -z "$VPY" ]]; then
            not_run "vLLM venv build failed (cross-engine test)" sglang
        elif SPY="$(venv ci/sglang_venv.sh)"; then
            # The cross-engine test starts a vLLM server from the vLLM venv while it runs in SGLang's.
            POF_VLLM_PYTHON="$VPY" run_stage sglang "$SPY" -m pytest -m sglang -W ignore::UserWarning "$@"
        else
            not_run "SGLang venv build failed" sglang
        fi
    fi
fi

if wanted lmcache; then
    if LPY="$(venv ci/lmcache_venv.sh)"; then
        run_stage lmcache "$LPY" -m pytest -m lmcache "$@"
    else
        not_run "LMCache venv build failed" lmcache
    fi
fi

if wanted docs; then
    if DPY="$(venv ci/docs_venv.sh)"; then
        docs_stage() {   # the site, strictly (a broken link, anchor or page fails), then the docs checks
            local site rc
            site="$(mktemp -d)"
            # Not -q: a quiet build does not count warnings, and --strict then passes a broken link.
            NO_MKDOCS_2_WARNING=1 "$(dirname "$DPY")/mkdocs" build --strict --clean -f mkdocs.yml -d "$site"
            rc=$?
            rm -rf "$site"
            [[ $rc == 0 ]] || { echo "docs: mkdocs build --strict failed (exit $rc)"; return "$rc"; }
            "$DPY" -m pytest -m docs tests/docs "$@"
        }
        run_stage docs docs_stage "$@"
    else
        not_run "docs venv build failed" docs
    fi
fi

echo
echo "== summary"
failed=0
printf '%-8s %-50s %s\n' stage result seconds
for r in "${RESULTS[@]}"; do
    IFS='|' read -r stage result secs <<< "$r"
    printf '%-8s %-50s %s\n' "$stage" "$result" "$secs"
    [[ "$result" == passed ]] || failed=1
done
if [[ $failed == 0 ]]; then
    echo "== all stages passed"
else
    echo "== some stages FAILED (rerun one: POF_STAGES=NAME bash ci/test.sh)"
fi
exit $failed
