"""``pof memd``: run a memory-only pool node until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pof_connector.cli_support import CommandError, size_arg
from pof_connector.config import PofConfig


def cmd_memd(args: argparse.Namespace) -> int:
    """Run a :class:`~pof_connector.pool.memd.MemoryNode` until SIGTERM or Ctrl-C."""
    import logging
    import signal

    from pof_connector.fabric import FabricError
    from pof_connector.pool.memd import MemoryNode

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = PofConfig.from_file(args.config)
    try:
        node = MemoryNode(config, args.slot_size)
    except FabricError as e:             # e.g. the UCX backend did not start on these devices
        raise CommandError(f"memd: {e}") from e
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    signal.signal(signal.SIGINT, lambda *_: node.stop())
    try:
        node.run(args.report_s)
    finally:
        node.close()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("memd", help="a memory-only pool node: lends its DRAM/CXL to other nodes' spilled pages",
                       description="Run a pool node without an engine: its tiers (config `tiers`) are registered "
                                   "over NIXL (config `fabric`, enabled: true) and lent, with leases, to nodes "
                                   "whose own tiers are full (fabric.spill). Stops cleanly on SIGTERM.")
    p.add_argument("--config", required=True, metavar="FILE", help="pof config (node_id, index_url, tiers, fabric)")
    p.add_argument("--slot-size", type=size_arg, required=True, metavar="SIZE",
                   help="bytes per slot: at least the page size of the writers it serves (their pool's "
                        "page_bytes, e.g. as `pof stats --json` shows in their meta)")
    p.add_argument("--report-s", type=float, default=10.0, metavar="N",
                   help="log the occupancy every N seconds when it changed (default 10)")
    p.set_defaults(handler=cmd_memd)
