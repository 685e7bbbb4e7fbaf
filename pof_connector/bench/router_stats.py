"""How sure `pof bench router` can be of its ratio: a paired bootstrap over the requests.

Every router sends the same requests in the same order within a round, so request ``i`` of one
router and request ``i`` of another saw the same prompt; resampling request indices (the same
indices for every router, within each round) keeps that pairing, and a prompt that is slow for
everyone moves both sides of the ratio together. The interval says how far the ratio could move
had other requests of the same workload been drawn. It does not cover what changes from one round
to the next (a host that is slower for a while): ``ratio_vs_best_by_round`` shows that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DRAWS = 4000
"""Bootstrap resamples: the 2.5 % and 97.5 % quantiles move by about 0.01 at this count."""
LEVEL = 0.95


def ratio_interval(rounds: Sequence[Mapping[str, Sequence[float]]], stock: Sequence[str], *, pof: str = "pof",
                   draws: int = DRAWS, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """The ``level`` interval of mean TTFT of ``pof`` / the lowest mean TTFT of the ``stock``
    routers, all rounds pooled; ``rounds``: per round, each router's TTFTs in request order."""
    rng = np.random.default_rng(seed)
    names = [pof, *stock]
    sums = np.zeros((draws, len(names)))
    count = 0
    for r in rounds:
        ttfts = np.array([r[n] for n in names], dtype=float)          # routers x requests
        n = ttfts.shape[1]
        picks = rng.integers(0, n, size=(draws, n))
        sums += ttfts[:, picks].sum(axis=2).T
        count += n
    means = sums / count
    ratios = means[:, 0] / means[:, 1:].min(axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(ratios, [tail, 1 - tail])
    return round(float(lo), 4), round(float(hi), 4)


def goal_verdict(interval: Sequence[float], goal: float) -> str:
    """``met`` when the whole interval (low, high) is at or below ``goal`` (pof / best stock must
    not exceed it), ``not met`` when the whole interval is above it, else ``undecided``."""
    lo, hi = interval
    return "met" if hi <= goal else "not met" if lo > goal else "undecided"
