#!/usr/bin/env bash
# Start a stock vLLM OpenAI server with the pool.
#
#   examples/vllm/serve.sh MODEL_DIR PORT CONFIG.json [NODE_ID] [extra vLLM args...]
#
# CONFIG.json is a --kv-transfer-config (see pof-cpu-dram.json, pof-shared-cxl.json); NODE_ID, when
# given, replaces its kv_connector_extra_config.node_id so several servers can share one file.
# Run it with the Python that has vLLM (e.g. PYTHON=$(bash ci/vllm_venv.sh | tail -1)).
set -euo pipefail
MODEL="$1"; PORT="$2"; CONFIG="$3"; NODE="${4:-}"; shift 3; [[ $# -gt 0 ]] && shift
PY="${PYTHON:-python3}"
KV="$("$PY" - "$CONFIG" "$NODE" <<'PYEOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
if sys.argv[2]:
    cfg["kv_connector_extra_config"]["node_id"] = sys.argv[2]
print(json.dumps(cfg))
PYEOF
)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# vLLM's server module (`vllm serve` fails on the CPU build; -m vllm.entrypoints.openai.api_server is deprecated).
exec "$PY" -m vllm.entrypoints.launchers.api_server.entry --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --kv-transfer-config "$KV" "$@"
