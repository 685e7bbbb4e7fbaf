"""The world of the randomized differential test of the vLLM connector, adversaries included.

The connector halves are the real ones: ``PoFScheduler`` with a real Redis-protocol index,
``PoFWorker`` ranks on vLLM-shaped CPU KV tensors, real tiers (a shared CXL region on a
``/dev/shm`` file, DRAM, a peer-HBM region) and the real native copy kernel with its crew. Three
things are stood in for, since they cannot run here or would take hours:

* :class:`VllmStandIn` stands in for vLLM 0.32's scheduler loop: its prefix cache (full blocks
  hashed by their tokens, registered when allocated for external tokens or once computed, shared
  between requests, kept after their requests end until the block is reallocated), chunked
  prefill, and on reported load errors exactly ``Scheduler._update_requests_with_invalid_blocks``
  (recompute policy: the first request holding an invalid block rewinds to it, later sharers back
  to what they had computed before this step).
* :meth:`World.attention` stands in for the model: the KV a rank writes for a block is a function
  of the block's tokens and of the bytes of the request's earlier blocks **on every rank**, read
  from the engine's memory as they are (tensor parallelism's all-reduce mixes every rank into
  every rank's next KV). KV computed on top of any wrong byte is therefore wrong.
* :class:`GpuShapedRegion` stands in for a peer-HBM region on a GPU (no GPU here): a ``cpu``
  region whose segments reach the host through a copy, not in place.

The adversaries (each can be switched off, :class:`Adversaries`): requests sharing blocks within a
step; TP ranks that fail independently; pages of another node ("o") in the shared region that it
rewrites during a load and after the forward; the engine's own pages corrupted, evicted or their
slots reused; a stalled copy-crew helper (``POF_CREW_STALL_US`` in this process's environment,
read when the native kernel loads); loads through a GPU-shaped region; both copy paths (the fused
native one and the strided torch one).

The oracle: every page that reaches a pool is compared, byte for byte, with the page a clean run
computes for its key (:class:`Reference`) — when it is first seen (after each step, recording the
step) and once more at the end. Run with ``python -m tests.adapters.adversary_world --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_layout import BlockLayout
from pof_connector.adapters.vllm_scheduler import PoFScheduler
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError
from pof_connector.pool import Pool
from pof_connector.tiers import peer_hbm

H, N, D, LAYERS = 2, 32, 32, 2
BPP = 2                     # blocks per page
P = BPP * N                 # page_tokens
BLOCKS = 96                 # vLLM's prefix cache forgets: later requests load from the pool
DOC_PAGES = 8


@dataclass(frozen=True)
class Adversaries:
    sharing: bool = True       # requests share blocks (loaded ones too) within a step
    tp: int = 2                # tensor-parallel ranks, failing independently
    owner: bool = True         # another node's pages in the shared region, rewritten during copies
    scratch: bool = True       # rank 0's first tier is read through a host copy (a GPU region's shape)
    faults: bool = True        # the engine's own pages corrupted, evicted, their slots reused
    strided: float = 0.5       # share of steps that copy with the strided torch path instead of the fused one


class GpuShapedRegion(peer_hbm.PeerHbmTier):
    """A peer-HBM region on a GPU, stood in for by a ``cpu`` region: segments come through a host
    copy (the reader's per-page buffer; before issue 39 the tier's per-thread scratch, which
    ``_host``'s CUDA branch filled)."""

    in_place = False

    def _host(self, t: Any, tag: Any = None) -> Any:
        scratch = self._scratch(t.numel())
        scratch.copy_(t)
        self._local.tag = tag
        return scratch.numpy()


def block_kv(layer: int, rank: int, tokens: tuple[int, ...], context: bytes) -> torch.Tensor:
    """Rank ``rank``'s canonical KV ``[2, N, H, D]`` of one block: its tokens and the KV before it."""
    seed = hashlib.sha256(repr((layer, rank, tokens)).encode() + context).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randn(2, N, H, D, generator=g)


def context_of(per_rank: list[torch.Tensor]) -> bytes:
    """What every rank's earlier blocks (canonical, ``[b, 2, N, H, D]``) of a request contribute."""
    h = xxhash.xxh3_128()
    for blocks in per_rank:
        h.update(blocks.contiguous().numpy().tobytes())
    return h.digest()


class Reference:
    """The clean run: every rank's KV of every block of a token sequence, on clean KV only."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._memo: dict[tuple[int, tuple[int, ...]], list[list[torch.Tensor]]] = {}

    def blocks(self, layer: int, tokens: tuple[int, ...]) -> list[list[torch.Tensor]]:
        """Per rank, the canonical blocks of ``tokens`` (a whole number of blocks)."""
        key = (layer, tokens)
        if key not in self._memo:
            head = self.blocks(layer, tokens[:-N]) if len(tokens) > N else [[] for _ in range(self.ranks)]
            ctx = context_of([torch.stack(b) if b else torch.empty(0) for b in head])
            self._memo[key] = [[*head[r], block_kv(layer, r, tokens[-N:], ctx)] for r in range(self.ranks)]
        return self._memo[key]

    def page(self, layer: int, rank: int, tokens: tuple[int, ...], lay: BlockLayout) -> bytes:
        """Page ``len(tokens) // P - 1``'s segment of ``layer`` on ``rank``, as the pool stores it."""
        blocks = self.blocks(layer, tokens)[rank][-BPP:]
        return bytes(lay.blocks_to_pages(torch.stack(blocks), BPP).contiguous().numpy().view(np.uint8))


@dataclass
class Running:
    request: Request
    blocks: list[int]
    new: bool = True
    scheduled: int = 0


@dataclass
class VllmStandIn:
    """vLLM's block pool and prefix cache, as much as the connector's safety depends on."""

    rng: random.Random
    free: deque[int] = field(default_factory=lambda: deque(range(1, BLOCKS)))   # block 0: the null block
    refs: dict[int, int] = field(default_factory=dict)
    cached: dict[tuple[int, ...], int] = field(default_factory=dict)    # tokens up to a block's end -> block
    hash_of: dict[int, tuple[int, ...]] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)

    def prefix_hits(self, tokens: list[int]) -> list[int]:
        """Blocks of the prompt's leading full blocks in the prefix cache (never its last token)."""
        hits: list[int] = []
        for i in range((len(tokens) - 1) // N):
            block = self.cached.get(tuple(tokens[:(i + 1) * N]))
            if block is None:
                break
            hits.append(block)
        return hits

    def take(self, block: int) -> None:
        if self.refs.get(block, 0) == 0:
            self.free.remove(block)
        self.refs[block] = self.refs.get(block, 0) + 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block = self.free.popleft()
            old = self.hash_of.pop(block, None)        # a cached block is evicted when reallocated
            if old is not None and self.cached.get(old) == block:
                del self.cached[old]
            self.refs[block] = 1
            out.append(block)
        return out

    def register(self, run: Running, upto_tokens: int) -> None:
        """Cache the request's full blocks below ``upto_tokens`` (vLLM's ``cache_blocks``)."""
        tokens = run.request.all_token_ids
        for i in range(min(upto_tokens, len(tokens)) // N):
            h = tuple(tokens[:(i + 1) * N])
            if h not in self.cached:
                self.cached[h] = run.blocks[i]
                self.hash_of[run.blocks[i]] = h

    def release(self, run: Running) -> None:
        for block in run.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def rewind(self, invalid: set[int]) -> tuple[int, int]:
        """``_update_requests_with_invalid_blocks`` (recompute policy) over the running requests;
        returns (requests rewound, of those sharing an invalid block another one recomputes)."""
        marked: set[int] = set()
        affected = shared = 0
        for run in self.running.values():
            req = run.request
            before = req.num_computed_tokens - run.scheduled
            hit = marked_here = False
            for idx, block in enumerate(run.blocks[:-(-before // N)] if before else []):
                if block not in invalid:
                    continue
                hit = True
                if block in marked:
                    continue
                marked.add(block)
                if marked_here:
                    continue
                marked_here = True
                req.num_computed_tokens = idx * N
            if hit:
                affected += 1
                if not marked_here:
                    shared += 1
                    req.num_computed_tokens = before
        return affected, shared


@dataclass
class Stats:
    steps: int = 0
    hits: int = 0
    load_errors: int = 0
    rewound: int = 0
    shared_failed: int = 0
    tp_one_rank_failed: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    pages_seen: int = 0         # pages compared when they first appeared in a pool
    pages_checked: int = 0      # pages compared at the end
    differing: int = 0
    first_bad_step: int | None = None
    crew_stolen: int = 0
    owner_pages_loaded: int = 0

    def count(self, what: str, n: int = 1) -> None:
        self.faults[what] = self.faults.get(what, 0) + n


class World:
    def __init__(self, adv: Adversaries, seed: int, root: Path, shm: Path) -> None:
        self.adv, self.rng = adv, random.Random(seed)
        self.stats = Stats()
        self.server = RedisServer(root / "redis").start()
        ranks = adv.tp
        self.geo = VllmGeometry(model="diff", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS,
                                is_mla=False, block_size=N, page_tokens=P, tp_size=ranks)
        # partitions of ~40 pages: the engine evicts its copies and loads the owner's, the owner evicts too
        cxl = {"path": str(shm), "size": f"{(ranks + 1) * 1344}KiB", "partitions": ranks + 1}

        def cfg(node: str, first: dict[str, Any] | None) -> PofConfig:
            tiers: dict[str, Any] = {**(first or {}), "cxl": cxl}
            return PofConfig.from_mapping({"audit": {"sample_rate": 0},
                                          "node_id": node, "index_url": self.server.url, "runtime_dir": str(root),
                                           "tiers": tiers, "heartbeat_s": 0.2, "node_ttl_s": 120.0})

        self.owner = Pool(cfg("o", None), _spec(self.geo), self.geo.namespace(cfg("o", None), 0))
        self.workers: list[PoFWorker] = []
        self.kv: list[list[torch.Tensor]] = []
        for r in range(ranks):
            scratch = adv.scratch and r == 0
            first = {"peer_hbm": {"device": "cpu", "size": "1344KiB", "partitions": 1}} if scratch else \
                {"cpu_dram": {"size": "1344KiB"}}                  # ~40 pages: evictions, demotions
            w = PoFWorker(cfg("d", first), self.geo, tp_rank=r, overlap=False)
            kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, H, N, 2 * D) for i in range(LAYERS)}
            real, peer_hbm.PeerHbmTier = peer_hbm.PeerHbmTier, GpuShapedRegion     # what make_tier builds
            try:
                w.register(kv)
            finally:
                peer_hbm.PeerHbmTier = real
            assert not scratch or isinstance(w.pool.tiers[0], GpuShapedRegion) if w.pool else False
            self.workers.append(w)
            self.kv.append(list(kv.values()))
        self.scheduler = PoFScheduler(cfg("d", None), self.geo)
        self.vllm = VllmStandIn(self.rng)
        self.reference = Reference(ranks)
        lay = self.workers[0].layout
        assert lay is not None
        self.lay = lay
        self.prefixes: dict[bytes, tuple[int, ...]] = {}
        self.strangers: set[bytes] = set()
        self.seen: set[tuple[int, bytes]] = set()
        self.docs = [[self.rng.randrange(1, 50_000) for _ in range(DOC_PAGES * P)] for _ in range(6)]
        self.next_id = 0
        self.last_doc = self.docs[0]

    # ---- the owner: another node's pages in the shared region ------------------------------------------

    def owner_stores(self, doc: list[int], pages: int) -> None:
        """Node "o" stores clean pages of ``doc`` for every rank (their keys are the ranks')."""
        items = []
        for r in range(self.adv.tp):
            ns = self.geo.namespace(self.workers[r].config, r)
            keys = [PageKey(ns, k.digest) for k in self.scheduler.pool.keys_for(doc[:pages * P])]
            for i, key in enumerate(keys):
                tokens = tuple(doc[:(i + 1) * P])
                self.prefixes[key.digest] = tokens
                items.append((key, [np.frombuffer(self.reference.page(layer, r, tokens, self.lay), np.uint8)
                                    for layer in range(LAYERS)]))
        self.owner.store(items).result()

    def owner_rewrites(self, keys: list[PageKey], what: str) -> None:
        """Node "o" reuses the slots of some of ``keys`` for other pages (a writer in the region)."""
        tier = self.owner.tiers[0]
        for key in keys:
            if self.rng.random() > 0.5 or tier.remove(key) is None:
                continue
            other = PageKey(key.namespace, self.rng.randbytes(32))
            got = tier.prepare_store(other)
            if got is None:
                continue
            tier.write(got[0], other, [np.frombuffer(self.rng.randbytes(tier.spec.segment_bytes), np.uint8)
                                       for _ in range(LAYERS)])
            tier.complete_store(other, True)
            self.strangers.add(other.digest)
            self.stats.count(what)

    # ---- the scheduler loop ---------------------------------------------------------------------------

    def admit(self) -> None:
        """New requests, several a step from few documents: they share blocks, loaded ones too."""
        while len(self.vllm.running) < 4:
            # half the time the document just admitted: requests sharing its blocks in this step
            doc = self.last_doc if self.adv.sharing and self.rng.random() < 0.5 else self.rng.choice(self.docs)
            self.last_doc = doc
            tokens = doc[:P * self.rng.randint(1, DOC_PAGES)] + [self.rng.randrange(1, 50_000)
                                                                for _ in range(self.rng.randint(1, P))]
            req = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=1), None)
            for i, key in enumerate(self.scheduler.pool.keys_for(tokens)):
                self.prefixes[key.digest] = tuple(tokens[:(i + 1) * P])
            hits = self.vllm.prefix_hits(tokens) if self.adv.sharing else []
            need = -(-len(tokens) // N) - len(hits)
            if need > len(self.vllm.free) - 8:
                return
            self.next_id += 1
            for block in hits:
                self.vllm.take(block)
            blocks = [*hits, *(self.vllm.allocate(need) or [])]
            computed = len(hits) * N
            external = self.scheduler.matched_tokens(req, computed)
            self.scheduler.after_alloc(req, blocks, external)
            req.num_computed_tokens = computed + external
            self.stats.hits += external // P
            run = Running(req, blocks)
            self.vllm.running[req.request_id] = run
            self.schedule(run)

    def schedule(self, run: Running) -> None:
        """This step's chunk of ``run``; like vLLM's ``allocate_slots``, its blocks are cached now,
        before they are loaded or computed: a request admitted later in the step may share them."""
        left = len(run.request.all_token_ids) - run.request.num_computed_tokens
        run.scheduled = min(left, N * self.rng.choice((1, 2, 3, 8)))
        self.vllm.register(run, run.request.num_computed_tokens + run.scheduled)

    def step(self) -> None:
        self.stats.steps += 1
        for run in self.vllm.running.values():      # vLLM schedules the running requests first
            self.schedule(run)
        self.admit()
        so = self.scheduler_output()
        for run in self.vllm.running.values():
            run.new = False
            run.request.num_computed_tokens += run.scheduled        # as vLLM's schedule() does
        meta = self.scheduler.build_meta(so)
        strided = self.rng.random() < self.adv.strided
        BlockLayout.can_copy_checked = _fused if not strided else _never      # type: ignore[method-assign]
        loaded = [k for job in meta.loads for k, s in zip(job.keys, job.sources, strict=False) if s.node == "o"]
        self.stats.owner_pages_loaded += len(loaded)
        mid_load = self.rng.random() < 0.5
        if not mid_load:
            self.inject_faults(meta)
        for w in self.workers:
            w.track(meta)
            w.report_failed_blocks(meta.fail_blocks)
            w.prepare_saves(meta)
            w.start(meta)
        for layer, name in enumerate(self.workers[0].layer_index):
            for w in self.workers:
                w.wait_layer(name)
            if layer == 0 and mid_load:
                self.inject_faults(meta)
                if self.adv.owner:
                    self.owner_rewrites(loaded, "owner_rewrote_mid_load")
            self.attention(layer)
            for w in self.workers:
                w.save_layer(name)
        if self.adv.owner and loaded:          # after the forward read the blocks, before the helpers settle
            self.owner_rewrites(loaded, "owner_rewrote_after_forward")
        invalid: set[int] = set()
        per_rank: list[set[int]] = []
        reports = []
        for w in self.workers:
            w.end_step()
            errors = w.take_load_errors()
            per_rank.append(errors)
            invalid |= errors
            reports.append(getattr(w, "report", lambda: None)())
        if len(per_rank) > 1 and any(a != per_rank[0] for a in per_rank[1:]):
            self.stats.tp_one_rank_failed += 1
        self.stats.load_errors += len(invalid)
        affected, shared = self.vllm.rewind(invalid)
        self.stats.rewound += affected
        self.stats.shared_failed += shared
        self.finish_requests()
        report = reports[0]
        for more in reports[1:]:
            report = report.aggregate(more) if report is not None and more is not None else report
        update = getattr(self.scheduler, "update_output", None)     # vLLM's base connector: no such hook
        if update is not None:
            update(KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=report))
        if self.adv.owner and self.rng.random() < 0.2:
            self.owner_stores(self.rng.choice(self.docs), DOC_PAGES)       # the owner fills its region again
        self.check_new_pages()

    def finish_requests(self) -> None:
        for req_id in [i for i, r in self.vllm.running.items()
                       if r.request.num_computed_tokens >= len(r.request.all_token_ids)]:
            run = self.vllm.running.pop(req_id)
            self.scheduler.finished(req_id)
            self.vllm.release(run)        # freed, not cleared: stale KV stays, as in vLLM

    def scheduler_output(self) -> Any:
        from types import SimpleNamespace

        runs = list(self.vllm.running.values())
        new = [r for r in runs if r.new]
        cached = [r for r in runs if not r.new]
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request.request_id, block_ids=(list(r.blocks),),
                                                num_computed_tokens=r.request.num_computed_tokens) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request.request_id for r in cached],
                                                  new_block_ids=[None] * len(cached), resumed_req_ids=set(),
                                                  num_computed_tokens=[r.request.num_computed_tokens for r in cached]),
            num_scheduled_tokens={r.request.request_id: r.scheduled for r in runs})

    # ---- the model ------------------------------------------------------------------------------------

    def attention(self, layer: int) -> None:
        """Every rank's KV of this step's scheduled tokens (whole blocks), in request order (a
        block a request shares is written by its first holder before a later one reads it)."""
        lay = self.lay
        for run in self.vllm.running.values():
            req = run.request
            start = req.num_computed_tokens - run.scheduled
            tokens = req.all_token_ids
            for b in range(start // N, -(-req.num_computed_tokens // N)):
                before = torch.tensor(run.blocks[:b], dtype=torch.long)
                ctx = context_of([lay.gather(kv[layer], before) if b else torch.empty(0) for kv in self.kv])
                block = tuple(tokens[b * N:(b + 1) * N]) + (0,) * max(0, (b + 1) * N - len(tokens))
                for r, kv in enumerate(self.kv):
                    lay.scatter(kv[layer], torch.tensor([run.blocks[b]]), block_kv(layer, r, block, ctx)[None])

    # ---- faults on the engine's own pages -------------------------------------------------------------

    def inject_faults(self, meta: Any) -> None:
        """On each rank independently, between the lookup and the copy (or while the slots are
        pinned): corrupt a page of its first tier, evict it, or reuse its slot for another page."""
        if not self.adv.faults:
            return
        for r, w in enumerate(self.workers):
            pool = w.pool
            assert pool is not None
            tier, spec = pool.tiers[0], pool.spec
            for job in meta.loads:
                for key in w._own_keys(job.keys):
                    roll = self.rng.random()
                    ref = tier.find(key, touch=False)
                    if ref is None or roll > 0.12:
                        continue
                    if roll < 0.04:
                        at = tier.slot_offset(ref.slot) + spec.segment_offset(self.rng.randrange(LAYERS))
                        _flip(tier, at + self.rng.randrange(spec.segment_bytes))
                        self.stats.count(f"corrupt_rank{r}")
                    elif roll < 0.08:
                        if tier.remove(key) is not None:
                            self.stats.count(f"evicted_rank{r}")
                    elif tier.remove(key) is not None:     # evicted, its slot rewritten with another page
                        other = PageKey(key.namespace, self.rng.randbytes(32))
                        got = tier.prepare_store(other)
                        if got is not None:
                            tier.write(got[0], other, [np.frombuffer(self.rng.randbytes(spec.segment_bytes), np.uint8)
                                                       for _ in range(LAYERS)])
                            tier.complete_store(other, True)
                            self.strangers.add(other.digest)
                            self.stats.count(f"reused_rank{r}")

    # ---- the oracle -----------------------------------------------------------------------------------

    def pages(self) -> Iterator[tuple[int, Any, PageKey, Any]]:
        for r, w in enumerate(self.workers):
            assert w.pool is not None
            for tier in w.pool.tiers:
                for key, ref in list(tier.stored()):
                    if key.digest not in self.strangers:
                        yield r, tier, key, ref

    def compare(self, r: int, tier: Any, key: PageKey, ref: Any) -> bool | None:
        """Whether the stored page equals the clean run's; ``None``: refused on read (injected)."""
        spec = tier.spec
        buf = np.empty(spec.page_bytes, dtype=np.uint8)
        try:
            tier.read(ref, key, buf)
        except PageError:
            return None
        tokens = self.prefixes[key.digest]
        return all(bytes(spec.segment(buf, layer)) == self.reference.page(layer, r, tokens, self.lay)
                   for layer in range(LAYERS))

    def check_new_pages(self) -> None:
        for r, tier, key, ref in self.pages():
            if (r, key.digest) in self.seen:
                continue
            self.seen.add((r, key.digest))
            got = self.compare(r, tier, key, ref)
            self.stats.pages_seen += got is not None
            if got is False and self.stats.first_bad_step is None:
                self.stats.first_bad_step = self.stats.steps

    def final_check(self) -> None:
        for w in self.workers:
            assert w.pool is not None
            w.pool.flush()
        for r, tier, key, ref in self.pages():
            got = self.compare(r, tier, key, ref)
            if got is None:
                continue
            self.stats.pages_checked += 1
            if not got:
                self.stats.differing += 1
                if self.stats.first_bad_step is None:
                    self.stats.first_bad_step = self.stats.steps

    def close(self) -> None:
        self.scheduler.close()
        for w in self.workers:
            w.close()
        self.owner.close()
        self.server.stop()


_fused = BlockLayout.can_copy_checked


def _never(self: BlockLayout, kv: torch.Tensor) -> bool:
    return False


def _spec(geo: VllmGeometry) -> Any:
    from pof_connector.pages.layout import KIND_MHA, PageSpec

    return PageSpec(geo.num_layers, 2 * P * H * D * 4, P, KIND_MHA)


def _flip(tier: Any, at: int) -> None:
    """Flip a byte of a tier's region wherever it lives (a GPU-shaped region's too)."""
    region = tier.device_bytes if hasattr(tier, "device_bytes") else None
    if region is not None:
        region[at] ^= 0xFF
    else:
        tier.region[at] ^= 0xFF


def run(adv: Adversaries, steps: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(2)        # the fused copy's crew: the caller and one helper
    with tempfile.TemporaryDirectory(prefix="pof-adv-", dir="/tmp") as root, \
            tempfile.TemporaryDirectory(prefix="pof-adv-", dir="/dev/shm") as shm:
        world = World(adv, seed, Path(root), Path(shm) / "region.cxl")
        try:
            for doc in world.docs:
                if adv.owner:
                    world.owner_stores(doc, DOC_PAGES)
            for _ in range(steps):
                world.step()
            world.final_check()
        finally:
            BlockLayout.can_copy_checked = _fused      # type: ignore[method-assign]
            world.close()
        from pof_connector.pages import page_sum

        native = page_sum._native
        if native is not None and hasattr(native, "crew_stats"):
            world.stats.crew_stolen = native.crew_stats()[1]
        return {"adversaries": asdict(adv), "seed": seed, **asdict(world.stats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--tp", type=int, default=2)
    for flag in ("sharing", "owner", "scratch", "faults"):
        ap.add_argument(f"--no-{flag}", action="store_true")
    ap.add_argument("--strided", type=float, default=0.5, help="share of steps on the strided copy path")
    args = ap.parse_args()
    adv = Adversaries(sharing=not args.no_sharing, tp=args.tp, owner=not args.no_owner, scratch=not args.no_scratch,
                      faults=not args.no_faults, strided=args.strided)
    print(json.dumps(run(adv, args.steps, args.seed)))


if __name__ == "__main__":
    main()
