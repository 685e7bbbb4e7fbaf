#!/usr/bin/env bash
# The project's test command (README "Set up"): installs what the tests need into venvs outside
# the repository, reusing them when their pinned requirements did not change, then runs
# ruff, mypy and pytest. Fails when anything fails.
#
#   bash ci/test.sh            everything: core tests, then the engine tests (marks vllm, sglang, and
#                              torch: the peer_hbm tier on CPU tensors, in the vLLM venv's torch)
#   POF_SKIP_ENGINES=1 ...     core tests only (no multi-GB engine venvs)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT"

PY="$(bash ci/core_venv.sh | tail -n 1)"
BIN="$(dirname "$PY")"

echo "== ruff"
"$BIN/ruff" check pof_connector tiers adapters tests ci examples
echo "== mypy"
"$BIN/mypy"

echo "== pytest (core, with the NIXL fabric tests)"
POF_REQUIRE_NIXL=1 "$PY" -m pytest -m "not vllm and not sglang and not torch" "$@"

run_marked() {   # run_marked MARK PYTHON [ARGS]: pytest exit 5 (nothing collected) fails here too
    local mark="$1" py="$2"
    echo "== pytest -m $mark ($py)"
    "$py" -m pytest -m "$mark" "${@:3}"
}

if [[ "${POF_SKIP_ENGINES:-0}" != "1" ]]; then
    VPY="$(bash ci/vllm_venv.sh | tail -n 1)"
    # NIXL is installed there too (ci/vllm_venv.sh): the vLLM fabric tests must run, not skip.
    POF_REQUIRE_NIXL=1 run_marked vllm "$VPY" "$@"
    run_marked torch "$VPY" "$@"
    SPY="$(bash ci/sglang_venv.sh | tail -n 1)"
    # The cross-engine test starts a vLLM server from the vLLM venv while it runs in SGLang's.
    POF_VLLM_PYTHON="$VPY" run_marked sglang "$SPY" -W ignore::UserWarning "$@"
fi
echo "== all tests passed"
