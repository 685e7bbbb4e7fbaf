"""The generated configuration reference lists every key the code accepts, and nothing else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import reference
import sources

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]


def test_reference_lists_exactly_the_accepted_keys() -> None:
    _, problems = reference.config_reference()
    assert problems == []


def test_every_config_field_is_on_the_page() -> None:
    """Independent of the generator's walk: each dataclass field, as the key a user writes."""
    page, _ = reference.config_reference()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    expected = {f.name for f in dataclasses.fields(sources.PofConfig)} - {"index_auth"}
    expected |= {f"index_{f.name}" for f in dataclasses.fields(sources.IndexAuth)}
    for section, (cls, _) in sources.POOL_SECTIONS.items():
        expected |= {f"{section}.{f.name}" for f in dataclasses.fields(cls)}
    expected |= {f"tenants.{f.name}" for f in dataclasses.fields(sources.TenantsConfig)}
    expected |= {f"tiers.{m}.{o}" for m, opts in sources.TIER_OPTIONS.items() for o in opts}
    expected |= set(sources.RouterConfig.model_fields)
    assert expected - listed == set()


def test_the_guide_names_only_real_keys() -> None:
    """The hand-written table of docs/configuration.md may not name a key the code does not have."""
    page, _ = reference.config_reference()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    guide = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    named: set[str] = set()
    for cell in re.findall(r"^\| (`[^|]+`) \|", guide, flags=re.M):
        keys = re.findall(r"`([^`]+)`", cell)
        for key in keys:
            named.add(keys[0].rsplit(".", 1)[0] + key if key.startswith(".") else key)
    assert named, "no keys found in the guide's table"
    assert named - listed == set()


def test_cli_reference_has_every_command() -> None:
    page = reference.cli_reference()
    for cmd in ("pof index serve", "pof bench capacity", "pof router", "pof sim validate", "pof pin add"):
        assert f"## `{cmd}`" in page
