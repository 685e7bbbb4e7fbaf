"""Estimated time to first token of a request on one node: what `pof router` minimises.

    ttft = overhead * (waiting + 1)                       requests ahead of it, and itself
         + s_per_token * (waiting_tokens + recompute)     their prefill and its own
         + s_per_decoding * decoding                      requests past their first token share steps
         + fetch_factor * fetch_s                         its pages loaded from the pool

- ``waiting`` / ``waiting_tokens``: requests this router sent to the node that have no first
  token yet, and the tokens they still have to compute: theirs less what the node computed since
  it began them, at ``s_per_token`` (:meth:`~pof_connector.router.backend.Backend.tokens_left`);
- ``recompute``: prompt tokens neither in the engine's prefix cache nor loadable from the pool
  (the last prompt token is always computed, as engines do); the router counts a prompt's pages
  that a request in flight on the node shares as in its cache
  (:meth:`~pof_connector.router.backend.Backend.in_flight_tokens`);
- ``fetch_s``: tokens loaded from the pool beyond the engine's own hit, times the KV bytes per
  token, over each tier's configured bandwidth; ``fetch_factor`` (start 1) is what loads really
  cost against that (per-page work, checksums, a busy host).

The four coefficients start from the configuration and are learnt from observed TTFTs by
recursive least squares with forgetting, so the model follows the hardware it runs on (a request
on a busy 1-core server costs far more than a token count says).

Why the fit is guarded (a ``vllm bench serve`` run through the router once drove
``prefill_s_per_token`` from 1.3e-4 to its floor, 1e-7): a prompt the engine had cached (a
benchmark re-run, a prompt the router did not know the engine held) answers in milliseconds
while the router counted all its tokens as prefill, so every such sample says "tokens are free".
So (1) a sample is corrected by the cached tokens the engine reports for it
(``usage.prompt_tokens_details.cached_tokens``) when it does, else by the prefix the router sent
that backend before (:class:`~pof_connector.router.sent_prefixes.SentPrefixes`); (2) each coefficient stays at or
above its start value / ``learn_range`` (and below start x ``learn_range`` or a fixed ceiling,
whichever is higher); (3) the covariance is capped at its start (without that,
directions no sample excites -- all prompts of one length make the queue and token features
collinear -- grow by 1/FORGET per sample and the next odd sample swings them to a bound).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

from pof_connector.router.router_config import CostConfig

FORGET = 0.98
"""Weight of the past per observation: about the last 50 requests count."""
TOKEN_SCALE = 1e-3
"""Tokens enter the regression in thousands, so the three features have similar magnitudes."""
ERROR_WEIGHT = 0.1
"""Weight of a new sample in the estimates' mean error (:attr:`CostModel.error_s`)."""
FETCH_BOUNDS = (0.1, 1e4)
CEILINGS = (10.0, 0.1 / TOKEN_SCALE, 1.0)
"""Upper bounds (overhead s, s per token, s per decoding request) that hold whatever the start
values: a slow CPU box is far above a GPU-sized start value, and that is no fault of the fit."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node as seen for one request."""

    name: str
    prompt_tokens: int
    engine_tokens: int = 0
    """Leading tokens in the engine's own prefix cache."""
    usable: dict[str, int] = field(default_factory=dict)
    """Leading tokens the node's pool can load, per tier."""
    bytes_per_token: float = 0.0
    running: int = 0
    """Requests this router has in flight on the node (waiting ones included)."""
    waiting: int = 0
    """Of those, the ones without a first token yet."""
    waiting_tokens: int = 0
    """Tokens those still have to compute."""


@dataclass(frozen=True, slots=True)
class Estimate:
    name: str
    ttft_s: float
    recompute_tokens: int
    fetch_tokens: int
    fetch_s: float
    features: tuple[float, float, float, float]
    """(waiting + 1, tokens to compute before the first token / 1000, decoding requests, fetch_s)."""
    prompt_tokens: int = 0
    queued_tokens: int = 0
    """Tokens requests ahead of it still had to compute (``waiting_tokens``)."""

    def corrected(self, cached_tokens: int) -> tuple[float, float, float, float]:
        """The features had the engine computed only the prompt tokens it did not have cached
        (``cached_tokens``, as the engine reported for the request: its own prefix cache and
        tokens loaded through its connector)."""
        own = max(self.prompt_tokens - cached_tokens, 1)
        w, _, d, f = self.features
        return (w, (self.queued_tokens + own) * TOKEN_SCALE, d, f)


