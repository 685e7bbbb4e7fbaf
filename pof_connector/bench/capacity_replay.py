"""One trial of ``pof bench capacity``: replay a trace open-loop at a rate factor, time each request's
first token.

A session's turns go one after another (turn k's prompt holds turn k-1's prompt and an answer), each
sent at its arrival time scaled by the factor or when the previous turn answered, whichever is later;
different sessions never wait for each other. Each request streams a greedy completion, and its TTFT
is the client-side time to the first chunk.

The requests do not ask for the answer's token ids (``return_token_ids``): vllm-router 0.1.17's
``kv_aware`` gives a request that sets it no KV credit at all, which would hand every set-up behind
that router a handicap no deployment has. So the next turn carries a stand-in for the answer
(:func:`answer_tokens`, ``max_tokens`` tokens of the bench's own), as a client that re-encodes the
answer's text does: the previous prompt's whole blocks are a prefix hit, the answer is new tokens
for every set-up alike. A request is complete when its last chunk says ``finish_reason: length``
(``ignore_eos``: it decoded ``max_tokens``). A trial that can no longer meet the SLO (more
than a tenth of its requests late or failed) gives up early: the requests not yet sent are not
sent, and streams in flight are closed (vLLM aborts them), so an overloaded trial ends quickly and
leaves the servers idle for the next.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pof_connector.bench import nearest_rank
from pof_connector.bench.capacity_trace import TraceRequest, tokens_for
from pof_connector.router.stage_clock import parse_header

Route = Callable[[TraceRequest, int], tuple[str, dict[str, str]]]
"""Where a request goes: (base URL, extra headers), given the request and its turn number."""
LATE_SHARE = 0.1
"""p90 TTFT over the SLO means more than this share of requests late: then the trial has failed."""


@dataclass
class Outcome:
    """One request of a trial. ``ttft_s`` None: it got no first token (``error`` says why)."""

    session: str
    turn: int
    prompt_tokens: int
    first_touch_tokens: int
    """Prompt tokens no earlier request in the cluster computed (whole blocks only are shareable)."""
    max_tokens: int
    ttft_s: float | None = None
    error: str = ""
    backend: str = ""
    router_s: float | None = None
    """What ``pof router`` says it spent before sending the request on (``x-pof-router-overhead``:
    reading, tokenizing, choosing); ``None``: no such header (no pof router on the way)."""
    router_stages: dict[str, float] = field(default_factory=dict)
    """That time by stage (``x-pof-router-stages``: parse, tokenize, lookup, choose, proxy); empty
    without a pof router."""
    route: str = ""
    """Why `pof router` chose the backend (``x-pof-route-reason``); empty without one."""


def answer_tokens(session: str, turn: int, n: int, vocab: int, variant: int) -> list[int]:
    """The stand-in for turn ``turn``'s answer that the next turn's prompt carries."""
    return tokens_for("answer", f"{session}/{turn}", n, vocab, variant)


class FirstTouch:
    """Which leading blocks of a prompt some earlier request already computed (its prompt: the
    answer it generated is not what the next turn carries), cluster-wide."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._seen: set[bytes] = set()
        self._lock = threading.Lock()

    def _digests(self, tokens: list[int], blocks: int) -> list[bytes]:
        out, h = [], hashlib.sha256()
        for i in range(blocks):
            h.update(json.dumps(tokens[i * self.block:(i + 1) * self.block]).encode())
            out.append(h.copy().digest())
        return out

    def new_tokens(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` that must be computed at least once (never the last: logits)."""
        keys = self._digests(prompt, (len(prompt) - 1) // self.block)
        with self._lock:
            n = next((i for i, k in enumerate(keys) if k not in self._seen), len(keys))
        return len(prompt) - n * self.block

    def computed(self, tokens: list[int]) -> None:
        keys = self._digests(tokens, len(tokens) // self.block)
        with self._lock:
            self._seen.update(keys)


@dataclass
class Trial:
    factor: float
    offered_rps: float
    outcomes: list[Outcome] = field(default_factory=list)
    gave_up: bool = False
    wall_s: float = 0.0

    def ttfts(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes if o.ttft_s is not None]

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.ttft_s is None)

    def p90(self) -> float:
        """p90 TTFT; a request without a first token counts as infinitely late."""
        values = sorted(o.ttft_s if o.ttft_s is not None else math.inf for o in self.outcomes)
        return nearest_rank(values, 0.9) if values else math.inf

    def passed(self, slo_s: float) -> bool:
        return not self.gave_up and self.failed == 0 and self.p90() <= slo_s

    def figures(self, slo_s: float) -> dict[str, Any]:
        ttfts = self.ttfts()
        p90 = self.p90()
        return {"factor": round(self.factor, 4), "offered_rps": round(self.offered_rps, 4),
                "passed": self.passed(slo_s), "gave_up": self.gave_up, "requests": len(self.outcomes),
                "failed": self.failed, "late": sum(1 for t in ttfts if t > slo_s),
                "mean_ttft_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
                "p90_ttft_s": round(p90, 4) if math.isfinite(p90) else None, "wall_s": round(self.wall_s, 1),
                "router_decision_mean_s": self.router_decision_mean(),
                "router_stage_mean_s": self.router_stage_means(),
                "errors": self.errors(), **self.by_kind(), **self.moves()}

    def moves(self) -> dict[str, Any]:
        """``moved_turns``: later turns of a session sent to another backend than its previous
        turn (its context then comes from a tier, or is recomputed, and what it allocates there
        displaces cached context); ``later_turns``: all such turns; ``routes``: requests per
        ``x-pof-route-reason`` (``{}`` without a pof router)."""
        last: dict[str, str] = {}
        later = moved = 0
        routes: dict[str, int] = {}
        for o in sorted(self.outcomes, key=lambda o: (o.session, o.turn)):
            if not o.backend:
                continue
            if o.session in last:
                later += 1
                moved += last[o.session] != o.backend
            last[o.session] = o.backend
            if o.route:
                routes[o.route] = routes.get(o.route, 0) + 1
        return {"later_turns": later, "moved_turns": moved, "routes": routes}

    def router_decision_mean(self) -> float | None:
        """Mean of the router's own time before sending on (:attr:`Outcome.router_s`); ``None``:
        no request went through a pof router."""
        spent = [o.router_s for o in self.outcomes if o.router_s is not None]
        return round(statistics.fmean(spent), 4) if spent else None

    def router_stage_means(self) -> dict[str, float] | None:
        """Mean seconds per stage of the router's own time (where :meth:`router_decision_mean`
        went under this trial's load); ``None``: no request went through a pof router."""
        staged = [o.router_stages for o in self.outcomes if o.router_stages]
        if not staged:
            return None
        return {k: round(statistics.fmean(s.get(k, 0.0) for s in staged), 5) for k in staged[0]}

    def by_kind(self) -> dict[str, dict[str, float | int | None]]:
        """p50 / p90 TTFT of the turns of multi-turn sessions (``sessions``) and of one-off requests
        (``one_off``) apart: a pool moves the first's context, the second mostly share system prompts."""
        turns: dict[str, int] = {}
        for o in self.outcomes:
            turns[o.session] = turns.get(o.session, 0) + 1
        out: dict[str, dict[str, float | int | None]] = {}
        for kind, multi in (("sessions", True), ("one_off", False)):
            values = sorted(o.ttft_s if o.ttft_s is not None else math.inf
                            for o in self.outcomes if (turns[o.session] > 1) == multi)
            p50, p90 = (_quantile(values, 0.5), _quantile(values, 0.9)) if values else (None, None)
            out[kind] = {"requests": len(values), "p50_ttft_s": p50, "p90_ttft_s": p90}
        return out

    def errors(self) -> dict[str, int]:
        """How many requests failed for each reason (the reason cut before its details)."""
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.error:
                why = o.error.split(":")[0] if not o.error.startswith(("not sent", "closed")) else o.error
                out[why] = out.get(why, 0) + 1
        return out


def _seconds(header: str | None) -> float | None:
    """A header's value in seconds; ``None`` when absent or not a number."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


def _stages(header: str | None) -> dict[str, float]:
    """``x-pof-router-stages`` as seconds per stage; {} when absent or unreadable."""
    try:
        return parse_header(header)
    except ValueError:
        return {}


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` (a request without a first token is infinitely late:
    ``None`` when the quantile falls on one)."""
    v = nearest_rank(values, q)
    return round(v, 4) if math.isfinite(v) else None


class Replay:
    """Sends a trace through ``route`` at ``factor`` times its arrival rate."""

    def __init__(self, trace: list[TraceRequest], route: Route, *, vocab: int, variant: int, block: int,
                 slo_s: float, timeout_s: float) -> None:
        """``variant``: the token-content variant (a fresh one per trial: trials share no prefix)."""
        self.trace = trace
        self.route = route
        self.vocab = vocab
        self.variant = variant
        self.slo_s = slo_s
        self.timeout_s = timeout_s
        self.touch = FirstTouch(block)
        self._give_up = threading.Event()
        self._lock = threading.Lock()
        self._bad = 0

    def run(self, factor: float) -> Trial:
        span = max(self.trace[-1].at, 1e-3) / factor
        trial = Trial(factor, len(self.trace) / span)
        sessions: dict[str, list[TraceRequest]] = {}
        for r in self.trace:
            sessions.setdefault(r.session, []).append(r)
        allowed = int(LATE_SHARE * len(self.trace))
        t0 = time.perf_counter() + 0.2
        with ThreadPoolExecutor(len(sessions)) as ex:
            futures = [ex.submit(self._session, turns, factor, t0, allowed) for turns in sessions.values()]
            for f in futures:
                trial.outcomes += f.result()
        trial.gave_up = self._give_up.is_set()
        trial.wall_s = time.perf_counter() - t0
        return trial

    def _session(self, turns: list[TraceRequest], factor: float, t0: float, allowed: int) -> list[Outcome]:
        first = turns[0]
        context = tokens_for("system", first.tenant, first.system_tokens, self.vocab, self.variant)
        out: list[Outcome] = []
        for k, r in enumerate(turns):
            prompt = context + tokens_for("turn", f"{r.session}/{k}", r.turn_tokens, self.vocab, self.variant)
            o = Outcome(r.session, k, len(prompt), len(prompt), r.max_tokens)
            out.append(o)
            if k == 0 or out[-2].ttft_s is not None:
                # Woken by a give-up: a trial that gave up ends then, not at its last arrival, so
                # its wall time and KV-use samples hold no idle tail.
                self._give_up.wait(max(0.0, t0 + r.at / factor - time.perf_counter()))
            if self._give_up.is_set() or (k > 0 and out[-2].ttft_s is None):
                why = "the trial gave up" if self._give_up.is_set() else "an earlier turn failed"
                o.error = f"not sent: {why}"
                continue
            o.first_touch_tokens = self.touch.new_tokens(prompt)       # what the cluster computed until now
            url, headers = self.route(r, k)
            done = self._one(o, url, headers, prompt)
            if o.ttft_s is None or o.ttft_s > self.slo_s:
                with self._lock:
                    self._bad += 1
                    if self._bad > allowed:
                        self._give_up.set()
            if done:
                self.touch.computed(prompt)
                context = prompt + answer_tokens(r.session, k, r.max_tokens, self.vocab, self.variant)
        return out

    def _one(self, o: Outcome, url: str, headers: dict[str, str], prompt: list[int]) -> bool:
        """Stream one completion; whether it completed (else ``o.error`` is set)."""
        # no return_token_ids: see the module docstring
        body = {"model": "m", "prompt": prompt, "max_tokens": o.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
        t0 = time.perf_counter()
        finish: str | None = None
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                o.backend = r.headers.get("x-pof-backend", "") or url
                o.router_s = _seconds(r.headers.get("x-pof-router-overhead"))
                o.router_stages = _stages(r.headers.get("x-pof-router-stages"))
                o.route = r.headers.get("x-pof-route-reason", "")
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:])["choices"]
                    if not choices:
                        continue
                    # vLLM sends no chunk before the first token (an empty one only mid-prefill: never)
                    if o.ttft_s is None:
                        o.ttft_s = time.perf_counter() - t0
                    finish = choices[0].get("finish_reason") or finish
                    if self._give_up.is_set():
                        o.error = "closed: the trial gave up"
                        return False
        except urllib.error.HTTPError as e:
            o.error = f"HTTP {e.code}: {e.read()[:200]!r}"
        except (OSError, ValueError, KeyError, IndexError) as e:
            o.error = f"{type(e).__name__}: {e}"
        if o.error:
            o.ttft_s = None
            return False
        if finish != "length":
            o.error, o.ttft_s = f"finished {finish!r}, not after its {o.max_tokens} tokens", None
            return False
        return True
