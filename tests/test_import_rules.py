"""The package layout's import rules (docs/layout.md), checked on the source with ``ast``.

Every import counts: at the top of a module, inside a function, under ``TYPE_CHECKING``. A rule
names packages by their first component under ``pof_connector`` (``pool``, ``tiers``, ...; a
loose module such as ``metrics`` is its own name).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pof_connector"

CORE_FACE = frozenset({
    "pof_connector.config",         # PofConfig, ConfigError, PDConfig, DEFAULT_TENANT
    "pof_connector.pages",          # PageKey, PageSpec, Namespace, KIND_*, chain keys; page_sum
    "pof_connector.pool",           # Pool, Role, Lookup, PageReader, StagingPool, the chunk store
    "pof_connector.index",          # Location
    "pof_connector.metrics",        # the counters' names and tier gauges (the engines' stats hooks)
    "pof_connector.audit.auditor",  # the audit's comparisons (the vLLM worker)
    "pof_connector.audit.sampler",  # which requests are audited (the vLLM scheduler)
})
"""What adapters may import of the core: these modules only (``from pof_connector.pages import
page_sum`` counts as the ``pof_connector.pages`` face). The same list is in the adapters'
``__init__`` docstring."""

ENGINES = ("vllm", "sglang", "lmcache")

MAY_IMPORT: dict[str, frozenset[str]] = {
    "pages": frozenset(),
    "config": frozenset(),
    "metrics": frozenset(),
    "body_limits": frozenset(),
    "runtime_dir": frozenset({"config"}),
    "tiers": frozenset({"config", "pages", "metrics", "runtime_dir"}),
    "fabric": frozenset({"config", "pages", "metrics", "runtime_dir", "tiers", "index"}),
}
"""Packages at the bottom of the core and everything of ``pof_connector`` they may import."""

NEVER_IMPORT: dict[str, frozenset[str]] = {
    "tiers": frozenset({"pool", "index", "fabric", "adapters"}),
    "index": frozenset({"pool", "fabric", "adapters", "router", "relay"}),
    "fabric": frozenset({"pool", "adapters"}),
    "pool": frozenset({"adapters", "router", "relay", "locality", "bench", "sim"}),
    "pins": frozenset({"pool", "adapters"}),
    "locality": frozenset({"pool", "adapters"}),
    "relay": frozenset({"pool", "adapters"}),
    "sim": frozenset({"pool", "tiers", "fabric", "adapters"}),
}


def _imports(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``; ``from pof_connector import x`` gives
    ``pof_connector.x``, ``from pof_connector.pages import page_sum`` gives ``pof_connector.pages``."""
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base == "pof_connector":
                for alias in node.names:
                    yield node.lineno, f"pof_connector.{alias.name}"
            else:
                yield node.lineno, base


def _part(module: str) -> str | None:
    """The package (or loose module) of ``pof_connector`` that ``module`` is in; ``None``: not ours."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pof_connector" and len(parts) > 1 else None


def _sources(part: str) -> list[Path]:
    here = ROOT / part
    return sorted(here.rglob("*.py")) if here.is_dir() else [ROOT / f"{part}.py"]


def _where(path: Path, line: int, module: str) -> str:
    return f"{path.relative_to(ROOT.parent)}:{line} imports {module}"


def broken(part: str, allowed: frozenset[str] | None = None, forbidden: frozenset[str] = frozenset()) -> list[str]:
    """The imports of ``part`` that break a rule: a package of ours outside ``allowed`` (when
    given) or inside ``forbidden``."""
    bad = []
    for path in _sources(part):
        for line, module in _imports(path):
            other = _part(module)
            if other is None or other == part:
                continue
            if other in forbidden or (allowed is not None and other not in allowed):
                bad.append(_where(path, line, module))
    return bad


def test_the_packages_the_rules_name_exist() -> None:
    named = set(MAY_IMPORT) | set(NEVER_IMPORT) | {"adapters"}
    for values in (*MAY_IMPORT.values(), *NEVER_IMPORT.values()):
        named |= values
    assert sorted(p for p in named if not _sources(p)[0].exists()) == []
    assert all((ROOT / m.removeprefix("pof_connector.").replace(".", "/")).with_suffix(".py").exists()
               or (ROOT / m.removeprefix("pof_connector.").replace(".", "/") / "__init__.py").exists()
               for m in CORE_FACE)


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_the_bottom_of_the_core_imports_only_what_is_below_it(part: str) -> None:
    assert broken(part, allowed=MAY_IMPORT[part]) == []


@pytest.mark.parametrize("part", sorted(NEVER_IMPORT))
def test_lower_packages_never_import_the_ones_built_on_them(part: str) -> None:
    """``tiers``, ``index`` and ``fabric`` never import the pool; the pool never imports an adapter,
    a router or a benchmark."""
    assert broken(part, forbidden=NEVER_IMPORT[part]) == []


def test_adapters_import_only_the_public_face_of_the_core() -> None:
    bad = [_where(path, line, module) for path in _sources("adapters") for line, module in _imports(path)
           if _part(module) not in (None, "adapters") and module not in CORE_FACE]
    assert bad == []


def test_only_adapters_and_benchmarks_import_an_adapter_or_an_engine() -> None:
    """The core imports no engine: vLLM, SGLang and LMCache are reached through ``adapters`` (and
    the benchmarks that drive them)."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        part = _part(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        if part in ("adapters", "bench"):
            continue
        for line, module in _imports(path):
            if _part(module) == "adapters" or module.split(".")[0] in ENGINES:
                bad.append(_where(path, line, module))
    assert bad == []


def test_a_broken_rule_is_found(tmp_path: Path) -> None:
    """The checker itself: an import of the pool from a tier is reported, in every form."""
    for form in ("from pof_connector.pool import Pool", "import pof_connector.pool.placement",
                 "from pof_connector import pool", "from ..pool import pool"):
        bad = tmp_path / "pof_connector" / "tiers" / "bad.py"
        bad.parent.mkdir(parents=True, exist_ok=True)
        bad.write_text(f"def f() -> None:\n    {form}\n")
        found = [m for _, m in _imports(bad, tmp_path / "pof_connector")]
        assert [_part(m) for m in found] == ["pool"], form

