"""``pof sim calibrate``: a node profile fitted to a ``pof bench capacity --json`` run on this host
(and, optionally, a ``pof bench vllm --json`` run for the pool tier's load speed).

What the bench states is taken as is: KV blocks per server (``cluster.kv_tokens_per_server /
block``), the block size, ``max_num_seqs``; the KV bytes per token come from the model's
``config.json`` (layers x KV heads x head dim x 2 x dtype bytes) when it is readable.

The engine's costs are measured when the bench recorded them (``decode_samples``: the pace of
decode steps alone at each cold sample's context and of short requests decoding together;
``unloaded_samples``: cold TTFTs of the trace's prompt sizes): the step costs (fixed, per running
request, per token of context they attend to) are a least-squares fit to the step times, and the
API server's latency and the prefill costs (per token, and the part that grows with the context:
attention) a fit to the cold TTFTs less one step. No trial of any set-up is used then: ``pof sim
validate`` predicts them all, and the fit's error on ``fit_setups`` is only reported.

An older run, without decode samples, gets the costs by a grid search instead: it keeps the
unloaded p90 TTFT the bench measured (the SLO's base: ``decode_step_s + prefill_s_per_token x p90
prompt = unloaded p90``) and picks the split between the API server's latency per request, the
fixed step cost and the per-token cost, and the per-request step cost, whose replay of the
``fit_setups``' trials (by default the physical baseline, ``static``, alone) comes closest to the
measured mean and p90 TTFT and to the measured pass / fail of each trial.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pof_connector.bench import nearest_rank
from pof_connector.bench.capacity_probe import BATCH_STEPS, DECODE_STEPS, prompt_sizes
from pof_connector.config import ConfigError
from pof_connector.sim.bench_run import BenchRun, replay_trial
from pof_connector.sim.profile import Profile, TierProfile, load_profile

FIXED_SHARES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
"""Shares of the shortest cold TTFT the bench sampled (the unloaded p90 TTFT for a run that recorded
no samples) tried as the fixed step cost (the rest of the p90 prompt's TTFT is prefill)."""
PER_SEQ = (0.0, 0.05, 0.15, 0.4)
"""Cost per running request in a step, tried as a share of the fixed step cost."""
LATENCY_SHARES = (0.0, 0.15, 0.3, 0.5)
"""Shares of the same base (see :data:`FIXED_SHARES`) tried as the API server's latency per request
(no engine time)."""
CTX_SHARES = (0.0, 0.25, 0.5, 0.75, 0.9)
"""Shares of the p90 prompt's cold prefill tried as attention's cost that grows with the context
(``prefill_s_per_token_ctx``), when the bench recorded its cold samples of several prompt sizes,
which say how TTFT grows with the prompt; without them the cost per token is taken as flat."""
PASS_FAIL_WEIGHT = 4.0
"""A replayed trial that passes where the bench's failed (or the reverse) costs this much."""
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}


@dataclass(frozen=True)
class Fit:
    profile: Profile
    error: float
    """Mean squared log error (and pass / fail penalties) per fitted trial; lower is closer."""
    fitted_on: tuple[str, ...]
    sources: tuple[str, ...]
    notes: tuple[str, ...]
    """How each non-fitted value was found."""

    def to_json(self) -> dict[str, Any]:
        p = self.profile
        return {"profile": profile_mapping(p), "error": round(self.error, 4), "fitted_on": list(self.fitted_on),
                "sources": list(self.sources), "notes": list(self.notes), "name": p.name}


