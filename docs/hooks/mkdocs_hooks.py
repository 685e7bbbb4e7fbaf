"""MkDocs hooks: the home page (from README.md) and the configuration and CLI references (from the
code) are generated at build time.

Registered in mkdocs.yml (``hooks:``). The pages are virtual: nothing generated is committed, so
the site can never hold a stale copy. A key the code accepts but the reference does not list
stops the build (see :func:`reference.config_key_problems`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent

GENERATED = ("reference/configuration.md", "reference/cli.md")
WIDE = "---\nhide:\n  - toc\n---\n"
"""Front matter of the wide pages (the picture, the reference tables): no table-of-contents column."""


def home_page() -> str:
    """The site's home is the README, its links into docs/ made relative to the site: one text,
    read on GitHub and on the site, and the strict build checks the README's links too."""
    text = (HERE.parents[1] / "README.md").read_text(encoding="utf-8")
    return WIDE + text.replace("](docs/", "](")


def on_files(files: Files, config: Any) -> Files:
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines to the terminal: the same width everywhere
    for path in (str(HERE.parents[1]), str(HERE)):  # this checkout's pof_connector, whatever is installed
        if path not in sys.path:
            sys.path.insert(0, path)
    import reference

    page, problems = reference.config_reference()
    if problems:
        raise PluginError("the configuration reference does not match the code:\n  " + "\n  ".join(problems))
    files.append(File.generated(config, "index.md", content=home_page()))
    files.append(File.generated(config, GENERATED[0], content=WIDE + page))
    files.append(File.generated(config, GENERATED[1], content=reference.cli_reference()))
    return files
