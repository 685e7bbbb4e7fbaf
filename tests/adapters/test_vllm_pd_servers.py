"""Prefill/decode disaggregation through the pool with real vLLM CPU servers: two prefill servers
and two decode servers, all with pof and one shared CXL region, and answers of a server without
the connector as the reference. 1P1D and 2P2D, the hand-off by hand (vLLM's own protocol),
through the stock ``vllm-router --vllm-pd-disaggregation`` and through ``pof router``'s P/D mode:
greedy answers equal the reference, the decode server loads the prompt's pages from the pool and
computes only the tail (the last partial page; one token for the prompts here).

Then the faults of issue 43, each on these servers: pages that went bad in the pool before the
decode read them, pages the index names but a new writer took over, pages that never arrive (the
decode's wait runs out), the index down between the two halves, a prefill server killed in the
middle of a hand-off. The rule for all of them: the decode computes what the pool cannot give,
the answer is the reference's, nothing crashes and nothing hangs.

Five servers would be one too many for the test machines: the reference server starts with three
of the pof servers, answers every prompt of this module, and stops before the fourth starts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import tempfile
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.chaos_faults import _SUPER
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.vllm_server import VllmServer, connector_config, free_port
from pof_connector.index.embedded import stop_embedded
from tests.adapters.test_vllm import BLOCK, DTYPE, HITS, model, prompt, workdir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["model", "workdir"]      # module fixtures shared with test_vllm

MAX_TOKENS = 12
WAIT_S = 10.0
"""The decode servers' ``pd.wait_s`` (the default): how long a decode request waits for pages its
prefill named. (The rare whole-prompt decode this module once saw was not the wait: vLLM's CPU
worker bound every server's threads, pof's heartbeat and the embedded index server to core 0,
and a waiting decode's busy worker starved the other servers' heartbeats until their
registrations lapsed; see pof_connector/cpu_affinity.py.)"""

PROMPTS: dict[str, tuple[int, int]] = {
    # name: (tokens, seed). n*BLOCK + 1 tokens: n whole pages for the pool and the last token,
    # which the decode server must compute itself (vLLM needs its logits).
    "by_hand": (3 * BLOCK + 1, 431),
    "stock_1p1d_a": (2 * BLOCK + 1, 432), "stock_1p1d_b": (4 * BLOCK + 57, 433),
    **{f"stock_2p2d_{i}": ((2 + i % 3) * BLOCK + 1, 440 + i) for i in range(6)},
    "pof_1p1d": (3 * BLOCK + 1, 434),
    **{f"pof_2p2d_{i}": ((2 + i % 3) * BLOCK + 1, 450 + i) for i in range(6)},
    "pof_2p2d_stream": (3 * BLOCK + 1, 459), "pof_short": (BLOCK + 1, 466), "pof_not_short": (2 * BLOCK + 1, 467),
    "corrupt": (3 * BLOCK + 1, 460), "taken_over": (3 * BLOCK + 1, 461), "never_came": (3 * BLOCK + 1, 462),
    "index_down": (3 * BLOCK + 1, 463), "killed_after": (3 * BLOCK + 1, 464), "killed_during": (3 * BLOCK + 1, 465),
}


def P(name: str) -> list[int]:
    n, seed = PROMPTS[name]
    return prompt(n, seed)


def pool_tokens(p: list[int]) -> int:
    return (len(p) - 1) // BLOCK * BLOCK


class Fleet:
    def __init__(self, prefill: list[VllmServer], decode: list[VllmServer], runtime_dir: Path,
                 region: Path) -> None:
        self.prefill, self.decode = prefill, decode
        self.runtime_dir, self.region = runtime_dir, region
        self.reference: dict[str, list[int]] = {}

    def ref(self, name: str) -> list[int]:
        return self.reference[name]


@pytest.fixture(scope="module")
def fleet(model: Path, workdir: Path) -> Iterator[Fleet]:
    region = Path(tempfile.mkdtemp(prefix="pof-pd-", dir="/dev/shm")) / "cxl.region"
    tiers = {"cxl": {"path": str(region), "size": "256MiB", "partitions": 4}}
    rt = workdir / "rt-pd"

    def server(name: str) -> VllmServer:
        cfg = {"node_id": name, "index_url": "embedded", "runtime_dir": str(rt), "tiers": tiers,
               "pd": {"wait_s": WAIT_S},
               # Every ordinary pool hit audited: a decode must still load, never compute its prompt.
               # (At the default 1%, an audited decode once in a while was this module's flake.)
               "audit": {"sample_rate": 1.0}}
        return VllmServer(model, workdir / f"pd-{name}", kv_transfer=connector_config(cfg), dtype=DTYPE)

    fleet = Fleet([server("p1"), server("p2")], [server("d1"), server("d2")], rt, region)
    reference = VllmServer(model, workdir / "pd-ref", dtype=DTYPE)
    first = [reference, *fleet.prefill, fleet.decode[0]]
    try:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda s: s.start(timeout_s=900), first))
        for name in PROMPTS:
            fleet.reference[name] = reference.complete(P(name), MAX_TOKENS)
        reference.stop()
        fleet.decode[1].start(timeout_s=900)
        yield fleet
    finally:
        for s in (reference, *fleet.prefill, *fleet.decode):
            s.stop()
        stop_embedded(rt)
        region.unlink(missing_ok=True)
        region.parent.rmdir()


# ---- HTTP and metrics ---------------------------------------------------------------------------

def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if headers is not None:
            headers.update({k.lower(): v for k, v in r.headers.items()})
        out: dict[str, Any] = json.loads(r.read())
        return out


def body(p: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}


def tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


def handoff_from(prefill: VllmServer, p: list[int]) -> dict[str, Any]:
    first = post(prefill.url, body(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params: dict[str, Any] = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["pof_tokens"] == pool_tokens(p), params
    return params


class Counts:
    """What a server's /metrics say it did with prompts: tokens the connector offered (vLLM's own
    external-hit counter, counted when vLLM schedules the request, so before the load), tokens
    it scheduled to compute itself (``prompt_tokens_by_source`` local_compute, also counted then),
    prompt tokens in all, pages pof read and validated, and pages pof rejected (which vLLM then
    recomputes)."""

    def __init__(self, server: VllmServer) -> None:
        m = server.metrics(["vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_by_source_total",
                            "vllm:prompt_tokens_total", "vllm:pof_load_failures_total",
                            "vllm:pof_loaded_pages_total"])
        self.loaded = m.get(HITS, 0.0)
        self.computed = sum(v for k, v in m.items() if 'source="local_compute"' in k)
        self.prompt = m.get("vllm:prompt_tokens_total", 0.0)
        self.failures = m.get("vllm:pof_load_failures_total", 0.0)
        self.pages = m.get("vllm:pof_loaded_pages_total", 0.0)

    def __sub__(self, other: Counts) -> dict[str, float]:
        return {k: getattr(self, k) - getattr(other, k) for k in ("loaded", "computed", "prompt", "failures", "pages")}


def counts(servers: list[VllmServer]) -> list[Counts]:
    return [Counts(s) for s in servers]


def moved(after: list[Counts], before: list[Counts]) -> list[dict[str, float]]:
    return [a - b for a, b in zip(after, before, strict=True)]


def log_marks(fleet: Fleet) -> list[int]:
    """Where each pof server's log ends now (see :func:`pof_lines_since`)."""
    return [s.log.stat().st_size if s.log.exists() else 0 for s in (*fleet.prefill, *fleet.decode)]


