"""pof's NIXL agent: what it costs while idle (a real agent with the UCX backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pof_connector.fabric import nixl_installed

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed() and os.environ.get("POF_REQUIRE_NIXL") != "1",
                                 reason="NIXL is not installed (ci/test.sh installs it)")]

IDLE = """
import json, sys, time
import numpy as np
from pof_connector.config import FabricConfig
from pof_connector.fabric.agent import NixlAgent
agent = NixlAgent("idle", FabricConfig(enabled=True, tls="tcp", progress_wakeup_ms=int(sys.argv[1])))
region = np.zeros(1 << 20, np.uint8)
agent.register(region)
time.sleep(0.2)
t0, c0 = time.monotonic(), time.process_time()
time.sleep(2.0)
print(json.dumps({"cpu_share": (time.process_time() - c0) / (time.monotonic() - t0)}))
agent.close()
"""


def idle_cpu_share(wakeup_ms: int) -> float:
    """CPU time per wall second of a process holding an idle agent (its own process: pytest's
    threads would count too)."""
    out = subprocess.run([sys.executable, "-c", IDLE, str(wakeup_ms)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("{"))
    return float(json.loads(line)["cpu_share"])


def test_an_idle_agent_sleeps_and_nixls_default_spins() -> None:
    quiet = idle_cpu_share(1)
    busy = idle_cpu_share(0)            # NIXL's Python default: poll() with no timeout, in a loop
    assert quiet < 0.15, quiet          # measured 0.02: the progress thread sleeps in poll()
    assert busy > 3 * quiet and busy > 0.3, (quiet, busy)     # measured 0.95: a whole core
