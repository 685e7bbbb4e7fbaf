"""Peer-HBM and host-tier bandwidth against raw torch copies (``python -m pof_connector.bench.hbm``).

Run by ``ci/gpu_check.sh`` on a GPU host; ``--device cpu`` runs the same code on CPU tensors
(its dry run). Each row moves the same bytes two ways in the same run, and its ratio is pof / raw:

==========================  ==============================================  =========================
row                         pof                                             raw baseline
==========================  ==============================================  =========================
``peer_read_to_device``     ``PeerHbmTier.read`` into a tensor on the       ``copy_`` region → engine
                            engine's GPU (copy + header/checksum/           device (peer copy with two
                            generation checks)                              GPUs)
``peer_read_many_to_device``  ``PeerHbmTier.read_many``: the same pages as  ``copy_`` region → engine
                            one batch (one wait, one checksum launch)       device
``peer_read_to_host``       ``PeerHbmTier.read`` into pinned host memory    ``copy_`` device → pinned
``peer_write_from_host``    ``PeerHbmTier.write`` of pinned host segments   ``copy_`` pinned → device
``host_tier_to_device``     ``CpuDramTier.read`` (pinned, checked), then    ``copy_`` pinned → device
                            ``copy_`` into the engine's GPU
``host_tier_dma_verify``    headers checked on the host, the pages DMAed   ``copy_`` pinned → device
                            from the (pinned) tier slots to the GPU and
                            their segment checksums verified there by
                            torch, then the live generations
==========================  ==============================================  =========================

``ratio`` (the headline) is ``peer_read_to_device`` (page by page, comparable with earlier runs),
``ratio_batched`` is ``peer_read_many_to_device`` (what an engine loading a prefix would call);
``peer_vs_host_tier`` compares the two ways an engine gets a page onto its GPU: from a peer GPU's
HBM or from this host's DRAM tier.
Throughputs are medians over repeats, in GB/s (10^9 bytes per second). ``raw_gbps.checksum_host``
is the page format's segment checksum alone on the host (v3, :mod:`pof_connector.pages.page_sum`);
``raw_gbps.checksum_device`` is the same checksum computed by torch on the engine's device over
pages already there: what verifying a page where the DMA put it costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pof_connector.bench import BenchError
from pof_connector.config import TierConfig
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageHeader, PageSpec
from pof_connector.tiers import SlotRef, Tier, make_tier


def _sync(torch: Any, devices: list[Any]) -> None:
    """Wait for both GPUs: a copy from the peer GPU runs on that GPU's stream. (Not every GPU of
    the host: that would create a CUDA context on each.)"""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _measure(torch: Any, devices: list[Any], fn: Callable[[], None], nbytes: int, min_s: float,
             max_repeat: int) -> float:
    """Median GB/s of ``fn`` (moving ``nbytes``) over repeats lasting about ``min_s`` in all."""
    fn()                      # warm-up: allocator, pinned pools, first-touch faults
    _sync(torch, devices)
    rates: list[float] = []
    start = time.perf_counter()
    while len(rates) < 3 or (time.perf_counter() - start < min_s and len(rates) < max_repeat):
        t0 = time.perf_counter()
        fn()
        _sync(torch, devices)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def run(*, engine: str, peer: str, layers: int, segment_bytes: int, pages: int, min_s: float = 0.3,
        max_repeat: int = 50) -> dict[str, Any]:
    """Measure every row for ``pages`` pages of ``layers`` x ``segment_bytes`` (see module doc)."""
    import torch

    spec = PageSpec(layers, segment_bytes, 16)
    eng = torch.device(engine)
    pin = torch.cuda.is_available()
    nbytes = pages * spec.page_bytes
    rng = np.random.default_rng(0)
    segments = [[torch.from_numpy(rng.integers(0, 255, segment_bytes, dtype=np.uint8)).pin_memory()
                 if pin else torch.from_numpy(rng.integers(0, 255, segment_bytes, dtype=np.uint8))
                 for _ in range(layers)] for _ in range(pages)]
    keys = [PageKey(bytes(16), i.to_bytes(32, "little")) for i in range(pages)]
    with tempfile.TemporaryDirectory(prefix="pof-bench-hbm-") as runtime_dir:
        size = (pages + 1) * (spec.page_bytes + 64)
        peer_tier = make_tier(TierConfig("peer_hbm", size, partitions=1, device=peer), spec, runtime_dir)
        host_tier = make_tier(TierConfig("cpu_dram", size), spec, runtime_dir)
        try:
            return _rows(torch, spec, eng, pin, nbytes, segments, keys, peer_tier, host_tier, min_s, max_repeat,
                         engine=engine, peer=peer)
        finally:
            peer_tier.close()
            host_tier.close()


def _store(tier: Tier, keys: list[PageKey], segments: list[list[Any]]) -> list[SlotRef]:
    refs = []
    for k, segs in zip(keys, segments, strict=True):
        got = tier.prepare_store(k)
        if got is None:
            raise RuntimeError("bench: the tier has no free slot")
        tier.write(got[0], k, segs)
        tier.complete_store(k, ok=True)
        refs.append(got[0])
    return refs


def _rows(torch: Any, spec: PageSpec, eng: Any, pin: bool, nbytes: int, segments: list[list[Any]],
          keys: list[PageKey], peer_tier: Any, host_tier: Tier, min_s: float, max_repeat: int, *, engine: str,
          peer: str) -> dict[str, Any]:
    pb = spec.page_bytes
    pages = len(keys)
    refs = _store(peer_tier, keys, segments)
    host_refs = _store(host_tier, keys, segments)
    region = peer_tier.device_bytes                            # the raw bytes the tier reads
    slots = [region[r.slot * peer_tier.slot_bytes:r.slot * peer_tier.slot_bytes + pb] for r in refs]
    dev_out = torch.empty(pages * pb, dtype=torch.uint8, device=eng)
    dev_pages = [dev_out[i * pb:(i + 1) * pb] for i in range(pages)]
    host_out = torch.empty(pages * pb, dtype=torch.uint8, pin_memory=pin)
    host_np = host_out.numpy()
    host_pages = [host_np[i * pb:(i + 1) * pb] for i in range(pages)]
    region_flat = region[:nbytes]
    src_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)    # the same bytes, in pinned host memory
    src_flat.copy_(region_flat)

    def raw_d2d() -> None:
        for src, dst in zip(slots, dev_pages, strict=True):
            dst.copy_(src, non_blocking=True)

    def raw_d2h() -> None:
        host_out.copy_(region_flat, non_blocking=True)

    def raw_h2d() -> None:
        dev_out.copy_(src_flat, non_blocking=True)

    hb, seg, layers = spec.header_bytes, spec.segment_bytes, spec.num_layers

    seed = host_tier.sum_seed         # any seed costs the same: these rows time the sums, they check nothing

    def checksum_host() -> None:      # what checking costs on its own: the page format's checksums
        for h in host_pages:
            page_sum.checksums(h[hb:], seg, seed)

    dev_segments = dev_out.view(pages, pb)[:, hb:].view(pages, layers, seg)

    def checksum_device() -> None:    # the same, by torch where the pages landed
        page_sum.torch_checksums(dev_segments, seed)

    host_region = torch.from_numpy(host_tier.region)         # pinned under CUDA: DMA straight from the slots
    host_slots = [host_region[r.slot * host_tier.slot_bytes:r.slot * host_tier.slot_bytes + pb] for r in host_refs]
    scratch = np.empty(hb, dtype=np.uint8)

    def host_tier_dma_verify() -> None:
        headers: list[PageHeader] = [host_tier.read_header(r, k, scratch) for k, r in zip(keys, host_refs, strict=True)]
        for src, dst in zip(host_slots, dev_pages, strict=True):
            dst.copy_(src, non_blocking=True)
        want = torch.tensor([h.segment_checksums for h in headers], dtype=torch.int64).to(eng, non_blocking=True)
        got = page_sum.torch_checksums(dev_segments, [h.sum_seed for h in headers])
        if not bool((got == want).all()):     # waits for the DMA and sums
            raise RuntimeError("bench: a page failed its checksum on the device")
        for r in host_refs:
            if host_tier.live_generation(r.slot) != r.generation:
                raise RuntimeError("bench: a slot was rewritten during the read")

    def pof_read_dev() -> None:
        for k, r, dst in zip(keys, refs, dev_pages, strict=True):
            peer_tier.read(r, k, dst)

    dev_rows = dev_out.view(pages, pb)

    def pof_read_many_dev() -> None:
        if not all(isinstance(h, PageHeader) for h in peer_tier.read_many(refs, keys, dev_rows)):
            raise RuntimeError("bench: a page of the batch was refused")

    def pof_read_host() -> None:
        for k, r, dst in zip(keys, refs, host_pages, strict=True):
            peer_tier.read(r, k, dst)

    def pof_write() -> None:
        for k, r, segs in zip(keys, refs, segments, strict=True):
            peer_tier.write(r, k, segs)            # rewrites the same slots, full protocol

    def host_tier_to_dev() -> None:
        for k, r, h in zip(keys, host_refs, host_pages, strict=True):
            host_tier.read(r, k, h)
        dev_out.copy_(host_out, non_blocking=True)

    def m(fn: Callable[[], None]) -> float:
        return _measure(torch, [eng, torch.device(peer)], fn, nbytes, min_s, max_repeat)

    raw = {"d2d": m(raw_d2d), "d2h_pinned": m(raw_d2h), "h2d_pinned": m(raw_h2d),
           "checksum_host": m(checksum_host), "checksum_device": m(checksum_device)}
    ours = {"peer_read_to_device": m(pof_read_dev), "peer_read_many_to_device": m(pof_read_many_dev),
            "peer_read_to_host": m(pof_read_host),
            "peer_write_from_host": m(pof_write), "host_tier_to_device": m(host_tier_to_dev),
            "host_tier_dma_verify": m(host_tier_dma_verify)}
    base = {"peer_read_to_device": "d2d", "peer_read_many_to_device": "d2d", "peer_read_to_host": "d2h_pinned",
            "peer_write_from_host": "h2d_pinned", "host_tier_to_device": "h2d_pinned",
            "host_tier_dma_verify": "h2d_pinned"}
    # Everything read back must still be the pages: a fast wrong answer is no result.
    for k, r, dst in zip(keys, refs, dev_pages, strict=True):
        peer_tier.read(r, k, dst)
    for i, segs in enumerate(segments):
        got = dev_pages[i][spec.header_bytes:].cpu()
        if not torch.equal(got, torch.cat(segs).cpu()):
            raise RuntimeError(f"bench: page {i} read back wrong")
    rows = {name: {"pof_gbps": round(v, 3), "raw": base[name], "raw_gbps": round(raw[base[name]], 3),
                   "ratio": round(v / raw[base[name]], 4)} for name, v in ours.items()}
    return {
        "bench": "hbm", "engine_device": engine, "peer_device": peer,
        "peer_is_other_gpu": peer != engine and peer.startswith("cuda"),
        "page_bytes": pb, "layers": spec.num_layers, "segment_bytes": spec.segment_bytes, "pages": pages,
        "bytes_per_pass": nbytes, "raw_gbps": {k: round(v, 3) for k, v in raw.items()}, "rows": rows,
        "ratio": rows["peer_read_to_device"]["ratio"],
        "ratio_batched": rows["peer_read_many_to_device"]["ratio"],
        "peer_vs_host_tier": round(ours["peer_read_to_device"] / ours["host_tier_to_device"], 4),
        # A checked read to a GPU copies device→device, then torch sums the copy there (format v2):
        # its bound from this run's raw rates, to tell pof's overhead from the design's.
        "peer_read_to_device_bound_gbps": round(1 / (1 / raw["d2d"] + 1 / raw["checksum_device"]), 3),
        "baseline": "torch copy_ of the same bytes between the same memories, same run",
        "native_kernel": page_sum.NATIVE,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }


def devices(engine: str | None, peer: str | None) -> tuple[str, str]:
    """(engine device, peer device): ``cuda:0`` and the last GPU, or ``cpu`` for both without CUDA.
    Raises :class:`~pof_connector.bench.BenchError` without PyTorch."""
    try:
        import torch
    except ImportError:
        raise BenchError("PyTorch is not installed here; run the peer-HBM bench in the engine's venv "
                         "(vLLM or SGLang brings torch)") from None
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)     # CPU copies: intra-op threads only spin against each other here
    return (engine or ("cuda:0" if cuda else "cpu"),
            peer or (f"cuda:{torch.cuda.device_count() - 1}" if cuda else "cpu"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pof_connector.bench.hbm", description=__doc__.split("\n")[0])
    p.add_argument("--device", help="engine device (default: cuda:0 when CUDA is available, else cpu)")
    p.add_argument("--peer", help="device of the peer_hbm region (default: the last GPU; cpu without CUDA)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--segment-kib", type=int, default=256, help="bytes per layer segment, KiB (default 256)")
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--min-seconds", type=float, default=0.3, help="measuring time per row (default 0.3)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args(argv)
    engine, peer = devices(args.device, args.peer)
    result = run(engine=engine, peer=peer, layers=args.layers, segment_bytes=args.segment_kib << 10,
                 pages=args.pages, min_s=args.min_seconds)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
