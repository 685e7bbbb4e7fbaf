"""A randomized differential test of the vLLM connector: thousands of engine steps with load
failures, evictions and slot reuse injected at random; afterwards every page in the pool must be
byte-identical to the page a clean run computes for the same key.

The connector halves are the real ones (``PoFScheduler`` with a real index, ``PoFWorker`` on
vLLM-shaped CPU KV tensors laid out by vLLM's own kernel, a real DRAM tier). Two parts of vLLM
are stood in for, since a real forward would take hours here:

* ``Engine`` stands in for vLLM's scheduler loop: it admits requests (asking the connector how
  many tokens the pool has, allocating blocks, ``update_state_after_alloc``), schedules chunked
  prefills, and on reported load errors rewinds exactly as vLLM 0.32's
  ``Scheduler._update_requests_with_invalid_blocks`` does (``num_computed_tokens`` back to the
  first invalid block among the request's computed blocks);
* ``Engine.attention`` stands in for the model: the KV it writes for a block depends on the
  block's tokens *and on the KV already in the request's earlier blocks* of that layer, as
  attention makes it. KV computed on top of a page that failed to load is therefore wrong, and a
  pool that stored it under the page's (right) key would be caught by the final comparison.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_scheduler import PoFScheduler
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig
from pof_connector.index.server import RedisServer
from pof_connector.pages import PageError
from tests.adapters.test_vllm_safety import scheduled

pytestmark = pytest.mark.vllm

H, N, D, LAYERS = 2, 32, 32, 2
BPP = 2                     # blocks per page
P = BPP * N                 # page_tokens
BLOCKS = 96
STEPS = 1500
GEO = VllmGeometry(model="diff", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS, is_mla=False,
                   block_size=N, page_tokens=P, tp_size=1)


def block_kv(layer: int, tokens: tuple[int, ...], context: float) -> torch.Tensor:
    """The canonical KV ``[2, N, H, D]`` of one block: a function of its tokens and of the KV
    before it (``context``)."""
    seed = hashlib.sha256(repr((layer, tokens, round(context, 3))).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randn(2, N, H, D, generator=g)


def context_of(blocks: list[torch.Tensor]) -> float:
    return float(sum(float(b.double().abs().sum()) for b in blocks))


class Reference:
    """The clean run: KV of every block of a token sequence, computed on clean KV only."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, tuple[int, ...]], list[torch.Tensor]] = {}

    def blocks(self, layer: int, tokens: tuple[int, ...]) -> list[torch.Tensor]:
        key = (layer, tokens)
        if key not in self._memo:
            head = self.blocks(layer, tokens[:-N]) if len(tokens) > N else []
            self._memo[key] = [*head, block_kv(layer, tokens[-N:], context_of(head))]
        return self._memo[key]

    def page(self, layer: int, tokens: tuple[int, ...], lay: Any) -> bytes:
        """Page ``len(tokens) // P - 1``'s segment of ``layer``, as the pool stores it."""
        blocks = self.blocks(layer, tokens)[-BPP:]
        return bytes(lay.blocks_to_pages(torch.stack(blocks), BPP).contiguous().numpy().view(np.uint8))


@dataclass
class Running:
    request: Request
    blocks: list[int]
    new: bool = True
    scheduled: int = 0


