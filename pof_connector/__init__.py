"""pof-connector: PagedAttention over Fabrics — a cluster-wide KV-cache pool for stock vLLM and SGLang.

The core (this package) imports no engine: ``config`` (one validated config), ``keys`` (page
keys), ``pages`` (page layout), ``pool`` (what adapters call), ``index`` (where pages live),
``tiers`` (media). Engine adapters live in ``pof_connector.adapters``.
"""

__version__ = "0.1.0"
