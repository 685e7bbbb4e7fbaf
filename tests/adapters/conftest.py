"""Engine adapter tests need the engine: they run in the engine venvs (ci/vllm_venv.sh,
ci/sglang_venv.sh), where CI runs them with ``-m vllm`` and ``-m sglang``. In the core venv there is
nothing to collect here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The GPU harness and the device ordering tests stand in for vLLM: they run where it cannot be installed.
_NO_VLLM_NEEDED = {"test_vllm_gpu_harness.py", "test_vllm_device.py"}
collect_ignore = [] if importlib.util.find_spec("vllm") else [
    p.name for p in Path(__file__).parent.glob("test_vllm*.py") if p.name not in _NO_VLLM_NEEDED]
collect_ignore_glob: list[str] = []
if not importlib.util.find_spec("sglang"):
    collect_ignore_glob.append("test_sglang*.py")
if not importlib.util.find_spec("lmcache"):
    collect_ignore_glob.append("test_lmcache*.py")
