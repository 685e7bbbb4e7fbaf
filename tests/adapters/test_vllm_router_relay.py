"""A stock ``vllm-router --policy kv_aware`` fed by pof relays prefers the node whose pool holds a
prefix its engine has dropped: the relay stream carries the engine's events and, after the
engine's clear, the pool's pages as host memory. Real vLLM CPU servers with the pof connector and
KV events on, real relays (``pof relay`` processes), real router binaries; which server served a
request is read from the servers' own metrics. The control is the same router fed by relays that forward only the
engines' events (``--no-pool-residency``): in the same state it prefers node b, whose engine holds
one block of the prompt.
Every process is stopped by its PID."""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.service_process import ServiceProcess
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config, free_port
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.relay.kv_events import AllBlocksCleared, BlockStored, decode_batch
from tests.adapters.server_workdir import server_workdir
from tests.adapters.test_vllm import DTYPE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
REPO = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = "vllm:prompt_tokens_total"
HITS = "vllm:external_prefix_cache_hits_total"


def prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1900) for _ in range(n)]


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.2)


_heard: dict[int, dict[str, int]] = {}


def listen(tap: zmq.Socket[bytes]) -> dict[str, int]:
    """What ``tap`` heard since :func:`reset_engine` last drained it: clears, and blocks announced
    as host memory (medium CPU) after a clear."""
    heard = _heard.setdefault(id(tap), {"cleared": 0, "host": 0})
    while tap.poll(100):
        _, _, payload = tap.recv_multipart()
        for ev in decode_batch(payload).events:
            if isinstance(ev, AllBlocksCleared):
                heard.update(cleared=1, host=0)
            elif isinstance(ev, BlockStored) and ev.medium == "CPU" and heard["cleared"]:
                heard["host"] += len(ev.block_hashes)
    return heard


