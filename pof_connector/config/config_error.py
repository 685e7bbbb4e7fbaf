"""The one error of every configuration check (re-exported by :mod:`pof_connector.config`)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key is unknown or its value is not allowed."""