@dataclass
class Engine:
    scheduler: PoFScheduler
    worker: PoFWorker
    kv: list[torch.Tensor]
    rng: random.Random
    free: list[int] = field(default_factory=lambda: list(range(BLOCKS)))
    running: dict[str, Running] = field(default_factory=dict)
    prefixes: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    strangers: set[bytes] = field(default_factory=set)     # pages the faults wrote into reused slots
    load_errors: int = 0
    hits: int = 0
    next_id: int = 0

    # ---- the scheduler loop -------------------------------------------------------------------

    def admit(self, tokens: list[int]) -> None:
        need = -(-len(tokens) // N)
        if need > len(self.free):
            return
        req = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=1), None)
        self.next_id += 1
        for i, key in enumerate(self.scheduler.pool.keys_for(tokens)):
            self.prefixes[key.digest] = tuple(tokens[:(i + 1) * P])
        blocks = [self.free.pop() for _ in range(need)]
        external = self.scheduler.matched_tokens(req, 0)
        self.scheduler.after_alloc(req, blocks, external)
        req.num_computed_tokens = external
        self.hits += external // P
        self.running[req.request_id] = Running(req, blocks)

    def step(self) -> None:
        for run in self.running.values():
            left = len(run.request.all_token_ids) - run.request.num_computed_tokens
            run.scheduled = min(left, N * self.rng.choice((1, 2, 3, 8)))
        so = self.scheduler_output()
        for run in self.running.values():
            run.new = False
            run.request.num_computed_tokens += run.scheduled       # as vLLM's schedule() does
        meta = self.scheduler.build_meta(so)
        mid_load = self.rng.random() < 0.5
        if not mid_load:
            self.inject_faults(meta)
        self.worker.track(meta)
        self.worker.report_failed_blocks(meta.fail_blocks)
        self.worker.prepare_saves(meta)
        self.worker.start(meta)
        if mid_load:
            self.inject_faults(meta)
        for layer, name in enumerate(self.worker.layer_index):
            self.worker.wait_layer(name)
            self.attention(layer)
            self.worker.save_layer(name)
        self.worker.end_step()
        invalid = self.worker.take_load_errors()
        self.load_errors += len(invalid)
        self.update_from_output(invalid)

    def scheduler_output(self) -> Any:
        running = self.running.values()
        return scheduled([(r.request, r.blocks, r.scheduled) for r in running if r.new],
                         [(r.request, r.request.num_computed_tokens, r.scheduled) for r in running if not r.new])

    def update_from_output(self, invalid: set[int]) -> None:
        """vLLM's ``_update_requests_with_invalid_blocks`` (recompute policy), then finish requests."""
        marked: set[int] = set()
        for run in self.running.values():
            req = run.request
            before = req.num_computed_tokens - run.scheduled
            for idx, block in enumerate(run.blocks[:-(-before // N)]):
                if block in invalid and block not in marked:
                    marked.add(block)
                    req.num_computed_tokens = idx * N
                    break
        for req_id in [i for i, r in self.running.items()
                       if r.request.num_computed_tokens >= len(r.request.all_token_ids)]:
            run = self.running.pop(req_id)
            self.scheduler.finished(req_id)
            self.free += run.blocks                   # freed, not cleared: stale KV stays, as in vLLM

    # ---- the model ------------------------------------------------------------------------------

    def attention(self, layer: int) -> None:
        """Write the KV of this step's scheduled tokens (whole blocks) of every request."""
        lay, kv = self.worker.layout, self.kv[layer]
        assert lay is not None
        for run in self.running.values():
            req = run.request
            start = req.num_computed_tokens - run.scheduled
            tokens = req.all_token_ids
            for b in range(start // N, -(-req.num_computed_tokens // N)):
                before = lay.gather(kv, torch.tensor(run.blocks[:b], dtype=torch.long)) if b else None
                context = context_of(list(before)) if before is not None else 0.0
                block = tuple(tokens[b * N:(b + 1) * N]) + (0,) * max(0, (b + 1) * N - len(tokens))
                lay.scatter(kv, torch.tensor([run.blocks[b]]), block_kv(layer, block, context)[None])

    # ---- faults -----------------------------------------------------------------------------------

    def inject_faults(self, meta: Any) -> None:
        """Between the scheduler's lookup and the worker's copy (before the load is opened, or while
        its slots are pinned): corrupt a page, evict it, or reuse its slot for another page."""
        pool = self.worker.pool
        assert pool is not None
        tier, spec = pool.tiers[0], pool.spec
        for job in meta.loads:
            for key in job.keys:
                roll = self.rng.random()
                ref = tier.find(key, touch=False)
                if ref is None or roll > 0.15:
                    continue
                if roll < 0.05:
                    at = tier.slot_offset(ref.slot) + spec.segment_offset(self.rng.randrange(LAYERS))
                    tier.region[at + self.rng.randrange(spec.segment_bytes)] ^= 0xFF
                    self.count("corrupt")
                elif roll < 0.10:
                    if tier.remove(key) is not None:
                        self.count("evicted")
                else:          # evicted, and its slot (the next free one) rewritten with another page
                    if tier.remove(key) is None:
                        continue
                    other = pool.keys_for([self.rng.randrange(1 << 30) for _ in range(P)])[0]
                    got = tier.prepare_store(other)
                    if got is not None:
                        layers = [np.frombuffer(self.rng.randbytes(spec.segment_bytes), dtype=np.uint8)
                                  for _ in range(LAYERS)]
                        tier.write(got[0], other, layers)
                        tier.complete_store(other, True)
                        self.strangers.add(other.digest)
                        self.count("reused")

    def count(self, fault: str) -> None:
        self.faults[fault] = self.faults.get(fault, 0) + 1


@pytest.fixture
def engine(runtime_dir: str) -> Iterator[Engine]:
    server = RedisServer(Path(runtime_dir) / "redis").start()
    cfg = PofConfig.from_mapping({"node_id": "d", "index_url": server.url, "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "2560KiB"}}})       # ~40 pages: evictions
    worker = PoFWorker(cfg, GEO, tp_rank=0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, H, N, 2 * D) for i in range(LAYERS)}
    worker.register(kv)
    scheduler = PoFScheduler(cfg, GEO)
    try:
        yield Engine(scheduler, worker, list(kv.values()), random.Random(20))
    finally:
        scheduler.close()
        worker.close()
        server.stop()


def test_every_pooled_page_equals_the_clean_runs_page(engine: Engine) -> None:
    rng = engine.rng
    documents = [[rng.randrange(1, 50_000) for _ in range(8 * P)] for _ in range(5)]
    for _ in range(STEPS):
        while len(engine.running) < 3:
            doc = rng.choice(documents)
            tokens = doc[:P * rng.randint(1, 8)] + [rng.randrange(1, 50_000) for _ in range(rng.randint(1, P))]
            before = len(engine.running)
            engine.admit(tokens)
            if len(engine.running) == before:
                break
        engine.step()
    pool = engine.worker.pool
    assert pool is not None
    pool.flush()
    reference, lay = Reference(), engine.worker.layout
    tier = pool.tiers[0]
    differing, checked = 0, 0
    buf = np.empty(pool.spec.page_bytes, dtype=np.uint8)
    for key, ref in list(tier.stored()):
        if key.digest in engine.strangers:
            continue
        tokens = engine.prefixes[key.digest]
        try:
            tier.read(ref, key, buf)
        except PageError:
            continue                        # injected corruption: refused on read, never handed out
        checked += 1
        for layer in range(LAYERS):
            got = bytes(pool.spec.segment(buf, layer))
            if got != reference.page(layer, tokens, lay):
                differing += 1
                break
    print(f"steps {STEPS}, pool hits {engine.hits} pages, load errors {engine.load_errors} blocks, "
          f"faults {engine.faults}, pages checked {checked}, differing {differing}")
    assert differing == 0
    assert engine.load_errors > 50 and engine.hits > 200 and checked > 20, "the run must exercise the pool"
