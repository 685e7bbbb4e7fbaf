"""One set-up's trials on its fleet (:class:`SetupRun`, driven by :func:`pof_connector.bench.capacity.run`):
warm-up, one trial per load factor (a replay of the trace through the set-up's front door), what the
engines did in it (their counters before and after), and the goodput search carried on with it.
"""

from __future__ import annotations

import time
from typing import Any

from pof_connector.bench import BenchError, Progress
from pof_connector.bench.capacity_fleet import Fleet, UsageSampler
from pof_connector.bench.capacity_probe import warm_up
from pof_connector.bench.capacity_replay import Replay, Trial
from pof_connector.bench.capacity_search import GoodputSearch
from pof_connector.bench.capacity_setups import SHARED_SETUPS
from pof_connector.bench.capacity_stats import repeated
from pof_connector.bench.capacity_trace import TraceRequest

BLOCK = 128
"""The bench's vLLM block size in tokens (the servers' ``--block-size`` and the replay's)."""


class SetupRun:
    """The trials of one set-up on its fleet."""

    def __init__(self, fleet: Fleet, trace: list[TraceRequest], vocab: int, slo_s: float, progress: Progress,
                 trials: list[dict[str, Any]] | None = None, *, trials_per_factor: int = 1,
                 pass_rule: str = "majority", verdicts: list[dict[str, Any]] | None = None,
                 label: str | None = None) -> None:
        """``trials`` / ``verdicts``: the trial rows and factor verdicts of an earlier fleet of this
        set-up, when its search goes on here; ``trials_per_factor`` / ``pass_rule``: see
        :mod:`.capacity_stats`; ``label``: its name on progress lines (a variant's, such as
        ``fixed shares``; ``None``: the set-up's)."""
        self.fleet = fleet
        self.label = label or fleet.setup
        self.trace = trace
        self.vocab = vocab
        self.slo_s = slo_s
        self.progress = progress
        self.trials: list[dict[str, Any]] = trials if trials is not None else []
        self.verdicts: list[dict[str, Any]] = verdicts if verdicts is not None else []
        self.trials_per_factor = trials_per_factor
        self.pass_rule = pass_rule
        self._variant = len(self.trials)

    def warm_up(self) -> None:
        """:func:`~.capacity_probe.warm_up` through this set-up's front door, then a clean slate."""
        served = warm_up(self.trace, self.fleet.route(self.trace), self.vocab, BLOCK, self.slo_s,
                         variant=-10 - len(self.trials))
        self._quiesce()
        self.progress(f"  {self.label}: warmed up ({served} requests through its front door)")

    def trial(self, factor: float) -> bool:
        self._variant += 1
        self._quiesce()
        replay = Replay(self.trace, self.fleet.route(self.trace), vocab=self.vocab, variant=self._variant, block=BLOCK,
                        slo_s=self.slo_s, timeout_s=max(60.0, 20 * self.slo_s))
        before = self.fleet.counters()
        with UsageSampler(self.fleet) as sampler:
            trial = replay.run(factor)
        self._quiesce()
        after = self.fleet.counters()
        row = trial.figures(self.slo_s)
        row.update(sampler.figures())
        row.update(self._work(trial, before, after, row["mean_ttft_s"]))
        row["backends"] = _shares(trial)
        row["repeat"] = sum(1 for t in self.trials if t["factor"] == row["factor"])      # 0: its factor's first
        self.trials.append(row)
        verdict = "meets" if row["passed"] else "misses"
        errors = ", ".join(f"{n} {why}" for why, n in row["errors"].items() if not why.startswith("not sent"))
        self.progress(f"  {self.label} x{factor:.3g} ({row['offered_rps']:.2f} req/s): p90 TTFT "
                      f"{row['p90_ttft_s']} s, {row['late']} late, {row['failed']} failed"
                      f"{f' ({errors})' if errors else ''}{', gave up' if trial.gave_up else ''}, "
                      f"{row['preemptions']:.0f} preemptions, spread {row['spread_mean']} "
                      f"(floor {row['spread_floor_mean']}), mean TTFT parts {_parts_text(row['ttft_parts_s'])}"
                      f"{_router_text(row)}, {row['moved_turns']} of {row['later_turns']} later turns moved, "
                      f"tier: {row['tier_evicted_pages']} evicted, peak "
                      f"{row['tier_peak_used_bytes']} B -> {verdict} the SLO")
        return bool(row["passed"])

    def _verdict(self, factor: float, results: list[bool], passed: bool) -> None:
        self.verdicts.append({"factor": round(factor, 4), "trials": results, "passed": passed})
        if self.trials_per_factor > 1:
            self.progress(f"  {self.label} x{factor:.3g}: {sum(results)} of {len(results)} trials met the SLO "
                          f"-> {'passes' if passed else 'fails'} ({self.pass_rule} of {self.trials_per_factor})")

    def _work(self, trial: Trial, before: dict[str, float], after: dict[str, float],
              mean_ttft_s: float | None) -> dict[str, Any]:
        """What the engines did in ``trial`` (their counters ``before`` and ``after`` it);
        ``mean_ttft_s``: the trial's mean TTFT as the client saw it (``None``: no first token)."""
        d = {k: after[k] - before[k] for k in after}
        computed = d["vllm:iteration_tokens_total_sum"]
        sent = [o for o in trial.outcomes if not o.error.startswith("not sent")]
        minimum = sum(o.first_touch_tokens + o.max_tokens - 1 for o in sent)
        external = int(d["vllm:external_prefix_cache_hits_total"])
        return {"preemptions": d["vllm:num_preemptions_total"], "tokens_computed": int(computed),
                "tokens_first_touch": minimum, "tokens_recomputed": int(max(0.0, computed - minimum)),
                "engine_hit_tokens": int(d["vllm:prefix_cache_hits_total"]),
                # loads from a tier: the shared pool's (pool_hit_tokens) or a private one's
                "tier_hit_tokens": external,
                "pool_hit_tokens": external if self.fleet.setup in SHARED_SETUPS else 0,
                "tier_evicted_pages": int(d.get("vllm:pof_evicted_pages_total", 0.0)),
                "tier_evicted_pages_by_server": {k.split(":")[0]: int(v) for k, v in d.items()
                                                 if k.endswith(":evicted_pages")},
                "pool_loaded_pages": int(d["vllm:pof_loaded_pages_total"]),
                "ttft_parts_s": ttft_parts(d, mean_ttft_s),
                "engine_first_tokens": {k.split(":")[0]: int(v) for k, v in d.items() if k.endswith(":first_tokens")}}

    def _quiesce(self, timeout_s: float = 120.0) -> None:
        """Until no request runs or waits (streams closed by a give-up are aborted a moment later),
        then drop the engines' prefix caches."""
        deadline = time.monotonic() + timeout_s
        while not self.fleet.idle():
            if time.monotonic() > deadline:
                raise BenchError(f"{self.label}: the servers still had requests {timeout_s:g} s after a trial")
            time.sleep(0.5)
        self.fleet.reset_caches()

    def decide(self, factor: float) -> bool:
        """Whether ``factor`` passes, by its trials (:func:`~.capacity_stats.repeated`)."""
        return repeated(self.trial, self.trials_per_factor, self.pass_rule, self._verdict)(factor)

    def search(self, search: GoodputSearch, budget_s: float | None) -> GoodputSearch:
        """``search`` carried on with this fleet for ``budget_s`` seconds (``None``: until it ends)."""
        return search.run(self.decide, budget_s)


