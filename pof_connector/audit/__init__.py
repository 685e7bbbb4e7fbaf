"""The audit: a sampled shadow recompute that measures, on live traffic, whether pool hits give
the engine the right KV.

Checksums prove a page holds the bytes its writer wrote; they cannot prove the writer wrote the
right KV (a page stored from the wrong blocks, under another prefix's key, computed over a failed
load). For a sampled pool hit the engine computes the page itself instead of loading it, and the
:class:`~pof_connector.audit.auditor.Auditor` compares what the engine computed with the pool's
page of the same key, layer by layer, within a stated numeric tolerance
(:mod:`pof_connector.audit.tolerance`). A page that differs is withdrawn and its writer named.

Holds: :mod:`.sampler` (which requests are audited), :mod:`.tolerance` (the error measure and
its bounds), :mod:`.auditor` (comparisons on a thread of their own, their counters and actions),
:mod:`.revocations` and :mod:`.cli` (``pof audit``). The ``audit`` config key is
:mod:`pof_connector.config.audit_config`, with the other keys.
May import the core (pool, pages, index, config) and ``cli_support``; engine adapters import
:mod:`.auditor` and :mod:`.sampler`, never the reverse.
"""
