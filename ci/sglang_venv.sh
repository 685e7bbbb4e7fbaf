#!/usr/bin/env bash
# Build (or reuse) the venv that holds a real SGLang for the HiCache storage-backend tests; see
# ci/engine_venv.sh.
#
#   PY=$(bash ci/sglang_venv.sh | tail -n 1)
#
# SGLang does not serve on a CPU-only machine (its kernels want libcuda), but `import sglang` works
# and so do the classes a storage backend meets: StorageBackendFactory, HiCacheStorageConfig and
# the host KV pools (MHA/MLA, every layout, pin_memory=False). The tests drive those.
#
# torch: sglang 0.5.23 pins torch==2.14.1 exactly. pip's global cap here (torch<=2.14.1) admits it,
# but the only 2.14.1 reachable is PyPI's CUDA 13 build (with nvidia-*, triton, cuda-*: first build
# 5-9 min on 2 cores, ~11 GB); the CPU wheel on local disk (2.13.0+cpu) does not satisfy the pin.
# The CUDA build imports and computes on the CPU without a driver. Should the cap drop below
# 2.14.1, this install fails with ResolutionImpossible: raise the cap rather than loosen the pin.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ci/engine_venv.sh
source "$HERE/engine_venv.sh"

NAME=sglang
REQ="$HERE/requirements-sglang.txt"
TORCH_PIN="torch==2.14.1"
# Nothing to uninstall: torchvision 0.29.1 is the CUDA build matching this torch; transformers imports.
UNWANTED=()
IMPORT_CHECK='
import importlib.metadata as md
import torch
import sglang
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
dev = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
                       device="cpu", enable_memory_saver=False)
with host_memory_budget_scope(1 << 30):
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 4, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer)
assert host.page_size == 4 and host.layer_num == 3
version = md.version("sglang")
print(f"  sglang {version}, torch {torch.__version__}, host pool {tuple(host.kv_buffer.shape)} ok")
'
build_engine_venv "${BASH_SOURCE[0]}"
