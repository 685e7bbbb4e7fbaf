#!/usr/bin/env bash
# The main job on a fresh CPU machine, on the embedded index default: installs pof-connector into
# a venv outside the repository (reused when unchanged) and runs two pool nodes that share a prefix.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/ci/core_venv.sh" | tail -n 1)"
exec "$PY" "$ROOT/examples/core/two_nodes.py" "$@"
