"""Where the generated references read the code: every import of a config class or parser is here.

The configuration reference (``reference/configuration.md``) and the CLI reference
(``reference/cli.md``) are built from these objects when the site is built, so neither can drift
from the code. When a module moves, repoint the imports below and nothing else.
"""

from __future__ import annotations

from pof_connector.cli import build_parser
from pof_connector.config.audit_config import AUDIT_KEYS, AuditConfig
from pof_connector.config.config_error import ConfigError
from pof_connector.config.credentials import INDEX_AUTH_KEYS, IndexAuth
from pof_connector.config.pd_config import PD_KEYS, PDConfig
from pof_connector.config.pof_config import _FABRIC_KEYS, _TIER_KEYS, KNOWN_MEDIA, FabricConfig, PofConfig, TierConfig
from pof_connector.config.tenant_config import TENANT_KEYS, TENANTS_KEYS, Tenant, TenantsConfig
from pof_connector.router.router_config import RouterConfig

POOL_SECTIONS = {
    # config key (a nested mapping) -> (its dataclass, the option names its parser accepts)
    "fabric": (FabricConfig, _FABRIC_KEYS),
    "audit": (AuditConfig, AUDIT_KEYS),
    "pd": (PDConfig, PD_KEYS),
}
"""Nested sections of the pool config that map one to one onto a dataclass."""

TIER_OPTIONS: dict[str, tuple[str, ...]] = dict(_TIER_KEYS)
"""Per medium, the options its parser accepts (``tiers.<medium>.<option>``)."""

__all__ = [
    "INDEX_AUTH_KEYS", "KNOWN_MEDIA", "POOL_SECTIONS", "TENANTS_KEYS", "TENANT_KEYS", "TIER_OPTIONS",
    "ConfigError", "IndexAuth", "PofConfig", "RouterConfig", "Tenant", "TenantsConfig", "TierConfig",
    "build_parser",
]
