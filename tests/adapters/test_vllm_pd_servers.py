"""Prefill/decode disaggregation through the pool with real vLLM CPU servers: one prefill server,
one decode server (both with pof, one shared CXL region), a server without the connector for the
reference answers. The hand-off by hand (vLLM's own protocol), through the stock
``vllm-router --vllm-pd-disaggregation`` and through ``pof router``'s P/D mode: greedy answers
equal the reference, and the decode server loads the prompt's pages from the pool instead of
computing them."""

from __future__ import annotations

import json
import tempfile
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.vllm_server import VllmServer, connector_config, free_port
from tests.adapters.test_vllm import BLOCK, DTYPE, HITS, model, prompt, workdir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["model", "workdir"]      # module fixtures shared with test_vllm

MAX_TOKENS = 12


class Fleet:
    def __init__(self, prefill: VllmServer, decode: VllmServer, reference: VllmServer) -> None:
        self.prefill, self.decode, self.reference = prefill, decode, reference


@pytest.fixture(scope="module")
def fleet(model: Path, workdir: Path) -> Iterator[Fleet]:
    region = Path(tempfile.mkdtemp(prefix="pof-pd-", dir="/dev/shm")) / "cxl.region"
    tiers = {"cxl": {"path": str(region), "size": "256MiB", "partitions": 4}}

    def server(name: str) -> VllmServer:
        cfg = {"node_id": name, "index_url": "embedded", "runtime_dir": str(workdir / "rt-pd"), "tiers": tiers,
               "pd": {"wait_s": 20}}
        return VllmServer(model, workdir / f"pd-{name}", kv_transfer=connector_config(cfg), dtype=DTYPE)

    fleet = Fleet(server("p"), server("d"), VllmServer(model, workdir / "pd-ref", dtype=DTYPE))
    servers = (fleet.prefill, fleet.decode, fleet.reference)
    try:
        with ThreadPoolExecutor(3) as ex:
            list(ex.map(lambda s: s.start(timeout_s=900), servers))
        yield fleet
    finally:
        for s in servers:
            s.stop()
        region.unlink(missing_ok=True)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def body(p: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}


def tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


def test_handoff_by_hand_with_vllms_own_protocol(fleet: Fleet) -> None:
    """What every P/D proxy does: prefill with do_remote_decode and max_tokens 1, then decode with
    the kv_transfer_params the prefill's response carries."""
    p = prompt(3 * BLOCK + 1, seed=431)           # 3 full pages and the last token
    first = post(fleet.prefill.url, body(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    handoff = first["kv_transfer_params"]
    assert handoff["do_remote_prefill"] is True and handoff["pof_tokens"] == 3 * BLOCK, handoff
    assert handoff["pof_node"] == "p"
    hits = fleet.decode.metrics().get(HITS, 0)
    out = post(fleet.decode.url, body(p, kv_transfer_params=handoff))
    assert tokens(out) == tokens(post(fleet.reference.url, body(p)))
    assert fleet.decode.metrics()[HITS] - hits == 3 * BLOCK      # only the last token computed on decode


def test_stock_vllm_router_pd_mode(fleet: Fleet, workdir: Path) -> None:
    port = free_port()
    exe = str(Path(fleet.prefill.python).parent / "vllm-router")
    router = RouterProcess([exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                            "--prefill", fleet.prefill.url, "--decode", fleet.decode.url,
                            "--prometheus-port", str(free_port())], port, workdir / "vllm-router-pd.log")
    router.start(timeout_s=120)
    try:
        prompts = [prompt(2 * BLOCK + 1, seed=432), prompt(4 * BLOCK + 57, seed=433)]
        for p in prompts:
            hits = fleet.decode.metrics().get(HITS, 0)
            out = post(router.url, body(p))
            assert tokens(out) == tokens(post(fleet.reference.url, body(p))), router.tail()
            assert fleet.decode.metrics()[HITS] - hits == (len(p) - 1) // BLOCK * BLOCK, router.tail()
    finally:
        router.stop()


def test_pof_router_pd_mode(fleet: Fleet, workdir: Path) -> None:
    config = {"policy": "least_loaded", "prefill": [{"name": "p", "url": fleet.prefill.url}],
              "decode": [{"name": "d", "url": fleet.decode.url}]}
    router = RouterProcess.pof(workdir, config, name="pof-router-pd").start(timeout_s=120)
    try:
        p = prompt(3 * BLOCK + 1, seed=434)
        hits = fleet.decode.metrics().get(HITS, 0)
        req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body(p)).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            assert r.headers["x-pof-prefill"] == "p" and r.headers["x-pof-backend"] == "d"
            out = json.loads(r.read())
        assert tokens(out) == tokens(post(fleet.reference.url, body(p))), router.tail()
        assert fleet.decode.metrics()[HITS] - hits == 3 * BLOCK, router.tail()
    finally:
        router.stop()
