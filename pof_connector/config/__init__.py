"""Configuration and credentials: one frozen, validated config for every entry point.

* :mod:`.pof_config` — :class:`~.pof_config.PofConfig` (every key of the pool's config, checked
  once at start-up), :class:`~.pof_config.TierConfig`, :class:`~.pof_config.FabricConfig`, sizes;
* :mod:`.config_error` — :class:`~.config_error.ConfigError`, the one error of every check;
* :mod:`.credentials` — secrets read from an environment variable or a file, never from a config;
* :mod:`.cluster_url` — ``redis+cluster://`` index URLs;
* :mod:`.pd_config` — the ``pd`` key (prefill/decode disaggregation);
* :mod:`.tenant_config` — the ``tenants`` key (who a page belongs to, and quotas);
* :mod:`.audit_config` — the ``audit`` key (sample rate, tolerance bounds; the audit itself is
  :mod:`pof_connector.audit`).

May import: nothing else of ``pof_connector``. Every other package may import this one.

This module re-exports the names other packages use: ``from pof_connector.config import
PofConfig, ConfigError`` is the public face.
"""

from pof_connector.config.config_error import ConfigError
from pof_connector.config.credentials import IndexAuth, read_secret
from pof_connector.config.pd_config import PDConfig
from pof_connector.config.pof_config import (
    FabricConfig,
    PofConfig,
    TierConfig,
    format_size,
    parse_size,
    redact_url,
)
from pof_connector.config.tenant_config import DEFAULT_TENANT, TenantsConfig

__all__ = ["DEFAULT_TENANT", "ConfigError", "FabricConfig", "IndexAuth", "PDConfig", "PofConfig", "TenantsConfig",
           "TierConfig", "format_size", "parse_size", "read_secret", "redact_url"]
