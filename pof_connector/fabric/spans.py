"""How a remote page is read in parts, and how its descriptors are laid out.

A page is read in a few NIXL requests in layer order (:func:`layer_parts`), each a byte span of
the page (:func:`part_spans`). Both ends of a READ or WRITE prepare their descriptor lists in the
same layout (:func:`span_base`): this node's staging
(:class:`~pof_connector.fabric.registered_staging.StagingArea`) and each connected node's regions
(:class:`~pof_connector.fabric.remote_node.RemoteNode`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pof_connector.pages.layout import PageSpec

LAYER_REQUESTS = 2
"""READ requests per (peer, medium) group of a load: headers and layer 0, then the other layers.
Each extra request costs a round trip, a few milliseconds over TCP on a busy host (`pof bench
fabric`, 60 batches each, 2-core host: ratio 0.77 and 0.77 with three requests, 0.82 and 0.90
with two), while layer 0 arrives as early either way; an engine starts on layer 0 and finds the
rest arriving as one stream."""


def layer_parts(num_layers: int, requests: int = LAYER_REQUESTS) -> list[range]:
    """The layers each READ request of a page fetches, in order: layer 0 alone first (when there
    is more than one request), the rest split evenly."""
    if requests <= 1 or num_layers <= 1:
        return [range(num_layers)]
    rest = num_layers - 1
    n = min(requests - 1, rest)
    bounds = [1 + rest * k // n for k in range(n + 1)]
    return [range(1), *(range(bounds[k], bounds[k + 1]) for k in range(n))]


def part_spans(spec: PageSpec, parts: Sequence[range]) -> list[tuple[int, int]]:
    """Byte ranges of a page that ``parts`` read (the first includes the header); empty for one
    part (the whole page is read with the whole-page descriptors)."""
    if len(parts) <= 1:
        return []
    return [(0 if c == 0 else spec.segment_offset(p.start), spec.segment_offset(p.stop))
            for c, p in enumerate(parts)]


def span_base(span: int, num_slots: int, num_spans: int) -> int:
    """Index of slot 0's descriptor of byte span ``span`` in a list laid out as the staging area
    and a remote node's regions lay theirs out (see the module docstring): descriptors ``[0, n)``
    are whole pages, ``[n, 2n)`` generation words, then ``n`` per span when a page is read in
    several spans (``num_spans`` > 1); a single span is the whole page."""
    return 0 if num_spans <= 1 else (2 + span) * num_slots


def span_descs(starts: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Descriptors (address, length, device 0) of ``spans`` (byte ranges of a page) of the pages
    at ``starts``, span after span; empty for one span or none (the whole-page list serves)."""
    if len(spans) <= 1:
        return np.zeros((0, 3), dtype=np.uint64)
    n = len(starts)
    descs = np.zeros((len(spans) * n, 3), dtype=np.uint64)
    for c, (begin, end) in enumerate(spans):
        descs[c * n:(c + 1) * n, 0] = starts + np.uint64(begin)
        descs[c * n:(c + 1) * n, 1] = end - begin
    return descs
