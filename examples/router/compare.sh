#!/usr/bin/env bash
# The same two engines behind each router, for comparison (`pof bench router` runs all of them).
# Engines: vLLM servers with the pof connector (examples/vllm/serve.sh), on ports 8001 and 8002,
# started with KV events for the relays:
#   --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":""}'
set -euo pipefail
A=http://127.0.0.1:8001
B=http://127.0.0.1:8002

case "${1:-pof}" in
pof)            # pof router: engine caches + pool residency from the index, TTFT cost model
    exec pof router --config "$(dirname "$0")/pof-router.yaml" ;;
vllm-kv-aware)  # stock vllm-router fed by pof relays: engine events + pool residency (host credit)
    # one relay per engine (run each on its engine's host):
    #   pof relay --config a.yaml --engine-events tcp://127.0.0.1:5557 --bind tcp://0.0.0.0:5657 --engine-url "$A"
    #   pof relay --config b.yaml --engine-events tcp://127.0.0.1:5558 --bind tcp://0.0.0.0:5658 --engine-url "$B"
    exec vllm-router --port 8080 --policy kv_aware --worker-urls "$A" "$B" \
        --kv-event-block-size 128 --kv-event-model m \
        --kv-event-source "$A=tcp://127.0.0.1:5657" --kv-event-source "$B=tcp://127.0.0.1:5658" ;;
vllm-cache-aware)   # stock vllm-router, approximate prefix tree over request text, no pool knowledge
    exec vllm-router --port 8080 --policy cache_aware --worker-urls "$A" "$B" ;;
vllm-round-robin)
    exec vllm-router --port 8080 --policy round_robin --worker-urls "$A" "$B" ;;
sglang-cache-aware) # sglang-router (pip install sglang-router): same idea, for SGLang servers
    exec python -m sglang_router.launch_router --port 8080 --policy cache_aware --worker-urls "$A" "$B" ;;
*)
    echo "usage: $0 [pof|vllm-kv-aware|vllm-cache-aware|vllm-round-robin|sglang-cache-aware]" >&2
    exit 2 ;;
esac