class CostModel:
    def __init__(self, config: CostConfig) -> None:
        self.config = config
        self._theta = np.array([config.request_overhead_s, config.prefill_s_per_token / TOKEN_SCALE,
                                config.decode_s_per_running, 1.0])
        self._coef = tuple(float(v) for v in self._theta)
        """``_theta`` as Python floats: an estimate is four products, cheaper than a numpy call (the
        router weighs every backend per request)."""
        r = config.learn_range
        self._low = np.array([self._theta[0] / r, self._theta[1] / r, 0.0, FETCH_BOUNDS[0]])
        self._high = np.array([max(self._theta[0] * r, CEILINGS[0]), max(self._theta[1] * r, CEILINGS[1]),
                               max(self._theta[2] * r, CEILINGS[2]), FETCH_BOUNDS[1]])
        # Start values may be off by an order of magnitude: a wide prior learns within ~10 requests.
        self._p = np.diag(np.maximum(self._theta, 1e-2) ** 2) * 100.0
        self._p_trace = float(np.trace(self._p))
        self._learn = config.learn
        self._lock = threading.Lock()
        self.observed = 0
        """Samples learnt from."""
        self.error_s = 0.0
        """Mean absolute error of the estimates against the TTFTs observed (weighted to the last
        ~10 samples; 0 before any): how far apart two estimates must be to mean something."""
        self._misses = 0

    @property
    def s_per_token(self) -> float:
        return self._coef[1] * TOKEN_SCALE

    @property
    def overhead_s(self) -> float:
        return self._coef[0]

    @property
    def s_per_decoding(self) -> float:
        return self._coef[2]

    @property
    def fetch_factor(self) -> float:
        return self._coef[3]

    def estimate(self, c: Candidate) -> Estimate:
        recompute, fetch_tokens, fetch_s = self.prefix_terms(c.prompt_tokens, c.engine_tokens, c.usable,
                                                             c.bytes_per_token)
        x = _features(recompute, fetch_s, c.running, c.waiting, c.waiting_tokens)
        return Estimate(c.name, self._dot(x), recompute, fetch_tokens, fetch_s, x, c.prompt_tokens, c.waiting_tokens)

    def prefix_terms(self, prompt_tokens: int, engine_tokens: int, usable: dict[str, int],
                     bytes_per_token: float) -> tuple[int, int, float]:
        """What a node's locality makes of a prompt: (tokens to recompute, tokens to fetch from
        the pool, seconds the fetch takes at the configured bandwidths)."""
        cap = max(prompt_tokens - 1, 0)
        engine = min(engine_tokens, cap)
        pool_total = sum(usable.values()) if usable else 0
        pool = min(pool_total, cap)
        fetch_tokens = max(pool - engine, 0)
        fetch_s = 0.0
        if fetch_tokens and pool_total:
            gbps_of = self.config.tier_gbps
            for tier, n in usable.items():
                gbps = gbps_of.get(tier, gbps_of.get("remote", 1.0))
                fetch_s += fetch_tokens * n / pool_total * bytes_per_token / (gbps * 1e9)
        return prompt_tokens - max(engine, pool), fetch_tokens, fetch_s

    def ttft_s(self, recompute: int, fetch_s: float, running: int, waiting: int, waiting_tokens: int) -> float:
        """``estimate(...).ttft_s`` (the same float) from :meth:`prefix_terms` and the node's
        load, without building an :class:`Estimate`: the router weighs every backend per request
        with it (nodes sharing a locality share their prefix terms) and builds the estimate of
        the chosen one only."""
        # _dot(_features(...)) written out: one call, not three, and no max() / float() calls (a
        # float times a whole number is the float times float(number): the same product)
        c0, c1, c2, c3 = self._coef
        return (c0 * (waiting + 1.0) + c1 * ((waiting_tokens + recompute) * TOKEN_SCALE)
                + c2 * (running - waiting if running > waiting else 0) + c3 * fetch_s)

    def prefix_s(self, recompute: int, fetch_s: float) -> float:
        """The part of :meth:`ttft_s` a node's locality decides: its ``recompute`` tokens and its
        pool load of ``fetch_s`` seconds at the configured bandwidths (:meth:`prefix_terms`)."""
        c = self._coef
        return c[1] * (recompute * TOKEN_SCALE) + c[3] * fetch_s

    def _dot(self, x: tuple[float, float, float, float]) -> float:
        c = self._coef
        return c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3]

    def observe(self, est: Estimate, ttft_s: float, cached_tokens: int | None = None) -> None:
        """Learn from a request whose first token came ``ttft_s`` after it was sent;
        ``cached_tokens``: the prompt tokens the engine reported it did not compute (``None``:
        it did not say, the estimate's own view stands)."""
        if not math.isfinite(ttft_s) or ttft_s < 0:
            return
        miss = abs(est.ttft_s - ttft_s)
        with self._lock:
            self.error_s = miss if self._misses == 0 else self.error_s + ERROR_WEIGHT * (miss - self.error_s)
            self._misses += 1
        if not self._learn:
            return
        x = np.array(est.corrected(cached_tokens) if cached_tokens is not None else est.features)
        # the ufuncs and methods np.clip / np.outer / np.trace call, without their wrappers' cost
        # (every routed request is a sample; `pof sim` observes one per simulated request)
        with self._lock:
            px = self._p @ x
            gain = px / (FORGET + x @ px)
            self._theta = np.minimum(np.maximum(self._theta + gain * (ttft_s - x @ self._theta), self._low),
                                     self._high)
            self._coef = tuple(self._theta.tolist())
            p = (self._p - gain[:, None] * px[None, :]) / FORGET
            trace = float(p.trace())
            self._p = p * (self._p_trace / trace) if trace > self._p_trace else p
            self.observed += 1


def _features(recompute: int, fetch_s: float, running: int, waiting: int,
              waiting_tokens: int) -> tuple[float, float, float, float]:
    return (waiting + 1.0, (waiting_tokens + recompute) * TOKEN_SCALE, float(max(running - waiting, 0)), fetch_s)
