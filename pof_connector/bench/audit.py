"""``pof bench audit``: the audit's tolerance measured on real vLLM CPU servers.

Per dtype, three servers share one CXL region and the embedded index: ``a`` and ``b`` audit every
pool hit (``sample_rate: 1.0``) and write clean pages, each auditing the other's (requests alone
and four at a time); ``w`` writes pages with each injected fault (the test-only writer hook of
:mod:`pof_connector.adapters.vllm_faults`) for ``b`` to audit. Reported: the clean pages audited,
their largest normalised error and mismatches (0 expected: a false alarm), each fault's smallest
error and the pages it mismatched, and the **margin**: the smallest fault error over the largest
clean one (how far apart rounding and real faults are, against the configured bound)."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pof_connector.adapters.vllm_faults import ENV, FAULTS
from pof_connector.audit.cli import summaries
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.config.audit_config import DEFAULT_BOUNDS
from pof_connector.index import redis_index
from pof_connector.index.embedded import embedded_url, stop_embedded

PAGE = 128      # vLLM's CPU block size: the pool's page here


def _prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1900) for _ in range(n)]


class _Fleet:
    def __init__(self, workdir: Path, dtype: str, model: Path) -> None:
        self.rt = workdir / "rt"
        self.region = Path(tempfile.mkdtemp(prefix="pof-bench-audit-", dir="/dev/shm")) / "cxl.region"
        self.faults = workdir / "faults"
        self.faults.write_text("")
        tiers = {"cxl": {"path": str(self.region), "size": "1GiB", "partitions": 4}}

        def server(name: str, rate: float, **kw: Any) -> VllmServer:
            cfg = {"node_id": name, "index_url": "embedded", "runtime_dir": str(self.rt), "tiers": tiers,
                   "audit": {"sample_rate": rate}}
            return VllmServer(model, workdir / name, kv_transfer=connector_config(cfg), dtype=dtype, **kw)

        self.a, self.b = server("a", 1.0), server("b", 1.0)
        self.w = server("w", 0.0, env={ENV: str(self.faults)})
        self.all = (self.a, self.b, self.w)

    def start(self) -> None:
        with ThreadPoolExecutor(3) as ex:
            list(ex.map(lambda s: s.start(), self.all))

    def summary(self, node: str) -> dict[str, Any]:
        index = redis_index(embedded_url(str(self.rt)), None)
        try:
            return next((s for n, s in summaries(index.nodes()).items() if n == node or n.startswith(node + "-")),
                        {"pages": 0, "max_error": 0.0, "mismatches": {}, "recent": []})
        finally:
            index.close()

    def stop(self) -> None:
        for s in self.all:
            s.stop()
        stop_embedded(self.rt)
        shutil.rmtree(self.region.parent, ignore_errors=True)


def _mismatched(s: dict[str, Any]) -> int:
    return sum(int(n) for r in s.get("mismatches", {}).values() for n in r.values())


def _wait_pages(fleet: _Fleet, node: str, want: int, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    s = fleet.summary(node)
    while s["pages"] < want and time.monotonic() < deadline:
        time.sleep(0.5)
        s = fleet.summary(node)
    return s


def _clean(fleet: _Fleet, pages: int, seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Clean pages: a writes, b audits; then b writes, a audits. Half alone, half four at a time."""
    rnd = random.Random(seed)
    per_side = -(-pages // 2)
    out: dict[str, Any] = {"pages": 0, "max_error": 0.0, "mismatches": 0, "answers_equal": 0, "prompts": 0}
    for writer, auditor, name in ((fleet.a, fleet.b, "b"), (fleet.b, fleet.a, "a")):
        prompts: list[list[int]] = []
        while sum((len(p) - 1) // PAGE for p in prompts) < per_side:
            prompts.append(_prompt(rnd.randrange(900, 2000), rnd.randrange(1 << 30)))
        with ThreadPoolExecutor(4) as ex:
            written = list(ex.map(writer.complete, prompts))
        time.sleep(1.5)                   # published
        before = fleet.summary(name)
        half = len(prompts) // 2
        audited = [auditor.complete(p) for p in prompts[:half]]
        with ThreadPoolExecutor(4) as ex:
            audited += list(ex.map(auditor.complete, prompts[half:]))
        want = before["pages"] + sum((len(p) - 1) // PAGE for p in prompts)
        after = _wait_pages(fleet, name, want)
        out["pages"] += after["pages"] - before["pages"]
        out["max_error"] = max(out["max_error"], after["max_error"])
        out["mismatches"] += _mismatched(after) - _mismatched(before)
        out["answers_equal"] += sum(x == y for x, y in zip(written, audited, strict=True))
        out["prompts"] += len(prompts)
        progress(f"audit bench: {out['pages']} clean pages audited, largest error {out['max_error']:.3g}, "
                 f"{out['mismatches']} mismatches")
    return out


def _faults(fleet: _Fleet, seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each fault written by w, audited by b: the pages it mismatched and their smallest error."""
    out: dict[str, Any] = {}
    for i, fault in enumerate(FAULTS):
        p = _prompt(1200, seed + 17 * i)
        if fault == "failed_load":        # w's hit on a stored prefix "loads" zeros; the rest is stored
            fleet.w.complete(p[:769])
            time.sleep(1.5)
            fleet.w.reset_prefix_cache()
        else:                             # a clean step first (other_prefix takes its KV from it)
            fleet.w.complete(_prompt(300, seed + 1000 + i))
        fleet.faults.write_text(fault)
        try:
            fleet.w.complete(p)
        finally:
            fleet.faults.write_text("")
        time.sleep(1.5)
        before = fleet.summary("b")
        at = time.time()
        fleet.b.complete(p)
        s = _wait_pages(fleet, "b", before["pages"] + (len(p) - 1) // PAGE)
        hits = [m for m in s.get("recent", []) if m["at"] >= at - 0.5 and m["writer"].startswith("w")]
        out[fault] = {"pages_mismatched": _mismatched(s) - _mismatched(before),
                      "min_error": min((float(m["error"]) for m in hits), default=None),
                      "reasons": sorted({m["reason"] for m in hits})}
        progress(f"audit bench: fault {fault}: {out[fault]}")
    return out


def run(*, dtypes: tuple[str, ...] = ("float32", "bfloat16"), pages: int = 1000, seed: int = 1,
        model: str = "tiny", progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``pages``: clean pages to audit per dtype (at least)."""
    path = build_model(model)
    result: dict[str, Any] = {"bench": "audit", "model": model, "page_tokens": PAGE, "rows": {}}
    for dtype in dtypes:
        workdir = Path(tempfile.mkdtemp(prefix="pof-bench-audit-", dir="/tmp"))
        fleet = _Fleet(workdir, dtype, path)
        try:
            progress(f"audit bench: starting 3 vLLM servers ({dtype})")
            fleet.start()
            clean = _clean(fleet, pages, seed, progress)
            faults = _faults(fleet, seed, progress)
        finally:
            fleet.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        smallest = min((f["min_error"] for f in faults.values() if f["min_error"] is not None), default=None)
        result["rows"][dtype] = {
            "bound": DEFAULT_BOUNDS[dtype], "clean": clean, "faults": faults,
            "smallest_fault_error": smallest,
            "margin": None if smallest is None or not clean["max_error"] else round(smallest / clean["max_error"], 1),
            "caught_every_fault": all(f["pages_mismatched"] > 0 for f in faults.values()),
        }
    result["clean_pages"] = sum(r["clean"]["pages"] for r in result["rows"].values())
    result["false_alarms"] = sum(r["clean"]["mismatches"] for r in result["rows"].values())
    return result


def add_audit_parser(bsub: Any) -> None:
    p = bsub.add_parser("audit", help="the audit's tolerance: clean pages' errors against injected faults",
                        description="On real vLLM CPU servers: clean pages audited (0 mismatches expected) and "
                                    "each kind of wrong KV a writer bug stores, with the margin between them.")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    p.add_argument("--pages", type=int, default=1000, help="clean pages to audit per dtype (default 1000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd)


def _cmd(args: Any) -> int:
    from rich.table import Table

    from pof_connector.cli_support import out_console, print_json, progress

    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in DEFAULT_BOUNDS]
    if not dtypes or bad:
        raise SystemExit(f"--dtypes: allowed {', '.join(DEFAULT_BOUNDS)}, got {args.dtypes!r}")
    result = run(dtypes=dtypes, pages=args.pages, seed=args.seed, model=args.model, progress=progress)
    if args.json:
        print_json(result)
        return 1 if result["false_alarms"] else 0
    table = Table(title="audit: clean pages against injected faults", title_justify="left")
    for name in ("dtype", "bound", "clean pages", "largest clean error", "false alarms", "smallest fault error",
                 "margin", "every fault caught"):
        table.add_column(name, justify="left" if name == "dtype" else "right")
    for dtype, r in result["rows"].items():
        table.add_row(dtype, f"{r['bound']:g}", str(r["clean"]["pages"]), f"{r['clean']['max_error']:.3g}",
                      str(r["clean"]["mismatches"]), str(r["smallest_fault_error"]), str(r["margin"]),
                      str(r["caught_every_fault"]))
    out_console().print(table)
    return 1 if result["false_alarms"] else 0
