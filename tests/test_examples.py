"""The examples a newcomer runs first, run as they would run them (real processes)."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pof_connector.console import console

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_core_demo_table_keeps_its_columns_when_piped(tmp_path: Path) -> None:
    """examples/core/two_nodes.py, its output piped (a real run: two pools, the embedded index)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES.parent), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(EXAMPLES / "core" / "two_nodes.py"), "--pages", "8"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout, done.stdout
    for header in ("prompt pages", "loaded", "from node", "tiers", "byte-exact", "lookup ms", "layer 0 ms", "all ms"):
        assert header in done.stdout, (header, done.stdout)


def test_quickstart_table_keeps_its_columns_when_piped(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/vllm/quickstart.py's table (its vLLM run is the README's main job, not a test),
    printed as the quickstart prints it, to a stream that is no terminal."""
    monkeypatch.delenv("COLUMNS", raising=False)
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLES / "vllm" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    table = quickstart.workload_table()
    table.add_row("B", "tenant-2", "1", "1,448", "0", "1,408", "cxl", "40", "312")
    stream = io.StringIO()
    console(stream).print(table)
    out = stream.getvalue()
    assert "…" not in out, out
    for header in ("server", "tenant", "turn", "prompt tokens", "engine cache", "pool", "pool tier", "computed",
                   "TTFT ms", "tenant-2"):
        assert header in out, (header, out)
