"""The copy crew's throughput before and after a helper stopped writing pages the caller took over.

Builds ``pof_connector/pages/_pagesum.c`` at two git revisions into a temporary directory and times
``kt_copy_pages`` on one thread and with one helper (threads=2), three rounds of 30 calls each, in
alternation. Run from the repository root: ``python docs/bench/crew-late-write-2026-12-06.py
BEFORE AFTER`` (two revisions; AFTER may be ``WORKTREE``). Prints one JSON object: GB/s of copied
page bytes (median per round) for each build and thread count.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np


def build(rev: str, where: Path) -> ModuleType:
    src = where / f"{rev}.c"
    if rev == "WORKTREE":
        src.write_text(Path("pof_connector/pages/_pagesum.c").read_text())
    else:
        src.write_text(subprocess.run(["git", "show", f"{rev}:pof_connector/pages/_pagesum.c"], check=True,
                                      capture_output=True, text=True).stdout)
    so = where / rev / "_pagesum.so"
    so.parent.mkdir()
    subprocess.run(["gcc", "-O3", "-pthread", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(src),
                    "-o", str(so)], check=True)
    spec = importlib.util.spec_from_file_location("_pagesum", so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    before, after = sys.argv[1:3]
    out: dict[str, object] = {"revisions": [before, after]}
    with tempfile.TemporaryDirectory() as tmp:
        mods = {before: build(before, Path(tmp)), after: build(after, Path(tmp))}
        # (block tokens, KV heads, head dim, item size, blocks a page, pages): a bf16 8-head rank's
        # layer in 16-token pages, and the fp32 2-block pages of the tests
        for N, H, D, isz, bpp, pages in ((16, 8, 128, 2, 1, 128), (16, 8, 128, 4, 2, 64)):
            half = N * H * D * isz
            rng = np.random.default_rng(0)
            segs = [rng.integers(0, 256, 2 * bpp * half, dtype=np.uint8) for _ in range(pages)]
            cache = np.zeros(pages * bpp * 2 * half, dtype=np.uint8)
            jobs = [(s, list(range(i * bpp, (i + 1) * bpp)), 0, 7) for i, s in enumerate(segs)]
            rows: dict[str, list[float]] = {}
            for _ in range(3):
                for name, mod in mods.items():
                    for threads in (1, 2):
                        mod.kt_copy_pages(cache, jobs, N, H, D, isz, 0, threads)
                        times = []
                        for _ in range(30):
                            t0 = time.perf_counter()
                            mod.kt_copy_pages(cache, jobs, N, H, D, isz, 0, threads)
                            times.append(time.perf_counter() - t0)
                        rows.setdefault(f"{name} threads={threads}", []).append(
                            round(pages * 2 * bpp * half / float(np.median(times)) / 1e9, 2))
            out[f"{N}x{H}x{D}x{isz}B, {bpp} block(s) a page, {pages} pages"] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
