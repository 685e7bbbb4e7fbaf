"""Micro-benchmarks behind ``pof bench``.

Each benchmark returns one plain dict (what ``--json`` prints) whose ``ratio`` compares pof with
the cheapest thing that does the same job on the same machine in the same run, so the figure
means something on any host: :mod:`.tiers` against ``numpy.copyto`` of the same bytes,
:mod:`.index` against one bare Redis round trip, :mod:`.fabric` against a raw NIXL READ
(:mod:`.fabric_owner`, :mod:`.raw_nixl_reader`), :mod:`.hbm` against raw torch copies,
:mod:`.vllm` against recompute and vLLM's own connector, :mod:`.router` against vllm-router,
:mod:`.lmcache` against LMCache's own ``local_cpu`` backend (:mod:`.lmcache_node` runs one LMCache
engine per process).
:mod:`.capacity` (goodput within a TTFT SLO of KV-constrained servers) against static placement.
Helpers: :mod:`.service_process`, :mod:`.vllm_server`, :mod:`.router_process` (processes stopped
by PID) and :mod:`.make_model` (the local test models). :mod:`.cli` registers them as
``pof bench`` commands and prints their tables.

May import: anything of ``pof_connector``, adapters included (the engine benchmarks drive real
engines through them); nothing of the core imports this package except the CLI and ``sim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Progress = Callable[[str], None]
"""Where a benchmark reports what it is doing (the CLI sends it to stderr, keeping stdout JSON)."""


class BenchError(RuntimeError):
    """A benchmark could not run, or pof returned a wrong answer while being measured."""


def quiet(_: str) -> None:
    """A :data:`Progress` that drops everything (library callers, tests)."""


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``ordered`` (sorted, not empty) by the nearest-rank rule:
    the value at rank ceil(q * n). The capacity bench and `pof sim` both judge p90 TTFT by it."""
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def geomean(values: Sequence[float]) -> float:
    """Geometric mean: the right average of ratios (a 2x and a 0.5x row cancel out)."""
    if not values or min(values) <= 0:
        raise ValueError(f"geomean needs positive values, got {list(values)}")
    return math.exp(sum(map(math.log, values)) / len(values))


__all__ = ["BenchError", "Progress", "geomean", "quiet"]
