"""A ``pof bench capacity --json`` run as the simulator replays it: its trace, SLO, cluster and the
measured trials of each set-up.

The trace: ``trace.source`` names a file when the bench read one (``--trace FILE``); else the
bench made its seeded fragmenting mix, whose seed the source names, with the ``Mix`` the JSON
records under ``trace.mix`` (older runs: the default ``Mix()``, scaled by 0.3 when ``trace.quick``;
runs older still, without ``trace.quick``: whichever of the two makes the recorded request count).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pof_connector.bench.capacity_trace import Mix, TraceRequest, fragmenting_trace, read_trace
from pof_connector.config import ConfigError
from pof_connector.sim.policies import policy_factory
from pof_connector.sim.profile import Profile
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.simulator import Simulator
from pof_connector.sim.trial_result import TrialResult

SEED = re.compile(r"seeded fragmenting mix \(seed (-?\d+)\)")
QUICK_SCALE = 0.3
"""What ``pof bench capacity --quick`` scales the default mix by."""


@dataclass(frozen=True)
class BenchRun:
    source: str
    """The JSON file."""
    trace: list[TraceRequest]
    slo_s: float
    unloaded_p90_s: float
    cluster: dict[str, Any]
    setups: dict[str, dict[str, Any]]
    """Set-up name -> its goodput_rps, goodput_factor, at_goodput, trials (as the bench wrote them)."""
    unloaded_samples: tuple[tuple[int, float], ...] = ()
    """(prompt tokens, TTFT s) of the cold prompts the SLO was measured with (empty: an older run)."""
    decode_samples: tuple[tuple[int, int, float], ...] = ()
    """(batch, prompt tokens, seconds per decode step) the bench measured on an idle server (empty:
    an older run)."""
    host_samples: tuple[tuple[int, float, float], ...] = ()
    """(prompt tokens, cold TTFT on one server alone, on every server at once) (empty: an older run)."""
    tier_bytes_per_server: int | None = None
    """Issue 47's equal memory: each server's tier bytes, private for every set-up but ``pof``,
    whose servers share theirs (``None``: an older run, where only ``pof`` had a tier)."""

    @property
    def servers(self) -> int:
        return int(self.cluster["servers"])

    @property
    def base_rps(self) -> float:
        """The trace's arrival rate at factor 1, as the bench counts it."""
        return len(self.trace) / max(self.trace[-1].at, 1e-3)

    @property
    def max_trials(self) -> int:
        """Trials the bench's search ran per set-up at most (its ``--max-trials``)."""
        return max((len(s.get("trials") or []) for s in self.setups.values()), default=1) or 1


