"""Rich consoles for pof's tables (the ``pof`` command, the examples)."""

from __future__ import annotations

from typing import IO

from rich.console import Console

MIN_PIPED_WIDTH = 160
"""Columns a table may use when the output is no terminal (piped through ``tee``, a CI log):
rich would otherwise fit it into 80 and cut headers and cells (``tenan…``). A wider ``COLUMNS``
is kept."""


def console(file: IO[str] | None = None, *, highlight: bool = True) -> Console:
    """A console on ``file`` (``None``: stdout, looked up when printing); at least
    :data:`MIN_PIPED_WIDTH` columns wide when it is not a terminal."""
    out = Console(file=file, highlight=highlight)
    if not out.is_terminal:
        out.width = max(MIN_PIPED_WIDTH, out.width)
    return out
