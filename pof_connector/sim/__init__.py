"""``pof sim``: a discrete-event simulator of a cluster of engine nodes with KV memory, to tell
what the pool buys for a workload before deploying it (issue 15).

- :mod:`.engine_node`: one engine (vLLM-like admission, continuous batching, preemption of the
  newest request when a decode step cannot get a block);
- :mod:`.prefix_cache` / :mod:`.kv_pool`: the engine's own prefix cache and the cluster pool;
- :mod:`.simulator`: the event loop; :mod:`.goodput_search`: the bounded rate-factor search;
- policies: :mod:`.static_affinity`, :mod:`.round_robin`, :mod:`.cache_aware`,
  :mod:`.pof_policy` (the real :class:`~pof_connector.router.router.Router` fed simulated state
  through :mod:`.sim_locator`);
- :mod:`.profile` (YAML profiles, ``profiles/*.yaml``), :mod:`.workload` and :mod:`.mixes`.

May import: ``config``, ``index``, ``locality``, ``router`` (the real routing policy), ``bench`` (its
capacity model) and ``cli_support``. Never the pool, a tier or an engine: it simulates them.
"""
