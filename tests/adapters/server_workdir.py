"""The directory a test module's servers write their logs and runtime files to."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def server_workdir(request: pytest.FixtureRequest, prefix: str) -> Iterator[Path]:
    """For a workdir fixture (module- or function-scoped): a fresh directory, removed afterwards
    unless a test it served failed (or ``POF_KEEP_SERVER_LOGS=1``). Then it is kept and its path
    printed, so the servers' own logs can tell what happened (a rare failure cannot be rerun at will)."""
    failed = request.session.testsfailed
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    yield d
    failed_here = request.session.testsfailed > failed
    if failed_here or os.environ.get("POF_KEEP_SERVER_LOGS") == "1":
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            why = "a test failed" if failed_here else "POF_KEEP_SERVER_LOGS=1"
            reporter.write_line(f"{request.node.name}: {why}; its servers' logs are kept in {d}")
        return
    shutil.rmtree(d, ignore_errors=True)
