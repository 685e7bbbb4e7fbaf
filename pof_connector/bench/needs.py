"""The packages a bench needs, checked before it starts anything: a run that fails on a missing
package after its servers ran for minutes (``--plot`` without matplotlib lost a 16-minute run) tells
the user nothing a check at argument time would not have."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from pof_connector.bench import BenchError


@dataclass(frozen=True)
class Need:
    """A package ``purpose`` needs: an importable ``module`` or, when ``binary`` is set, an
    executable on PATH or beside this Python (where a wheel's entry point lands in a venv)."""

    purpose: str
    package: str
    """What ``pip install`` takes."""
    module: str | None = None
    binary: str | None = None

    def present(self) -> bool:
        if self.binary is not None:
            return shutil.which(self.binary) is not None or (Path(sys.executable).parent / self.binary).exists()
        return importlib.util.find_spec(self.module or self.package) is not None


VLLM = Need("the vLLM servers", "vllm", module="vllm")
VLLM_ROUTER = Need("the cache_aware and kv_aware set-ups", "vllm-router==0.1.17", binary="vllm-router")
MATPLOTLIB = Need("--plot", "matplotlib", module="matplotlib")


def check(needs: list[Need], bench: str) -> None:
    """Raise :class:`BenchError` naming every missing package, what needs it and how to install it
    into the Python that runs the bench."""
    missing = [n for n in needs if not n.present()]
    if not missing:
        return
    lines = [f"  {n.package.split('=')[0]} (for {n.purpose}): {sys.executable} -m pip install '{n.package}'"
             for n in missing]
    raise BenchError(f"bench {bench}: missing package{'s' if len(missing) > 1 else ''}, nothing started:\n"
                     + "\n".join(lines))


__all__ = ["MATPLOTLIB", "VLLM", "VLLM_ROUTER", "Need", "check"]