def kv_bytes_per_token(cluster: dict[str, Any]) -> int | None:
    """From the bench model's config.json (``None``: not readable here)."""
    try:
        cfg = json.loads((Path(str(cluster.get("model", ""))) / "config.json").read_text())
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        dtype = DTYPE_BYTES.get(str(cluster.get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype")), 2)
        return int(cfg["num_hidden_layers"] * heads * head_dim * 2 * dtype)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def base_profile(run: BenchRun, vllm: dict[str, Any] | None, name: str) -> tuple[Profile, list[str]]:
    """The profile before the fit: what the bench states, the rest from ``cpu-bench``."""
    start = load_profile("cpu-bench")
    c = run.cluster
    block = int(c["block"])
    notes = [f"kv_blocks, block_tokens, max_running: the bench's cluster ({c['kv_tokens_per_server']} KV tokens "
             f"per server, block {block}, max_num_seqs {c['max_num_seqs']})"]
    bpt = kv_bytes_per_token(c)
    if bpt is None:
        bpt = start.kv_bytes_per_token
        notes.append(f"kv_bytes_per_token: the model's config.json was not readable; cpu-bench's {bpt}")
    else:
        notes.append(f"kv_bytes_per_token: {c.get('model')}'s config.json at dtype {c.get('dtype')}")
    local = start.local_tier
    if vllm is not None:
        loaded = vllm.get("loaded_bytes")
        overhead = (vllm.get("load_overhead_s") or {}).get("pof")
        if isinstance(loaded, (int, float)) and isinstance(overhead, (int, float)) and loaded > 0 and overhead > 0:
            local = replace(local, gbps=round(loaded / overhead / 1e9, 3))
            notes.append(f"local_tier.gbps: pof bench vllm loaded {loaded} B in {overhead} s above the engine's "
                         "own prefix-cache TTFT")
    if run.tier_bytes_per_server is not None:
        local = replace(local, capacity_gb=run.tier_bytes_per_server / 1e9)
        notes.append(f"local_tier.capacity_gb: the bench's {run.tier_bytes_per_server} B of tier memory per server "
                     "(private for every set-up but pof, whose servers share theirs)")
    profile = replace(start, name=name, kv_blocks=int(c["kv_tokens_per_server"]) // block, block_tokens=block,
                      max_running=int(c["max_num_seqs"]), kv_bytes_per_token=bpt, local_tier=local,
                      prefill_s_per_token_ctx=0.0, decode_s_per_ctx_token=0.0)
    return profile, notes


def _log_err(sim: float | None, measured: float | None) -> float:
    if sim is None or measured is None or not math.isfinite(sim) or sim <= 0 or measured <= 0:
        return 0.0
    return math.log(sim / measured) ** 2


def score(run: BenchRun, profile: Profile, setups: tuple[str, ...]) -> float:
    """How far the replay of ``setups``' measured trials is from them (see :data:`PASS_FAIL_WEIGHT`),
    plus how far the cold TTFT of each of the bench's unloaded samples is from what it measured."""
    cold = sum(_log_err(profile.cold_ttft_s(n), ttft) for n, ttft in run.unloaded_samples) \
        / max(len(run.unloaded_samples), 1)
    total, n = 0.0, 0
    for name in setups:
        for t in run.setups[name].get("trials") or []:
            r = replay_trial(run, profile, name, float(t["factor"]), give_up=False)
            p90 = None if math.isinf(r.p90_ttft_s) else r.p90_ttft_s
            total += _log_err(r.mean_ttft_s, t.get("mean_ttft_s")) + _log_err(p90, t.get("p90_ttft_s"))
            total += PASS_FAIL_WEIGHT * (bool(r.passed) != bool(t.get("passed")))
            n += 1
    return cold + total / max(n, 1)


def nonnegative_lstsq(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least squares of ``rows @ x = target`` with every ``x >= 0``: the closest of the fits over the
    subsets of the terms (a term left out is 0) whose coefficients all come out non-negative."""
    a, y = np.asarray(rows, float), np.asarray(target, float)
    k = a.shape[1]
    best: tuple[float, list[float]] = (math.inf, [0.0] * k)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = [0.0] * k
        for j, v in zip(cols, sol, strict=True):
            x[j] = float(v)
        err = float(((a @ np.asarray(x) - y) ** 2).sum())
        if err < best[0]:
            best = (err, x)
    return best[1]


def measured_costs(run: BenchRun, base: Profile) -> Profile | None:
    """``base`` with the step and prefill costs fitted to the bench's own samples (``None``: the run
    recorded no decode samples). Each sample weighs by its inverse, so short and long ones count
    alike (relative error)."""
    if not run.decode_samples or len(run.unloaded_samples) < 3:
        return None
    # a step of B requests, each holding about n + half the steps it timed: fixed + B x per_seq + context x per_ctx
    steps = [(b, n + (DECODE_STEPS if b == 1 else BATCH_STEPS) / 2, t) for b, n, t in run.decode_samples]
    d0, per_seq, per_ctx = nonnegative_lstsq([[1 / t, b / t, b * c / t] for b, c, t in steps], [1.0] * len(steps))
    # a cold TTFT: API latency + one iteration (the fixed step) + the prefill of n tokens
    cold = [(n, t - d0) for n, t in run.unloaded_samples if t > d0]
    lat, per_token, per_token_ctx = nonnegative_lstsq([[1 / r, n / r, n * n / 2 / r] for n, r in cold],
                                                      [1.0] * len(cold))
    # the servers share the bench host's cores: a cold prompt on each at once is this much slower
    # than alone, with all the others busy
    others = max(run.servers - 1, 1)
    host = [max(together / alone - 1.0, 0.0) / others for _, alone, together in run.host_samples]
    return replace(base, decode_step_s=d0, decode_s_per_seq=per_seq, decode_s_per_ctx_token=per_ctx,
                   request_latency_s=lat, prefill_s_per_token=max(per_token, 1e-9),
                   prefill_s_per_token_ctx=per_token_ctx, host_slowdown=sum(host) / len(host) if host else 0.0)


def fit(run: BenchRun, vllm: dict[str, Any] | None = None, *, fit_setups: tuple[str, ...] = ("static",),
        name: str = "calibrated") -> Fit:
    missing = [s for s in fit_setups if s not in run.setups]
    if missing:
        raise ConfigError(f"--fit-setups: {missing[0]!r} is not in the bench run (it ran "
                          f"{', '.join(run.setups)})")
    base, notes = base_profile(run, vllm, name)
    measured = measured_costs(run, base)
    sources = (run.source,) + (("pof bench vllm",) if vllm else ())
    if measured is not None:
        notes.append(f"decode_step_s, decode_s_per_seq, decode_s_per_ctx_token: least squares on the bench's "
                     f"{len(run.decode_samples)} decode samples (step times alone and in batches); request_latency_s, "
                     f"prefill_s_per_token, prefill_s_per_token_ctx: least squares on its {len(run.unloaded_samples)} "
                     f"cold TTFTs less one step; host_slowdown: its {len(run.host_samples)} cold TTFTs on every "
                     "server at once against alone (0 without them); error: the replay of "
                     f"{', '.join(fit_setups)}'s trials (not fitted)")
        return Fit(measured, score(run, measured, fit_setups), fit_setups, sources, tuple(notes))
    unloaded = run.unloaded_p90_s
    n90 = max(int(nearest_rank(sorted(prompt_sizes(run.trace)), 0.9)), 1)
    # The API latency and the step are shares of the shortest cold TTFT the bench measured (with
    # long prompts the p90 one is nearly all prefill, and a share of it would be a step of seconds).
    fast = min((t for _, t in run.unloaded_samples), default=unloaded)
    best: tuple[float, Profile] | None = None
    for lat in LATENCY_SHARES:
        for share in FIXED_SHARES:
            if lat + share >= 0.9:
                continue
            step = share * fast
            cold = unloaded - lat * fast - step          # the p90 prompt's cold prefill
            for ctx in CTX_SHARES if run.unloaded_samples else (0.0,):
                for per_seq in PER_SEQ:
                    # n90 x (per_token + per_token_ctx x n90 / 2) = cold, ctx of it growing with the context
                    p = replace(base, decode_step_s=step, decode_s_per_seq=per_seq * step,
                                request_latency_s=lat * fast, prefill_s_per_token=(1 - ctx) * cold / n90,
                                prefill_s_per_token_ctx=2 * ctx * cold / (n90 * n90))
                    err = score(run, p, fit_setups)
                    if best is None or err < best[0]:
                        best = (err, p)
    assert best is not None
    ctx_note = (f", prefill_s_per_token_ctx (and the bench's {len(run.unloaded_samples)} cold samples)"
                if run.unloaded_samples else "")
    notes.append(f"request_latency_s, decode_step_s, decode_s_per_seq, prefill_s_per_token{ctx_note}: fitted (grid) "
                 f"to the unloaded p90 TTFT {unloaded} s at the p90 prompt of {n90} tokens and to the trials of "
                 f"{', '.join(fit_setups)}")
    return Fit(best[1], best[0], fit_setups, sources, tuple(notes))


def profile_mapping(p: Profile) -> dict[str, Any]:
    def tier(t: TierProfile) -> dict[str, Any]:
        out: dict[str, Any] = {"name": t.name, "gbps": t.gbps, "latency_us": t.latency_us}
        if t.capacity_gb:
            out["capacity_gb"] = t.capacity_gb
        return out
    return {"kv_blocks": p.kv_blocks, "block_tokens": p.block_tokens, "kv_bytes_per_token": p.kv_bytes_per_token,
            "max_running": p.max_running, "max_batched_tokens": p.max_batched_tokens,
            "prefill_s_per_token": float(f"{p.prefill_s_per_token:.4g}"),
            "prefill_s_per_token_ctx": float(f"{p.prefill_s_per_token_ctx:.4g}"),
            "decode_step_s": float(f"{p.decode_step_s:.4g}"), "decode_s_per_seq": float(f"{p.decode_s_per_seq:.4g}"),
            "decode_s_per_ctx_token": float(f"{p.decode_s_per_ctx_token:.4g}"),
            "local_tier": tier(p.local_tier), "remote_tier": tier(p.remote_tier),
            "request_latency_s": float(f"{p.request_latency_s:.4g}"), "host_slowdown": float(f"{p.host_slowdown:.4g}"),
            "slo_multiple": p.slo_multiple}


def profile_yaml(f: Fit) -> str:
    head = [f"# Fitted by `pof sim calibrate` from {', '.join(f.sources)} (fit error {f.error:.3g}).",
            *(f"# - {n}" for n in f.notes),
            "# Not fitted (cpu-bench's values): max_batched_tokens, the tiers unless stated above, slo_multiple."]
    return "\n".join(head) + "\n" + yaml.safe_dump(profile_mapping(f.profile), sort_keys=False)
