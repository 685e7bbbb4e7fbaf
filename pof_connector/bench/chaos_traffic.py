"""The traffic of ``pof bench chaos``: a seeded multi-tenant mix, each answer checked against a
reference server without the connector.

Tenants (each with its own ``cache_salt``) share a long system prompt; most requests continue a
multi-turn session (the previous prompt, the reference answer, a new user turn), the rest open a
new one. An eviction storm (a fault) turns the next requests into long unique prompts of a tenant
of its own, enough to overflow every tier. Prompts are token ids, so nothing depends on a
tokenizer. One request at a time by default: vLLM's CPU kernels give slightly different numbers
for a request batched with others, which can flip a near-tie greedy token, and a reference that
runs alone could not tell that from a wrong page.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BLOCK = 128
"""vLLM's block size on these servers (``--block-size``): hits are counted in whole blocks."""


@dataclass(frozen=True)
class Request:
    tenant: str
    salt: str
    session: str
    prompt: tuple[int, ...]
    storm: bool = False


@dataclass
class Outcome:
    """What one request got. ``answer`` None: it failed (``error`` says how)."""

    at_s: float
    done_s: float
    request: Request
    reference: list[int]
    answer: list[int] | None = None
    error: str = ""
    cached_tokens: int = 0
    bound_tokens: int = 0
    backend: str = ""
    recheck: list[int] | None = None
    """When the answer differed from the reference's: the reference's answer once more, computed
    with exactly ``cached_tokens`` from its own prefix cache, as the pooled server computed it."""
    recheck_cached: int = 0

    @property
    def differs(self) -> bool:
        """The answer is not the reference's first answer."""
        return self.answer is not None and self.answer != self.reference

    @property
    def wrong(self) -> bool:
        """The answer differs from the reference's computed both ways (a cached prefix of the same
        length included): what no numerical path of vLLM without the pool explains."""
        return self.differs and self.answer != self.recheck

    @property
    def full_hit(self) -> bool:
        """Served with every block an earlier request of its tenant computed (engine cache or pool)."""
        return self.answer is not None and self.bound_tokens > 0 and self.cached_tokens >= self.bound_tokens


@dataclass
class Sessions:
    """The seeded mix: which prompt comes next."""

    vocab: int
    seed: int
    tenants: int = 4
    system_tokens: int = 640
    max_prompt_tokens: int = 3000
    storm_tokens: int = 1900
    hot_share: float = 0.4
    _rnd: random.Random = field(init=False)
    _systems: list[tuple[int, ...]] = field(init=False)
    _open: dict[str, list[tuple[str, tuple[int, ...]]]] = field(init=False)
    _lock: threading.Lock = field(init=False)
    _storm_left: int = 0
    _count: int = 0

    def __post_init__(self) -> None:
        self._rnd = random.Random(self.seed)
        self._systems = [self._tokens(self.system_tokens) for _ in range(self.tenants)]
        self._open = {f"t{t}": [] for t in range(self.tenants)}
        self._lock = threading.Lock()

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self._rnd.randrange(3, self.vocab) for _ in range(n))    # 0-2: BOS, EOS, PAD

    def storm(self, requests: int) -> None:
        """The next ``requests`` prompts are long unique ones (an eviction storm)."""
        with self._lock:
            self._storm_left += requests

    def storming(self) -> bool:
        with self._lock:
            return self._storm_left > 0

    def next(self) -> Request:
        with self._lock:
            self._count += 1
            if self._storm_left > 0:
                self._storm_left -= 1
                return Request("storm", "storm", f"storm-{self._count}", self._tokens(self.storm_tokens), storm=True)
            weights = [self.hot_share] + [(1 - self.hot_share) / (self.tenants - 1)] * (self.tenants - 1)
            t = self._rnd.choices(range(self.tenants), weights=weights)[0]
            tenant = f"t{t}"
            sessions = self._open[tenant]
            turn = self._tokens(self._rnd.randrange(24, 96))
            if sessions and self._rnd.random() < 0.7:
                session, history = sessions.pop(self._rnd.randrange(len(sessions)))
                prompt = history + turn
            else:
                session, prompt = f"{tenant}-s{self._count}", self._systems[t] + turn
            return Request(tenant, f"salt-{tenant}", session, prompt)

    def answered(self, request: Request, reference: list[int]) -> None:
        """The session goes on from the reference answer (while it fits the context)."""
        if request.storm:
            return
        history = request.prompt + tuple(reference)
        if len(history) + 200 < self.max_prompt_tokens:
            with self._lock:
                self._open[request.tenant].append((request.session, history))