def pof_lines_since(fleet: Fleet, marks: list[int]) -> str:
    """The pof connector's log lines each server wrote since ``marks``."""
    out = []
    for s, mark in zip((*fleet.prefill, *fleet.decode), marks, strict=True):
        with open(s.log, "rb") as f:
            f.seek(mark)
            out += [f"{s.log.parent.name}: {line}" for line in f.read().decode(errors="replace").splitlines()
                    if "pof: " in line or "pof_connector" in line]
    return "\n".join(out)


def assert_decoded_from_pool(deltas: list[dict[str, float]], p: list[int], where: int | None = None) -> int:
    """Exactly one decode server took the request (``where``, when the router said which): it
    loaded the prompt's whole pages from the pool and computed only the rest; the other did nothing.
    Returns which one."""
    took = [i for i, d in enumerate(deltas) if d["prompt"]]
    assert len(took) == 1, deltas
    i = took[0]
    assert where is None or i == where, deltas
    assert deltas[i]["loaded"] == pool_tokens(p), deltas
    assert deltas[i]["computed"] == len(p) - pool_tokens(p), deltas      # no prefill on decode
    assert deltas[i]["pages"] == pool_tokens(p) // BLOCK and deltas[i]["failures"] == 0, deltas
    return i


# ---- 1P1D and 2P2D ------------------------------------------------------------------------------

