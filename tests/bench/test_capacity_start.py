"""A capacity set-up whose start fails once is started afresh; the cause is shown, not hidden. The
fleet here stands in for :class:`~pof_connector.bench.capacity_fleet.Fleet` (real vLLM servers,
exercised by ``test_capacity_quick`` in the vLLM venv)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from pof_connector.bench import capacity
from pof_connector.bench.capacity_fleet import FleetSpec

SPEC = FleetSpec(servers=2, kv_blocks=33, block=128, max_model_len=4096, max_num_seqs=8)
LOG = """vllm-5.log: exited with 1:
(EngineCore pid=9) ERROR 12-01 [core.py:1510] EngineCore failed to start.
(EngineCore pid=9) ERROR 12-01 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=9) ERROR 12-01 [core.py:1510] OSError: [Errno 98] Address already in use
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"""


class FlakyFleet:
    """Fails to start the first ``failures`` times, with an engine's log excerpt."""

    starts: ClassVar[list[Path]] = []
    failures: ClassVar[int] = 1

    def __init__(self, setup: str, model: Path, workdir: Path, spec: FleetSpec) -> None:
        self.workdir = workdir

    def start(self) -> FlakyFleet:
        FlakyFleet.starts.append(self.workdir)
        if len(FlakyFleet.starts) <= FlakyFleet.failures:
            raise RuntimeError(LOG)
        return self


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> type[FlakyFleet]:
    FlakyFleet.starts = []
    monkeypatch.setattr(capacity, "Fleet", FlakyFleet)
    return FlakyFleet


def test_a_failed_start_is_retried_in_a_fresh_directory_and_its_cause_shown(flaky: Any, tmp_path: Path) -> None:
    lines: list[str] = []
    fleet = capacity.start_fleet("pof", tmp_path, tmp_path / "pof", SPEC, lines.append)
    assert isinstance(fleet, FlakyFleet) and len(flaky.starts) == 2 and flaky.starts[0] != flaky.starts[1]
    assert lines == ["pof: start 1 failed (OSError: [Errno 98] Address already in use); starting again"]


def test_a_start_that_keeps_failing_raises_its_error(flaky: Any, tmp_path: Path) -> None:
    flaky.failures = 5
    with pytest.raises(RuntimeError, match="Address already in use"):
        capacity.start_fleet("static", tmp_path, tmp_path / "static", SPEC, lambda line: None)
    assert len(flaky.starts) == 2


def test_failure_cause_falls_back_to_the_first_line() -> None:
    assert capacity.failure_cause("vllm-1.log: /health did not answer in 600s:\nloading") == \
        "vllm-1.log: /health did not answer in 600s:"
    assert capacity.failure_cause("") == ""
