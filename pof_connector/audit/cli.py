"""``pof audit``: what the audits of every live node measured, read from their index records."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from pof_connector.cli_support import out_console, print_json
from pof_connector.config import redact_url
from pof_connector.index import redis_index
from pof_connector.index.base import NodeInfo
from pof_connector.index.cli import _stats_url


def summaries(nodes: Sequence[NodeInfo]) -> dict[str, dict[str, Any]]:
    """Node id -> the audit summary it publishes (nodes that audit nothing are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for node in nodes:
        raw = node.meta.get("audit")
        if not raw:
            continue
        try:
            got = json.loads(raw)
        except ValueError:
            continue
        if isinstance(got, dict):
            out[node.node_id] = got
    return out


def totals(by_node: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pages audited, mismatches and the largest error over every node (``pof stats``' audit line)."""
    mismatches = sum(n for s in by_node.values() for r in s.get("mismatches", {}).values() for n in r.values())
    return {"pages": sum(int(s.get("pages", 0)) for s in by_node.values()), "mismatches": mismatches,
            "max_error": max((float(s.get("max_error", 0.0)) for s in by_node.values()), default=0.0)}


def cmd_audit(args: argparse.Namespace) -> int:
    url, auth = _stats_url(args)
    index = redis_index(url, None, auth=auth)
    try:
        by_node = summaries(index.nodes())
    finally:
        index.close()
    if args.json:
        print_json({"url": redact_url(url), "nodes": by_node, "totals": totals(by_node)})
        return 0
    out = out_console()
    if not by_node:
        out.print(f"no node at {redact_url(url)} audits (audit.sample_rate is 0, or no pool hit was sampled yet)")
        return 0
    table = Table(title=f"audits at {redact_url(url)}", title_justify="left")
    for name, justify in (("node", "left"), ("sample rate", "right"), ("pages audited", "right"),
                          ("dtype", "left"), ("bound", "right"), ("largest error", "right"),
                          ("mismatches by writer", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for node, s in sorted(by_node.items()):
        wrong = "; ".join(f"{w}: " + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
                          for w, reasons in sorted(s.get("mismatches", {}).items())) or "none"
        table.add_row(node, f"{s.get('sample_rate', 0):g}", f"{s.get('pages', 0):,}", str(s.get("dtype", "?")),
                      f"{s.get('bound', 0):g}", f"{s.get('max_error', 0):.3g}", wrong)
    out.print(table)
    hist = Table(title="normalised error of audited pages (max |engine - pool| / max |engine|, per layer and head)",
                 title_justify="left")
    hist.add_column("error up to", justify="right")
    hist.add_column("pages", justify="right")
    buckets: dict[str, int] = {}
    for s in by_node.values():
        for bound, n in s.get("buckets", {}).items():
            buckets[bound] = buckets.get(bound, 0) + int(n)
    for bound, n in buckets.items():
        hist.add_row(bound, f"{n:,}")
    out.print(hist)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="what the sampled shadow recompute of pool hits measured, per node",
                       description="Show, per live node that audits, the pool hits it recomputed and compared "
                                   "(audit.sample_rate), the error distribution and mismatches by writer.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="pof YAML/JSON config (default: index_url embedded)")
    where.add_argument("--url", help="index server URL, e.g. redis://host:6379/0 or unix:///path.sock")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=cmd_audit)