def test_handoff_by_hand_with_vllms_own_protocol(fleet: Fleet) -> None:
    """What every P/D proxy does: prefill with do_remote_decode and max_tokens 1, then decode with
    the kv_transfer_params the prefill's response carries."""
    p = P("by_hand")
    handoff = handoff_from(fleet.prefill[0], p)
    assert handoff["pof_node"] == "p1"
    before = counts(fleet.decode)
    assert tokens(post(fleet.decode[0].url, body(p, kv_transfer_params=handoff))) == fleet.ref("by_hand")
    assert_decoded_from_pool(moved(counts(fleet.decode), before), p, where=0)


def stock_router(fleet: Fleet, workdir: Path, prefill: list[VllmServer], decode: list[VllmServer],
                 name: str) -> RouterProcess:
    port = free_port()
    exe = str(Path(fleet.prefill[0].python).parent / "vllm-router")
    args = [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--policy", "round_robin",
            "--prometheus-port", str(free_port())]
    for s in prefill:
        args += ["--prefill", s.url]
    for s in decode:
        args += ["--decode", s.url]
    return RouterProcess(args, port, workdir / f"{name}.log").start(timeout_s=120)


@pytest.mark.parametrize("shape", ["1p1d", "2p2d"])
def test_stock_vllm_router_pd_mode(fleet: Fleet, workdir: Path, shape: str) -> None:
    n = 1 if shape == "1p1d" else 2
    router = stock_router(fleet, workdir, fleet.prefill[:n], fleet.decode[:n], f"vllm-router-{shape}")
    try:
        names = [k for k in PROMPTS if k.startswith(f"stock_{shape}")]
        took_p, took_d = set(), set()
        missed: list[dict[str, float]] = []
        for name in names:
            p = P(name)
            before, before_p = counts(fleet.decode), counts(fleet.prefill)
            marks = log_marks(fleet)
            assert tokens(post(router.url, body(p))) == fleet.ref(name), router.tail()
            deltas = moved(counts(fleet.decode), before)
            took = [i for i, d in enumerate(deltas) if d["prompt"]]
            if len(took) == 1 and deltas[took[0]]["loaded"] == 0 and deltas[took[0]]["failures"] == 0:
                # The decode computed the whole prompt: a right answer without a pool load, as when
                # a prefill server's registration lapsed (see WAIT_S). At most one per shape, and
                # the servers' pof log lines of that request are shown, so it says why.
                missed.append(deltas[took[0]])
                took_d.add(took[0])
                warnings.warn(f"P/D decode computed the whole prompt ({name}, {shape}): {deltas[took[0]]}\n"
                              + pof_lines_since(fleet, marks), stacklevel=1)
            else:
                took_d.add(assert_decoded_from_pool(deltas, p))
            prefilled = [i for i, d in enumerate(moved(counts(fleet.prefill), before_p)) if d["prompt"]]
            assert len(prefilled) == 1, prefilled
            took_p.add(prefilled[0])
        assert len(missed) <= 1, missed
        assert took_p == took_d == set(range(n))     # every prefill and every decode server took requests
    finally:
        router.stop()


