"""Engine adapter tests need the engine: they run in the engine venvs (ci/vllm_venv.sh,
ci/sglang_venv.sh), where CI runs them with ``-m vllm`` and ``-m sglang``. In the core venv there is
nothing to collect here."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_vllm*.py"]
if not importlib.util.find_spec("sglang"):
    collect_ignore_glob.append("test_sglang*.py")
if not importlib.util.find_spec("lmcache"):
    collect_ignore_glob.append("test_lmcache*.py")
