#!/usr/bin/env bash
# The main job on a fresh CPU machine, on the embedded index default: installs vLLM (CPU) and
# pof-connector into a venv outside the repository (reused when unchanged), builds a local model
# (reused), brings up two vLLM servers that share a KV pool, sends a shared-prefix workload and prints
# a table of what came from where and a line with B's TTFT from the pool vs A's recompute.
# The core-only demo (no vLLM) is examples/core/two_nodes.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/ci/vllm_venv.sh" | tail -n 1)"
exec "$PY" "$ROOT/examples/vllm/quickstart.py" "$@"