def pof_router(workdir: Path, prefill: list[VllmServer], decode: list[VllmServer], name: str,
               **extra: Any) -> RouterProcess:
    config = {"policy": "least_loaded", **extra,
              "prefill": [{"name": f"p{i + 1}", "url": s.url} for i, s in enumerate(prefill)],
              "decode": [{"name": f"d{i + 1}", "url": s.url} for i, s in enumerate(decode)]}
    return RouterProcess.pof(workdir, config, name=name).start(timeout_s=120)


@pytest.mark.parametrize("shape", ["1p1d", "2p2d"])
def test_pof_router_pd_mode(fleet: Fleet, workdir: Path, shape: str) -> None:
    n = 1 if shape == "1p1d" else 2
    router = pof_router(workdir, fleet.prefill[:n], fleet.decode[:n], f"pof-router-{shape}")
    try:
        names = [k for k in PROMPTS if k.startswith(f"pof_{shape}") and not k.endswith("stream")]
        if n == 2:
            # Requests at once, so the router spreads them (by queue and KV room) over both of each.
            before, marks = counts(fleet.decode), log_marks(fleet)
            with ThreadPoolExecutor(len(names)) as ex:
                outs = list(ex.map(lambda k: (k, *routed(router, P(k))), names))
            deltas = moved(counts(fleet.decode), before)
            assert sum(d["loaded"] for d in deltas) == sum(pool_tokens(P(k)) for k in names), \
                (deltas, pof_lines_since(fleet, marks))
            assert sum(d["computed"] for d in deltas) == len(names), deltas          # one token each
            assert sum(d["pages"] for d in deltas) == sum(pool_tokens(P(k)) for k in names) // BLOCK, deltas
            for k, got, h in outs:
                assert got == fleet.ref(k), (k, router.tail())
                assert h["x-pof-prefill"] in ("p1", "p2") and h["x-pof-backend"] in ("d1", "d2"), h
            assert {h["x-pof-prefill"] for _, _, h in outs} == {"p1", "p2"}, outs
            assert {h["x-pof-backend"] for _, _, h in outs} == {"d1", "d2"}, outs
            # One at a time: the decode server the router names loaded the pages, computed one token.
            names = ["pof_2p2d_stream"]
        for k in names:
            p = P(k)
            before = counts(fleet.decode)
            got, h = routed(router, p, stream=k.endswith("stream"))
            assert got == fleet.ref(k), router.tail()
            assert h["x-pof-prefill"].startswith("p"), h
            assert_decoded_from_pool(moved(counts(fleet.decode), before), p, where=int(h["x-pof-backend"][1]) - 1)
    finally:
        router.stop()


def test_pof_router_computes_prompts_under_pd_min_prefill_tokens_on_the_decode_server(fleet: Fleet,
                                                                                     workdir: Path) -> None:
    router = pof_router(workdir, fleet.prefill[:1], fleet.decode[:1], "pof-router-split",
                        pd_min_prefill_tokens=2 * BLOCK)
    try:
        before = counts(fleet.decode)
        got, h = routed(router, P("pof_short"))
        assert got == fleet.ref("pof_short") and h["x-pof-prefill"] == "none:short-prompt", h
        d = moved(counts(fleet.decode), before)[0]
        assert d["computed"] == len(P("pof_short")) and d["loaded"] == 0, d        # co-located on d1
        before = counts(fleet.decode)
        got, h = routed(router, P("pof_not_short"))
        assert got == fleet.ref("pof_not_short") and h["x-pof-prefill"] == "p1", h
        assert_decoded_from_pool(moved(counts(fleet.decode), before), P("pof_not_short"), where=0)
    finally:
        router.stop()


