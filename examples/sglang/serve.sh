#!/usr/bin/env bash
# Start a stock SGLang server (GPU host) with the pof pool as its HiCache storage backend.
#
#   examples/sglang/serve.sh MODEL_DIR PORT [CONFIG.json] [extra sglang args...]
#
# CONFIG.json defaults to pof-hicache.json next to this script; set its "model" to the same string
# as in your vLLM servers' pof config to share pages with them (docs/sglang.md, "One key space with vLLM").
set -euo pipefail
MODEL="$1"; PORT="$2"; CONFIG="${3:-$(dirname "$0")/pof-hicache.json}"; shift 2; [[ $# -gt 0 ]] && shift
exec "${PYTHON:-python3}" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --enable-hierarchical-cache --page-size 64 --hicache-mem-layout page_first_direct \
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "@$CONFIG" "$@"
