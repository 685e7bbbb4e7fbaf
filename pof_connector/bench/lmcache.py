"""``pof bench lmcache``: LMCache with its ``local_cpu`` backend alone vs. LMCache + pof's storage
plugin, put and get of the same chunks in the same run.

Three processes of LMCache's own engine (:mod:`pof_connector.bench.lmcache_node`), one after the
other, each with the same chunks (``rounds`` prompts of ``chunks`` chunks, new bytes per round):

* ``local_cpu``: LMCache alone stores the chunks and retrieves them from its ``local_cpu``
  backend — the baseline, the fastest LMCache gets;
* ``pof put``: LMCache + pof (node A, a CXL region under /dev/shm): the store as LMCache sees it
  (``put_s``; pof copies in the background) and until pof wrote and published every chunk
  (``in_pof_s``);
* ``pof get``: another process, LMCache + pof (node B) with an empty ``local_cpu``: lookup and
  retrieve, every chunk from A's pages through the index and the shared region — what an LMCache
  instance gains from pof (without pof it would recompute).

Ratios are medians of pof / medians of ``local_cpu`` (above 1: slower); ``ratio`` is ``ratio_get``.
The node processes need the LMCache venv (ci/lmcache_venv.sh): ``--python`` names its interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError
from pof_connector.index.embedded import stop_embedded

REPO = Path(__file__).resolve().parents[2]
Progress = Callable[[str], None]


def _env() -> dict[str, str]:
    # PYTHONHASHSEED: without vLLM, LMCache hashes chunks with hash() (see lmcache_node.write_config).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING",
            "LMCACHE_TRACK_USAGE": "false"}


def stop_node(proc: subprocess.Popen[str], *, timeout_s: float) -> None:
    """Stop a node started with a stdin pipe: closing it is its signal to leave (it withdraws its
    pages and closes its pool); SIGKILL when it has not left within ``timeout_s``, then reap it."""
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _node(python: str, args: dict[str, Any]) -> list[str]:
    return [python, "-m", "pof_connector.bench.lmcache_node", json.dumps(args)]


def _last_json(text: str, what: str, err: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if not lines:
        raise BenchError(f"{what} printed no result: {err[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def run(*, python: str, chunks: int, rounds: int, layers: int, heads: int, head_dim: int, chunk_tokens: int,
        progress: Progress) -> dict[str, Any]:
    from pof_connector.bench.lmcache_node import Shape, write_config

    shape = Shape(layers, heads, head_dim, chunk_tokens)
    data = shape.chunk_bytes * chunks * rounds
    work = Path(tempfile.mkdtemp(prefix="pof-bench-lmc-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="pof-bench-lmc-", dir="/dev/shm"))
    runtime_dir = str(work / "rt")
    region = str(shm / "region.cxl")
    # Every CXL partition (8) must hold one node's chunks; LMCache's buffer all of them.
    region_size = f"{max(64, 8 * 2 * data // (1 << 20))}MiB"
    local_gb = max(0.25, 2 * data / 1e9)
    common = dict(index_url="embedded", runtime_dir=runtime_dir, region=region, shape=shape, local_cpu_gb=local_gb,
                  region_size=region_size)
    node = {"chunks": chunks, "rounds": rounds, "seed": 1, "shape": shape.__dict__}
    a_proc: subprocess.Popen[str] | None = None
    try:
        base_cfg = write_config(work / "base.yaml", node="base", plugin=False, **common)  # type: ignore[arg-type]
        a_cfg = write_config(work / "a.yaml", node="a", **common)  # type: ignore[arg-type]
        b_cfg = write_config(work / "b.yaml", node="b", **common)  # type: ignore[arg-type]
        progress(f"lmcache: local_cpu alone, {rounds} x {chunks} chunks of {shape.chunk_bytes >> 10} KiB")
        done = subprocess.run(_node(python, {**node, "config": str(base_cfg), "op": "both", "instance": "base"}),
                              capture_output=True, text=True, env=_env(), timeout=900)
        base = _last_json(done.stdout, "local_cpu node", done.stderr)
        progress("lmcache: LMCache + pof, node A stores")
        a_proc = subprocess.Popen(_node(python, {**node, "config": str(a_cfg), "op": "store", "instance": "a"}),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=_env())
        assert a_proc.stdout is not None
        put = _last_json(a_proc.stdout.readline(), "pof node A", "")
        progress("lmcache: LMCache + pof, node B (another process) retrieves")
        done = subprocess.run(_node(python, {**node, "config": str(b_cfg), "op": "load", "instance": "b"}),
                              capture_output=True, text=True, env=_env(), timeout=900)
        get = _last_json(done.stdout, "pof node B", done.stderr)
    finally:
        if a_proc is not None:
            stop_node(a_proc, timeout_s=60)
        stop_embedded(runtime_dir)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    per_round = shape.chunk_bytes * chunks
    full = chunks * shape.chunk
    return {
        "bench": "lmcache", "chunk_bytes": shape.chunk_bytes, "chunks": chunks, "rounds": rounds,
        "shape": shape.__dict__,
        "local_cpu": {"put_s": base["put_s"], "get_s": base["get_s"], "put_gbps": _gbps(per_round, base["put_s"]),
                      "get_gbps": _gbps(per_round, base["get_s"]), "retrieved_tokens": base["retrieved_tokens"],
                      "bytes_equal": base["bytes_equal"]},
        "pof": {"put_s": put["put_s"], "in_pof_s": put["in_pof_s"], "get_s": get["get_s"],
                "put_gbps": _gbps(per_round, put["put_s"]), "in_pof_gbps": _gbps(per_round, put["in_pof_s"]),
                "get_gbps": _gbps(per_round, get["get_s"]), "retrieved_tokens": get["retrieved_tokens"],
                "bytes_equal": get["bytes_equal"], "loaded_pages": get["stats"].get("loaded_pages", 0)},
        "ratio": statistics.median(get["get_s"]) / statistics.median(base["get_s"]),   # the headline: ratio_get
        "ratio_put": statistics.median(put["put_s"]) / statistics.median(base["put_s"]),
        "ratio_in_pof": statistics.median(put["in_pof_s"]) / statistics.median(base["put_s"]),
        "ratio_get": statistics.median(get["get_s"]) / statistics.median(base["get_s"]),
        "all_retrieved": base["retrieved_tokens"] == full and get["retrieved_tokens"] == full,
    }