class HitBound:
    """Per salt, the blocks earlier prompts computed: a request's cached tokens should reach them."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int, int]] = set()

    def bound(self, salt: str, prompt: tuple[int, ...]) -> int:
        """Leading whole blocks (never the last token) seen before, in tokens; then remembers these."""
        full = (len(prompt) - 1) // BLOCK
        keys = [(salt, i, hash(prompt[: (i + 1) * BLOCK])) for i in range(full)]
        n = 0
        while n < full and keys[n] in self._seen:
            n += 1
        self._seen.update(keys)
        return n * BLOCK


def complete(url: str, request: Request, max_tokens: int, timeout_s: float,
             headers: dict[str, str] | None = None) -> tuple[list[int], int, str]:
    """A greedy completion of ``request`` at ``url``: (token ids, cached prompt tokens, backend).
    Raises ``OSError`` (HTTP errors included) or ``ValueError`` for an answer without token ids."""
    body: dict[str, Any] = {"model": "m", "prompt": list(request.prompt), "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                            "cache_salt": request.salt}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
        backend = r.headers.get("x-pof-backend", "")
    tokens = out["choices"][0].get("token_ids")
    if not isinstance(tokens, list):
        raise ValueError(f"no token ids in the answer: {str(out)[:200]}")
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return [int(t) for t in tokens], int(details.get("cached_tokens") or 0), backend


def _post(url: str, timeout_s: float) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout_s) as r:
        r.read()


class Client:
    """Sends the mix through the router one request at a time, each first to the reference."""

    def __init__(self, router_url: str, reference_url: str, sessions: Sessions, now: Callable[[], float], *,
                 max_tokens: int = 8, timeout_s: float = 300.0) -> None:
        self.router_url = router_url
        self.reference_url = reference_url
        self.sessions = sessions
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self.now = now
        self.error = ""
        """Why the traffic stopped early ("": it did not)."""
        self._bound = HitBound()

    def run(self, stop: threading.Event, max_requests: int) -> None:
        """Until ``stop`` or ``max_requests``; a failing reference server ends it (``error``)."""
        try:
            while not stop.is_set() and len(self.outcomes) < max_requests:
                self.one()
        except (OSError, ValueError, KeyError) as e:
            self.error = f"the reference server failed: {type(e).__name__}: {e}"

    def one(self) -> Outcome:
        request = self.sessions.next()
        reference, _, _ = complete(self.reference_url, request, self.max_tokens, self.timeout_s)
        self.sessions.answered(request, reference)
        bound = self._bound.bound(request.salt, request.prompt)
        out = Outcome(self.now(), 0.0, request, reference, bound_tokens=bound)
        try:
            out.answer, out.cached_tokens, out.backend = complete(
                self.router_url, request, self.max_tokens, self.timeout_s, {"x-session-id": request.session})
        except urllib.error.HTTPError as e:
            out.error = f"HTTP {e.code}: {e.read()[:200]!r}"
        except (OSError, ValueError, KeyError) as e:
            out.error = f"{type(e).__name__}: {e}"
        out.done_s = self.now()
        if out.differs:
            out.recheck, out.recheck_cached = self._recheck(request, out.cached_tokens)
        self.outcomes.append(out)
        return out

    def _recheck(self, request: Request, cached: int) -> tuple[list[int], int]:
        """The reference's answer computed with ``cached`` prompt tokens from its own prefix cache.

        A prefix hit changes how vLLM computes the rest of the prompt (attention over cached
        blocks, smaller matmuls), and on a CPU that can flip a near-tie greedy token with or
        without a pool. The pool is wrong only if the reference, computed the same way, disagrees."""
        _post(self.reference_url + "/reset_prefix_cache", self.timeout_s)
        if cached:
            warm = Request(request.tenant, request.salt, request.session, request.prompt[: cached + 1])
            complete(self.reference_url, warm, 1, self.timeout_s)
        tokens, got, _ = complete(self.reference_url, request, self.max_tokens, self.timeout_s)
        return tokens, got
