"""``pof index stats``'s rendering: live nodes and index totals as tables, or as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rich.table import Table

from pof_connector.cli_support import out_console
from pof_connector.config import format_size, redact_url
from pof_connector.index.base import NodeInfo
from pof_connector.tiers.tenant_usage import META_KEY, parse_meta


def _lent(node: NodeInfo) -> dict[str, tuple[int, int]]:
    """Per medium: (slots lent to spilling writers, writers holding leases); empty when the node
    lends nothing (fabric.spill off)."""
    try:
        raw = json.loads(node.meta.get("fabric.lent", "{}"))
        return {str(m): (int(v[0]), int(v[1])) for m, v in raw.items()}
    except (ValueError, TypeError, IndexError, AttributeError):
        return {}


def node_json(node: NodeInfo) -> dict[str, object]:
    lent = _lent(node)
    tiers = {medium: {"capacity_bytes": t.capacity_bytes, "free_bytes": t.free_bytes,
                      "used_bytes": t.capacity_bytes - t.free_bytes, "domain": t.domain,
                      **({"lent_slots": lent[medium][0], "lease_writers": lent[medium][1]} if medium in lent else {})}
             for medium, t in node.tiers.items()}
    return {"node_id": node.node_id, "role": node.meta.get("pof.role", "pool"), "tiers": tiers, "meta": node.meta}


def print_stats(url: str, nodes: Sequence[NodeInfo], totals: dict[str, int]) -> None:
    table = Table(title=f"live nodes at {redact_url(url)}", title_justify="left")
    table.add_column("node", no_wrap=True)
    table.add_column("tier")
    for name in ("capacity", "used", "free"):
        table.add_column(name, justify="right")
    table.add_column("lent (slots / writers)", justify="right")
    table.add_column("domain", overflow="fold")
    for node in sorted(nodes, key=lambda n: n.node_id):
        label = node.node_id + (" (memory)" if node.meta.get("pof.role") == "memory" else "")
        lent = _lent(node)
        if not node.tiers:
            table.add_row(label, "-", "-", "-", "-", "-", "-")
        for i, (medium, t) in enumerate(sorted(node.tiers.items())):
            shown = f"{lent[medium][0]:,} / {lent[medium][1]}" if medium in lent else "-"
            table.add_row(label if i == 0 else "", medium, format_size(t.capacity_bytes),
                          format_size(t.capacity_bytes - t.free_bytes), format_size(t.free_bytes), shown, t.domain)
    out = out_console()
    out.print(table)
    tenants = tenant_table(nodes)
    if tenants is not None:
        out.print(tenants)
    summary = Table(title="index totals", title_justify="left", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("locations", f"{totals.get('locations', 0):,}")
    summary.add_row("server memory", format_size(totals.get("memory_bytes", 0)))
    summary.add_row("live nodes", str(totals.get("nodes", len(nodes))))
    if "restarts" in totals:
        summary.add_row("server restarts", str(totals["restarts"]))
    audited = [n.meta["audit"] for n in nodes if n.meta.get("audit")]
    if audited:        # the nodes' sampled shadow recompute (pof audit shows it whole)
        pages = mismatches = 0
        worst = 0.0
        for raw in audited:
            try:
                s = json.loads(raw)
                pages += int(s.get("pages", 0))
                mismatches += sum(int(n) for r in s.get("mismatches", {}).values() for n in r.values())
                worst = max(worst, float(s.get("max_error", 0.0)))
            except (ValueError, TypeError, AttributeError):
                continue
        summary.add_row("audit", f"{pages:,} pages, {mismatches} mismatched, largest error {worst:.3g}")
    out.print(summary)



def tenant_table(nodes: Sequence[NodeInfo]) -> Table | None:
    """Each tenant's use and quota per node and tier (by name: no salt is known here); ``None``
    when no node has tenants configured."""
    rows = [(n.node_id, parse_meta(n.meta.get(META_KEY))) for n in sorted(nodes, key=lambda n: n.node_id)]
    if not any(usage for _, usage in rows):
        return None
    table = Table(title="tenants", title_justify="left")
    for name in ("node", "tenant", "tier", "used", "quota"):
        table.add_column(name, justify="right" if name in ("used", "quota") else "left")
    for node_id, usage in rows:
        for tenant in sorted(usage):
            for medium, (used, quota) in sorted(usage[tenant].items()):
                table.add_row(node_id, tenant, medium, format_size(used), "-" if quota is None else format_size(quota))
    return table
