"""What every ``pof`` command shares: its error, its consoles, JSON output, size arguments."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rich.console import Console

from pof_connector.config import ConfigError, parse_size
from pof_connector.console import console

Handler = Callable[[argparse.Namespace], int]


class CommandError(RuntimeError):
    """A command cannot do its job; the message is shown as is and the exit code is 1."""


def out_console() -> Console:
    # Built per call, not at import: tests and pipes swap sys.stdout after this module loads.
    return console(sys.stdout, highlight=False)


def err_console() -> Console:
    return console(sys.stderr, highlight=False)


def progress(message: str) -> None:
    err_console().print(message, style="dim", markup=False, soft_wrap=True)


def print_json(obj: object) -> None:
    """Exactly one JSON object on stdout, without rich's wrapping or markup."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def size_arg(text: str) -> int:
    """argparse ``type`` for sizes such as ``256MiB``: the config's parser, the config's words."""
    try:
        return parse_size(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def usage(parser: argparse.ArgumentParser) -> Handler:
    """The handler of a command group given no command: its help, and the usage-error code."""
    def show(_: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2
    return show
