"""Engine adapters (import path ``pof_connector.adapters``): thin translations between an
engine's KV layout and calls and the engine-agnostic pool. Each module imports its engine, so
import only the one you use.

* vLLM (``--kv-transfer-config``): :mod:`.vllm` (the connector), :mod:`.vllm_scheduler` and
  :mod:`.vllm_worker` (its two halves), :mod:`.vllm_metadata`, :mod:`.vllm_geometry`,
  :mod:`.vllm_layout`, :mod:`.vllm_stats`;
* SGLang (``--hicache-storage-backend dynamic``): :mod:`.sglang`, :mod:`.sglang_layout`;
* LMCache (``storage_plugins`` in LMCache's config): :mod:`.lmcache`, the storage plugin.
"""
