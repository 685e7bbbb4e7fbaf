"""What the locality index adds to a request's TTFT in the simulator, from measured figures.

A routed request is looked up twice before its prefill (the router picks a node, the node's
scheduler asks what it can load), and a node that loads pages another node holds reads that
holder's slot records once more. A lookup answers from segment summaries whose size grows with the
holders of the prompt's prefix (a popular system prompt is held by every node), so its cost is
taken per holder count from ``pof bench index --json --nodes N`` (2,000 pages, p50, private server
on a unix socket; docs/bench/issue45-index-2026-12-05-run4.json, medians of 5 rounds), interpolated linearly between the
measured counts and extended along the last slope beyond them.

Where it enters: :meth:`~pof_connector.sim.engine_node.EngineNode` adds :func:`request_index_s` to a
request's first-token time (like ``request_latency_s``, it occupies no engine), with the holders
of the request's system prompt in the simulated pool as the holder count; set-ups without a pool
look nothing up.
"""

from __future__ import annotations

import itertools

LOOKUP_MS = ((4, 0.0965), (64, 0.133), (128, 0.205))
"""(holders of the looked-up prefix, lookup p50 in ms), measured after issue 45's summaries and leases."""
RESOLVE_MS = 0.2
"""The loader's read of one holder's slot records for 2,000 pages (``resolve_p50_ms``), measured."""
LOOKUPS_PER_REQUEST = 2
"""The router's and the scheduler's."""


def lookup_s(holders: int) -> float:
    """One lookup's seconds for a prefix held by ``holders`` nodes."""
    pts = LOOKUP_MS
    if holders <= pts[0][0]:
        return pts[0][1] / 1000
    for (h0, m0), (h1, m1) in itertools.pairwise(pts):
        if holders <= h1:
            return (m0 + (m1 - m0) * (holders - h0) / (h1 - h0)) / 1000
    (h0, m0), (h1, m1) = pts[-2], pts[-1]
    return (m1 + (m1 - m0) * (holders - h1) / (h1 - h0)) / 1000


def request_index_s(holders: int, loads_from_another_node: bool) -> float:
    """What the index adds to one request's TTFT."""
    return LOOKUPS_PER_REQUEST * lookup_s(holders) + (RESOLVE_MS / 1000 if loads_from_another_node else 0.0)