def _router_text(row: dict[str, Any]) -> str:
    """The pof router's own mean time before sending on, part of ``outside`` ('' without one)."""
    spent = row.get("router_decision_mean_s")
    if spent is None:
        return ""
    stages = ", ".join(f"{k} {v}" for k, v in (row.get("router_stage_mean_s") or {}).items())
    return f" (of it pof router before sending {spent}{': ' + stages if stages else ''})"


def _parts_text(parts: dict[str, float | None]) -> str:
    return " / ".join(f"{k} {v}" for k, v in parts.items() if k != "engine")


def ttft_parts(d: dict[str, float], client_mean_s: float | None) -> dict[str, float | None]:
    """Where a trial's mean TTFT went, from the engines' own histograms (``d``: their increase over
    the trial): ``queue`` (waiting for the scheduler: KV memory or a batch slot), ``prefill`` (first
    scheduled to first token: compute, or a load from the pool), ``engine`` (vLLM's TTFT, from
    arrival at its API server), and ``outside`` = the client's mean TTFT - ``engine``: HTTP, the
    router, the tokenizer. Means over requests that got a first token; ``None``: none did."""
    def mean(name: str) -> float | None:
        n = d.get(f"vllm:{name}_seconds_count", 0.0)
        return round(d[f"vllm:{name}_seconds_sum"] / n, 4) if n > 0 else None
    engine = mean("time_to_first_token")
    return {"queue": mean("request_queue_time"), "prefill": mean("request_prefill_time"), "engine": engine,
            "outside": round(client_mean_s - engine, 4) if client_mean_s is not None and engine is not None else None}


def _shares(trial: Trial) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in trial.outcomes:
        if o.backend:
            out[o.backend] = out.get(o.backend, 0) + 1
    return out