def routed(router: RouterProcess, p: list[int], stream: bool = False) -> tuple[list[int], dict[str, str]]:
    """The greedy answer through ``router`` and its headers; streamed: token ids from the chunks."""
    headers: dict[str, str] = {}
    if not stream:
        return tokens(post(router.url, body(p), headers)), headers
    req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body(p, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    got: list[int] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        headers.update({k.lower(): v for k, v in r.headers.items()})
        for line in r:
            text = line.decode().strip()
            if text.startswith("data: {"):
                got += json.loads(text[6:])["choices"][0].get("token_ids") or []
    return got, headers


# ---- faults -------------------------------------------------------------------------------------

def generations(region: Path) -> list[int]:
    with open(region, "rb") as f:
        _, _, _, _, num_slots, gens_at, _, _ = _SUPER.unpack(f.read(_SUPER.size))
        f.seek(gens_at)
        return list(struct.unpack(f"<{num_slots}Q", f.read(8 * num_slots)))


def written_by(region: Path, before: list[int]) -> list[int]:
    """Slots whose generation changed since ``before``: the pages written meanwhile."""
    return [i for i, (a, b) in enumerate(zip(generations(region), before, strict=True)) if a != b]


def flip_a_bit(region: Path, slot: int, rnd: random.Random) -> None:
    with open(region, "r+b") as f:
        _, _, _, slot_bytes, _, _, data_at, _ = _SUPER.unpack(f.read(_SUPER.size))
        at = data_at + slot * slot_bytes + rnd.randrange(1024, 100_000)    # in the KV (a page here: 128 B + 2 x 64 KiB)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ (1 << rnd.randrange(8))]))


def settled_handoff(fleet: Fleet, prefill: VllmServer, p: list[int]) -> tuple[dict[str, Any], list[int]]:
    """The prefill half of ``p`` and the slots its pages took (after its store thread wrote them)."""
    gens = generations(fleet.region)
    handoff = handoff_from(prefill, p)
    deadline = time.monotonic() + 30
    while len(slots := written_by(fleet.region, gens)) < pool_tokens(p) // BLOCK:
        assert time.monotonic() < deadline, slots
        time.sleep(0.1)
    return handoff, slots


def decode_recomputes(fleet: Fleet, name: str, handoff: dict[str, Any], decode: int = 0,
                      failures: int | None = None) -> tuple[dict[str, float], float]:
    """The decode half of ``name`` on ``fleet.decode[decode]``: the reference's answer, the
    server still healthy; returns its counter deltas and how long it took."""
    p, server = P(name), fleet.decode[decode]
    before = Counts(server)
    t0 = time.monotonic()
    assert tokens(post(server.url, body(p, kv_transfer_params=handoff))) == fleet.ref(name), server.tail()
    took = time.monotonic() - t0
    d = Counts(server) - before
    assert d["prompt"] == len(p) and d["loaded"] + d["computed"] == len(p), d
    if failures is not None:
        assert d["failures"] >= failures, d
    assert server.alive()
    urllib.request.urlopen(server.url + "/health", timeout=10).close()
    return d, took


def test_pages_that_went_bad_in_the_pool_are_recomputed(fleet: Fleet) -> None:
    """A bit flips in each of the prompt's pages between the prefill's store and the decode's load:
    every page fails its checksum, the decode computes the whole prompt."""
    handoff, slots = settled_handoff(fleet, fleet.prefill[0], P("corrupt"))
    rnd = random.Random(43)
    for s in slots:
        flip_a_bit(fleet.region, s, rnd)
    d, _ = decode_recomputes(fleet, "corrupt", handoff, failures=1)
    assert d["pages"] == 0 and d["failures"] == len(slots), d      # every page refused: all recomputed


def test_pages_another_writer_took_over_are_recomputed(fleet: Fleet) -> None:
    """The pages' slots are evicted and taken by new writers after the index named them: each slot's
    generation moves on and it holds another (valid, checksummed) page. The key and generation
    checks refuse them all; the decode computes the prompt."""
    handoff, slots = settled_handoff(fleet, fleet.prefill[1], P("taken_over"))
    with open(fleet.region, "r+b") as f:
        _, _, _, slot_bytes, _, gens_at, data_at, _ = _SUPER.unpack(f.read(_SUPER.size))
        pages = []
        for s in slots:
            f.seek(data_at + s * slot_bytes)
            pages.append(f.read(slot_bytes))
        for i, s in enumerate(slots):           # slot i now holds page i+1: a real page, not the one named
            f.seek(gens_at + 8 * s)
            (g,) = struct.unpack("<Q", f.read(8))
            f.seek(gens_at + 8 * s)
            f.write(struct.pack("<Q", g + 1))
            f.seek(data_at + s * slot_bytes)
            f.write(pages[(i + 1) % len(pages)])
    d, _ = decode_recomputes(fleet, "taken_over", handoff, decode=1)
    assert d["pages"] == 0 and d["failures"] == len(slots), d


def test_pages_that_never_arrive_cost_the_wait_then_the_decode_computes(fleet: Fleet) -> None:
    """A hand-off naming pages nobody stored (a prefill that died before its store, or whose pages
    were evicted and withdrawn at once): the decode waits ``pd.wait_s``, then computes."""
    p = P("never_came")
    handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1",
               "remote_block_ids": [], "pof_node": "p1", "pof_tokens": pool_tokens(p)}
    d, took = decode_recomputes(fleet, "never_came", handoff)
    assert d["computed"] == len(p), d
    assert WAIT_S <= took < WAIT_S + 20, took