def reset_engine(server: VllmServer, tap: zmq.Socket[bytes]) -> None:
    """Drop the engine's prefix cache and make sure routers heard it: vLLM publishes the clear with
    its next step's events, and refuses a reset while blocks are still in use, so retry."""
    for _ in range(5):
        while tap.poll(0):
            tap.recv_multipart()
        _heard[id(tap)] = {"cleared": 0, "host": 0}
        server.reset_prefix_cache()
        complete(server.url, [5, 6, 7])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if listen(tap)["cleared"]:
                return
        time.sleep(1)
    raise AssertionError("the engine's prefix-cache reset never reached its relay's stream")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def complete(base: str, p: list[int]) -> str:
    # Not ``return_token_ids``: vllm-router 0.1.17 gives a request that asks for it no KV credit at all.
    body = {"model": "m", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return str(post(base + "/v1/completions", body)["choices"][0]["text"])


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from server_workdir(request, "pof-vrr-")


def test_stock_router_prefers_the_node_whose_pool_holds_the_prefix(workdir: Path,
                                                                   redis_server: RedisServer) -> None:
    model = build_model("tiny")
    servers: dict[str, VllmServer] = {}
    events: dict[str, str] = {}
    configs: dict[str, Path] = {}
    for name in ("a", "b"):
        port = free_port()
        events[name] = f"tcp://127.0.0.1:{port}"
        cfg = {"node_id": name, "index_url": redis_server.url, "tiers": {"cpu_dram": {"size": "256MiB"}}}
        configs[name] = workdir / f"{name}.json"
        configs[name].write_text(json.dumps(cfg))
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": ""}
        servers[name] = VllmServer(model, workdir / name, kv_transfer=connector_config(cfg), dtype=DTYPE,
                                   extra_args=["--kv-events-config", json.dumps(kv_events)],
                                   env={"PYTHONPATH": str(REPO)})
    procs: list[ServiceProcess] = []
    codes: dict[str, int | None] = {}
    routers: list[RouterProcess] = []
    tap: zmq.Socket[bytes] | None = None
    tap2: zmq.Socket[bytes] | None = None
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), servers.values()))
        a, b = servers["a"], servers["b"]

        def relay(name: str, pool: bool) -> str:
            bind = f"tcp://127.0.0.1:{free_port()}"
            args = [sys.executable, "-m", "pof_connector.cli", "relay", "--config", str(configs[name]),
                    "--engine-events", events[name], "--bind", bind, "--poll-s", "0.2", "--refresh-s", "2",
                    "--engine-url", servers[name].url]
            if not pool:
                args.append("--no-pool-residency")
            proc = ServiceProcess(workdir / f"relay-{name}-{'pool' if pool else 'engine'}.log")
            proc.launch(args, env={"PYTHONPATH": str(REPO)})
            procs.append(proc)
            return bind

        def router(relays: dict[str, str], tag: str) -> str:
            # b first: with nothing to tell the workers apart, the router's tie goes to the first one.
            extra = ["--kv-event-block-size", str(BLOCK), "--kv-event-model", "m", "--router-temperature", "0"]
            for name in ("b", "a"):
                extra += ["--kv-event-source", f"{servers[name].url}={relays[name]}"]
            r = RouterProcess.vllm_router(workdir, [b.url, a.url], "kv_aware", extra, name=f"router-{tag}")
            routers.append(r.start(timeout_s=120))
            return r.url

        pool_relays = {n: relay(n, True) for n in ("a", "b")}
        # What the router hears from a's relay, heard here too (a subscriber of the same stream).
        ctx = zmq.Context.instance()
        tap = ctx.socket(zmq.SUB)
        tap.setsockopt(zmq.SUBSCRIBE, b"")
        tap.connect(pool_relays["a"])
        with_pool = router(pool_relays, "pool")
        engine_relays = {n: relay(n, False) for n in ("a", "b")}
        tap2 = ctx.socket(zmq.SUB)
        tap2.setsockopt(zmq.SUBSCRIBE, b"")
        tap2.connect(engine_relays["a"])
        engine_only = router(engine_relays, "engine")
        index = RedisIndex(redis_server.url, None)
        wait_for(lambda: {"a:engine", "b:engine"} <= {n.node_id for n in index.nodes()}, 30, "relays registered")
        time.sleep(3)                                     # ZMQ subscribers join; relays re-send every 2 s anyway

        def served_by(router_url: str, p: list[int]) -> tuple[str, str]:
            before = {n: s.metrics()[PROMPT_TOKENS] for n, s in servers.items()}
            out = complete(router_url, p)
            grew = [n for n, s in servers.items() if s.metrics()[PROMPT_TOKENS] > before[n]]
            assert len(grew) == 1, grew
            return grew[0], out

        p = prompt(1000, seed=3)
        direct = complete(a.url, p)                        # a computes the prefix; its pool stores 7 pages
        keys_a = next(n for n in index.nodes() if n.node_id == "a")
        assert keys_a.meta["page_tokens"] == str(BLOCK)
        complete(b.url, p[:130])                          # b's engine holds the first block of the prompt
        time.sleep(3)                                      # store threads publish; relays announce

        # a's engine forgets; a's pool still holds all 7 pages, b's engine holds one block. Fed by the
        # engines' events alone a router can only prefer b; pool residency makes a the better node
        # (7 pages at the host credit 0.8 against one device block).
        reset_engine(a, tap)
        wait_for(lambda: listen(tap)["host"] >= 7, 30, "a's relay re-announcing its pool after the reset")
        time.sleep(0.5)                                   # the router's subscriber reads the same batch
        hits = a.metrics()[HITS]
        node, out = served_by(with_pool, p)
        assert node == "a", "fed by pof's relays, vllm-router should prefer a, whose pool holds the prefix"
        assert a.metrics()[HITS] - hits == 896             # and a served it from its pool
        assert out == direct

        reset_engine(a, tap2)                             # the same state again: a's engine empty, pool full
        time.sleep(0.5)
        node, out = served_by(engine_only, p)
        assert node == "b", "fed by the engines' events only, the router should prefer b (one block on its device)"
        assert out == direct
        def loads() -> dict[str, EngineLoad | None]:
            return {n.node_id: EngineLoad.from_meta(n.meta) for n in index.nodes()}

        assert loads()["a:engine"] is not None and loads()["b:engine"] is not None   # read from the engines
        # The relays read /metrics once a heartbeat: the last one may have caught b still running.
        def idle(load: EngineLoad | None) -> bool:
            return load is not None and (load.running, load.waiting) == (0, 0)

        wait_for(lambda: idle(loads()["a:engine"]) and idle(loads()["b:engine"]), 15, "idle engines' load")
        for load in (loads()["a:engine"], loads()["b:engine"]):     # the KV figures the router's capacity rule reads
            assert load is not None and load.block_tokens == BLOCK and load.kv_usage is not None, load
            assert load.kv_capacity_tokens and load.kv_capacity_tokens > 0 and load.preemptions == 0, load
        index.close()
    finally:
        for t in (tap, tap2):
            if t is not None:
                t.close(linger=0)
        for r in routers:
            r.stop()
        for proc in procs:
            codes[proc.log.name] = proc.stop(grace_s=15)
        for s in servers.values():
            s.stop()
    for proc in procs:            # relays leave the index and exit cleanly on SIGTERM
        assert codes[proc.log.name] == 0, proc.tail()
