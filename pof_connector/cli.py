"""The ``pof`` command: run and inspect the locality index, and benchmark this host.

Commands::

    pof index serve   run this host's embedded index server in the foreground
    pof index stop    stop it
    pof index stats   live nodes and index totals (also ``pof stats``)
    pof bench tiers   page put+get through the tiers vs. plain memcpy
    pof bench index   prefix-lookup latency and memory per location
    pof bench fabric  remote page fetch over NIXL through pof vs. a raw NIXL READ
    pof bench hbm     peer-GPU HBM and host-tier reads vs. raw torch copies
    pof router        OpenAI-compatible proxy routing by estimated time to first token
    pof relay         feed a KV-event router (vllm-router kv_aware) an engine's cache and its pool
    pof memd          a memory-only pool node: lends its DRAM/CXL to other nodes' spilled pages
    pof pin           pin a prompt prefix in the pool for a while (soft or hard); list, remove pins
    pof sim           simulate a cluster: goodput per placement policy, with and without the pool

Every command returns an exit code instead of raising: 0 on success, 1 when it could not do
its job (with one line on stderr saying why), 2 for a usage error. ``--json`` output goes to
stdout alone, so it can be piped; progress and errors go to stderr.

Each command group registers itself next to its code (``add_parser(sub)``):
:mod:`pof_connector.index.cli`, :mod:`pof_connector.bench.cli`, :mod:`pof_connector.router.serve`,
:mod:`pof_connector.relay.cli`, :mod:`pof_connector.pool.memd_cli`; their shared plumbing is
:mod:`pof_connector.cli_support`. This module only assembles them.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from pof_connector.audit import cli as audit_cli
from pof_connector.bench import BenchError
from pof_connector.bench import cli as bench_cli
from pof_connector.cli_support import CommandError, Handler, err_console, usage
from pof_connector.config import ConfigError
from pof_connector.index import cli as index_cli
from pof_connector.index.base import IndexUnavailable
from pof_connector.pins import cli as pin_cli
from pof_connector.pool import memd_cli
from pof_connector.relay import cli as relay_cli
from pof_connector.router import serve as router_serve
from pof_connector.sim import sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pof", description="pof-connector: a cluster-wide KV-cache pool "
                                                             "for vLLM and SGLang.")
    parser.set_defaults(handler=usage(parser))
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    index_cli.add_parser(sub)            # pof index …, and pof stats
    audit_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    router_serve.add_parser(sub)
    relay_cli.add_parser(sub)
    memd_cli.add_parser(sub)
    pin_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    return parser


def _exit_code(code: object) -> int:
    """argparse exits with None, an int or a message; ``main`` returns an int instead."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that its ``finally`` blocks stop what it started."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pof`` console script; returns the exit code rather than exiting.

    SIGTERM ends a command as Ctrl-C does (exit code 143): a bench stopped with ``kill`` stops
    the servers it started instead of leaving them running (commands that serve, such as
    ``pof router`` and ``pof relay``, install their own handler)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:            # --help, or a usage error argparse already printed
        return _exit_code(e.code)
    handler: Handler = args.handler
    if argv is None:                   # the console script, not a caller's in-process use
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return handler(args)
    except (CommandError, ConfigError, BenchError, IndexUnavailable, FileNotFoundError) as e:
        err_console().print(f"pof: {e}", markup=False, soft_wrap=True)
        return 1
    except Terminated:
        return 143
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