def test_index_down_between_the_halves_the_decode_still_answers(fleet: Fleet) -> None:
    """The index server dies after the prefill published: the decode's lookups fail (misses) or
    reach the restarted, empty index; either way it computes what it cannot load, within the wait."""
    handoff, _ = settled_handoff(fleet, fleet.prefill[0], P("index_down"))
    assert stop_embedded(fleet.runtime_dir)
    _, took = decode_recomputes(fleet, "index_down", handoff)
    assert took < WAIT_S + 30, took


def test_a_prefill_server_killed_in_the_middle_of_a_handoff(fleet: Fleet, workdir: Path) -> None:
    """Last in this module: it kills p2.

    1. p2 answered a prefill half and is killed before the decode half: the decode server loads the
       pages p2 stored if their checks pass (a shared region outlives its writer) or computes them.
    2. ``pof router`` sends a prefill half to p2, which hangs (SIGSTOP) and is then killed while
       the router waits for it: the router gets no hand-off, and the decode server computes the
       prompt co-located. The client sees the reference's answer both times."""
    p2 = fleet.prefill[1]
    handoff, _ = settled_handoff(fleet, p2, P("killed_after"))
    router = pof_router(workdir, [p2], fleet.decode[:1], "pof-router-kill")
    try:
        assert p2.proc is not None
        pgid = p2.proc.pid
        os.killpg(pgid, signal.SIGSTOP)
        answer: dict[str, Any] = {}

        def ask() -> None:
            answer["tokens"], answer["headers"] = routed(router, P("killed_during"))

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(3)
        assert t.is_alive()            # the router waits for the stopped prefill server
        p2.kill()
        t.join(timeout=120)
        assert not t.is_alive(), router.tail()
        assert answer["tokens"] == fleet.ref("killed_during"), router.tail()
        assert answer["headers"]["x-pof-prefill"].startswith("none:"), answer["headers"]
        assert answer["headers"]["x-pof-backend"] == "d1"
    finally:
        router.stop()
    decode_recomputes(fleet, "killed_after", handoff)
