"""Engine adapters (import path ``pof_connector.adapters``): thin translations between an
engine's KV layout and calls and the engine-agnostic pool. Each module imports its engine, so
import only the one you use. The module paths engine configs name stay as they are:
``pof_connector.adapters.vllm`` (vLLM's ``kv_connector_module_path``), ``pof_connector.adapters.sglang``
(SGLang's dynamic backend ``module_path``), ``pof_connector.adapters.lmcache`` (LMCache's
``storage_plugin.pof.module_path``).

* vLLM (``--kv-transfer-config``): :mod:`.vllm` (the connector), :mod:`.vllm_scheduler` and
  :mod:`.vllm_worker` (its two halves; the worker's saves in :mod:`.vllm_worker_saves`),
  :mod:`.vllm_metadata`, :mod:`.vllm_geometry`, :mod:`.vllm_layout`, :mod:`.vllm_stats`;
* SGLang (``--hicache-storage-backend dynamic``): :mod:`.sglang`, :mod:`.sglang_layout`;
* LMCache (``storage_plugins`` in LMCache's config): :mod:`.lmcache`, the storage plugin.

May import: each other, their engine, and only the public face of the core — these modules:

* ``pof_connector.config`` — ``PofConfig``, ``ConfigError``, ``PDConfig``, ``DEFAULT_TENANT``;
* ``pof_connector.pages`` — ``PageKey``, ``PageSpec``, ``Namespace``, ``KIND_MHA``/``KIND_MLA``, the
  chain keys, and ``page_sum`` (``from pof_connector.pages import page_sum``);
* ``pof_connector.pool`` — ``Pool``, ``Role``, ``Lookup``, ``PageReader``, ``StagingPool``, the
  chunk store;
* ``pof_connector.index`` — ``Location``;
* ``pof_connector.metrics`` — the counters' names and tier gauges (the engines' stats hooks);
* ``pof_connector.audit.auditor`` and ``pof_connector.audit.sampler`` — the audit.

Nothing of the core imports an adapter (``bench`` does, to drive engines); tests/test_import_rules.py
checks both.
"""