def _get(raw: dict[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{where}: {key}: missing (is this a `pof bench capacity --json` output?)")
    return raw[key]


def bench_trace(trace_info: dict[str, Any], where: str) -> list[TraceRequest]:
    source = str(_get(trace_info, "source", f"{where}: trace"))
    m = SEED.fullmatch(source)
    if m is None:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{where}: trace.source: {source!r} is neither the seeded mix nor a readable file")
        return read_trace(path)
    raw_mix = trace_info.get("mix")
    if raw_mix is not None:
        if not isinstance(raw_mix, dict):
            raise ConfigError(f"{where}: trace.mix: a map of Mix fields is required, got {raw_mix!r}")
        allowed = {f.name for f in fields(Mix)}
        unknown = sorted(set(raw_mix) - allowed)
        if unknown:
            raise ConfigError(f"{where}: trace.mix.{unknown[0]}: unknown; allowed: {', '.join(sorted(allowed))}")
        mix = Mix(**raw_mix)
    else:
        mix = Mix().scaled(QUICK_SCALE) if trace_info.get("quick") else Mix()
    trace = fragmenting_trace(int(m.group(1)), mix)
    want = trace_info.get("requests")
    if raw_mix is None and "quick" not in trace_info and want is not None and want != len(trace):
        trace = fragmenting_trace(int(m.group(1)), mix.scaled(QUICK_SCALE))    # a --quick run of before trace.quick
    if want is not None and want != len(trace):
        raise ConfigError(f"{where}: the seeded mix makes {len(trace)} requests, the bench ran {want}: its Mix "
                          "is not the one recorded (an older bench with another default mix? give its trace.mix)")
    return trace


def load_bench(path: Path) -> BenchRun:
    where = str(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON: {e.msg}") from None
    if not isinstance(raw, dict) or raw.get("bench") != "capacity":
        raise ConfigError(f"{where}: not a `pof bench capacity --json` output (no \"bench\": \"capacity\")")
    setups = _get(raw, "setups", where)
    if not setups:
        raise ConfigError(f"{where}: setups: no set-up was run")
    return BenchRun(where, bench_trace(_get(raw, "trace", where), where), float(_get(raw, "slo_s", where)),
                    float(_get(raw, "unloaded_p90_ttft_s", where)), dict(_get(raw, "cluster", where)), dict(setups),
                    tuple((int(n), float(t)) for n, t in _rows(
                        raw, "unloaded_samples", where, "[prompt tokens, TTFT s] pairs", 2,
                        lambda r: r[0] > 0 and r[1] > 0)),
                    tuple((int(b), int(n), float(t)) for b, n, t in _rows(
                        raw, "decode_samples", where, "[batch, prompt tokens, s per step] triples", 3,
                        lambda r: r[0] >= 1 and r[1] >= 0 and r[2] > 0)),
                    tuple((int(n), float(a), float(t)) for n, a, t in _rows(
                        raw, "host_samples", where, "[prompt tokens, TTFT alone s, TTFT together s] triples", 3,
                        lambda r: r[0] > 0 and r[1] > 0 and r[2] > 0)),
                    _tier_bytes(raw, where))


def _tier_bytes(raw: dict[str, Any], where: str) -> int | None:
    memory = raw.get("memory")
    if memory is None:
        return None
    value = memory.get("tier_bytes_per_server") if isinstance(memory, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: memory.tier_bytes_per_server: a positive number of bytes is required")
    return value


def _rows(raw: dict[str, Any], key: str, where: str, what: str, width: int,
          valid: Callable[[list[float]], bool]) -> list[list[float]]:
    """``raw[key]`` (absent: an older run, no rows): a list of ``width`` numbers each, every row
    ``valid``; else a ConfigError naming the key and ``what`` is required."""
    rows: Any = raw.get(key, [])
    ok = isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == width
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r) and valid(r) for r in rows)
    if not ok:
        raise ConfigError(f"{where}: {key}: a list of {what} is required")
    return [[float(v) for v in r] for r in rows]


BENCH_SETUPS = {"static": "static", "round_robin": "round_robin", "cache_aware": "cache_aware",
                "kv_aware": "cache_aware", "pof_private": "pof", "pof": "pof"}
"""The bench's set-ups the simulator replays -> the policy it replays each with. It has no model of
KV events: vllm-router's ``kv_aware`` replays as ``cache_aware`` (affinity to the node that holds
the prefix, within balance thresholds), the private tier it credits being modelled as every
baseline's (issue 47)."""


def setup_tiers(run: BenchRun, setup: str) -> str | None:
    """The tiers ``setup`` had in ``run`` (a :data:`~pof_connector.sim.sim_config.TIERS` name;
    ``None``: its policy's own, an older run)."""
    if run.tier_bytes_per_server is None:
        return None
    return "shared" if setup == "pof" else "private"


def replay_trial(run: BenchRun, profile: Profile, setup: str, factor: float, *, give_up: bool) -> TrialResult:
    """One trial of the bench's ``setup`` (a :data:`BENCH_SETUPS` name) at ``factor``, simulated:
    the bench's trace on as many nodes as it had servers, against its SLO, with its tiers."""
    config = SimConfig(nodes=run.servers, rate_factor=factor, slo_s=run.slo_s, give_up=give_up,
                       tiers=setup_tiers(run, setup))
    return Simulator(profile, policy_factory(BENCH_SETUPS[setup], profile, run.trace)(), config).run(run.trace)
