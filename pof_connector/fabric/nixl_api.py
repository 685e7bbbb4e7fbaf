"""Finding NIXL's Python API without making it a hard dependency.

pof imports no NIXL unless ``fabric.enabled`` is set. The backend wheels are imported directly
(``nixl_cu13._api`` first): the ``nixl`` meta package picks a wheel by torch's CUDA version and
fails when torch is a cu12 build but only ``nixl-cu13`` is installed
(docs/engines/nixl-1.5.1-ucx.md §1).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from pof_connector.config import ConfigError

NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
INSTALL_HINT = "pip install --no-deps nixl-cu13==1.5.1 (or pof-connector[nixl] where torch is installed)"


def nixl_installed() -> bool:
    """True when one of NIXL's API modules can be found (nothing is imported)."""
    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def require_nixl() -> None:
    """Fail at start-up, naming the key, when the fabric is enabled but NIXL is missing."""
    if not nixl_installed():
        raise ConfigError(f"fabric.enabled: NIXL is not installed in this environment; install it with "
                          f"`{INSTALL_HINT}`; allowed: false, or true with NIXL installed")


def load_nixl() -> ModuleType:
    """NIXL's API module (``nixl_agent``, ``nixl_agent_config``, ``nixl_thread_sync_t``)."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ConfigError(f"fabric.enabled: NIXL could not be imported ({'; '.join(errors)}); install it with "
                      f"`{INSTALL_HINT}`; allowed: false, or true with NIXL installed")
