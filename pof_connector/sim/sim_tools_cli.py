"""The ``pof sim`` commands beside a single run: ``sweep`` (capacity ratio across node counts and
long-request shares), ``calibrate`` (a profile fitted to a ``pof bench capacity --json`` run) and
``validate`` (a bench run replayed in the simulator, simulated vs measured goodput)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from pof_connector.cli_support import out_console, print_json, progress
from pof_connector.config import ConfigError
from pof_connector.sim.bench_run import BENCH_SETUPS, load_bench
from pof_connector.sim.calibrate import fit, profile_yaml
from pof_connector.sim.mixes import MIXES
from pof_connector.sim.policies import POLICIES
from pof_connector.sim.profile import load_profile
from pof_connector.sim.sim_plot import draw_sweep, require_matplotlib
from pof_connector.sim.sweep import run_sweep
from pof_connector.sim.validate import validate


def _list(kind: type, what: str) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: a comma-separated list, got {text!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"{what}: at least one value, got {text!r}")
        return out
    return parse


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("sweep", help="capacity ratio pof / static across node counts and long-request shares",
                       description="Runs the goodput search per policy for every node count (and, for mix "
                                   "long-context, every long-request share) and reports the capacity ratio "
                                   "pof / static; --plot draws it against node count and long share.")
    s.add_argument("--mix", type=_list(str, "--mix"), default=["long-context"], metavar="NAME,...",
                   help=f"built-in mixes ({', '.join(MIXES)}; default long-context)")
    s.add_argument("--nodes", type=_list(int, "--nodes"), default=[8, 32, 128], metavar="N,...",
                   help="node counts (default 8,32,128)")
    s.add_argument("--long-share", type=_list(float, "--long-share"), metavar="S,...",
                   help="shares of long-session requests for mix long-context, e.g. 0.02,0.05,0.1 "
                        "(default: the mix's own, 0.05)")
    s.add_argument("--profile", default="h200", help="profile YAML or shipped name (default h200)")
    s.add_argument("--requests-per-node", type=int, default=250,
                   help="requests per node of each point's workload (default 250: fewer, and the runs at high "
                        "rate factors are too short to leave the empty cluster's transient, which flatters "
                        "whichever policy spreads the burst)")
    s.add_argument("--policies", default="static,pof", metavar="P,...",
                   help="policies to run (default static,pof: the ratio's two)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print JSON on stdout")
    s.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the ratio against node count / long share")
    s.set_defaults(handler=sweep)

    c = sub.add_parser("calibrate", help="fit a node profile to a `pof bench capacity --json` run",
                       description="Fits a profile YAML to a `pof bench capacity --json` run on this host (KV "
                                   "blocks, block size, max_num_seqs from the bench; prefill and step costs "
                                   "fitted to its unloaded TTFT and its static set-up's trials); a `pof bench "
                                   "vllm --json` run, if given, sets the pool tier's load speed.")
    c.add_argument("--from", dest="sources", type=Path, action="append", required=True, metavar="BENCH.json",
                   help="a pof bench capacity (required, once) or pof bench vllm JSON output; repeatable")
    c.add_argument("--fit-setups", default="static", metavar="S,...",
                   help="set-ups whose trials the fit replays (default static: the others are left to validate)")
    c.add_argument("-o", "--output", type=Path, metavar="FILE.yaml", help="write the profile here (default stdout)")
    c.add_argument("--json", action="store_true", help="print the fit as JSON on stdout")
    c.set_defaults(handler=calibrate)

    v = sub.add_parser("validate", help="replay a `pof bench capacity --json` run: simulated vs measured goodput",
                       description="Replays the bench's trace and set-ups (as many nodes as it had servers, its "
                                   "SLO and goodput search) with a profile (default: calibrated on the same run) "
                                   "and reports per set-up simulated vs measured goodput and p90 TTFT, "
                                   "max_rel_error and whether the set-ups come in the same order.")
    v.add_argument("--bench", type=Path, required=True, metavar="BENCH.json")
    v.add_argument("--profile", help="profile YAML or shipped name (default: calibrate on --bench)")
    v.add_argument("--fit-setups", default="static", metavar="S,...",
                   help="without --profile: the set-ups the calibration fits to (default static)")
    v.add_argument("--json", action="store_true", help="print JSON on stdout")
    v.set_defaults(handler=validate_cmd)


def _setups(text: str, allowed: tuple[str, ...] = POLICIES, option: str = "--policies") -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise ConfigError(f"{option}: some of {', '.join(allowed)}, got {text!r}")
    return names


def _fit_setups(text: str) -> tuple[str, ...]:
    return _setups(text, tuple(BENCH_SETUPS), "--fit-setups")


def sweep(args: argparse.Namespace) -> int:
    bad = [m for m in args.mix if m not in MIXES]
    if bad:
        raise ConfigError(f"--mix: {bad[0]!r} is not a built-in mix; mixes: {', '.join(MIXES)}")
    if args.long_share and "long-context" not in args.mix:
        raise ConfigError(f"--long-share: only mix long-context has long sessions, not {', '.join(args.mix)}")
    if any(n < 1 for n in args.nodes) or args.requests_per_node < 1:
        raise ConfigError("--nodes and --requests-per-node: must be >= 1")
    if args.plot is not None:
        require_matplotlib()
    profile = load_profile(args.profile)
    shares: list[float | None] = list(args.long_share) if args.long_share else [None]
    points = run_sweep(profile, mixes=args.mix, nodes=args.nodes, long_shares=shares,
                       policies=_setups(args.policies), requests_per_node=args.requests_per_node, seed=args.seed,
                       progress=progress)
    if args.plot is not None:
        draw_sweep(points, args.plot)
    if args.json:
        print_json({"profile": profile.name, "points": [p.to_json() for p in points],
                    **({"plot": str(args.plot)} if args.plot else {})})
        return 0
    t = Table(title=f"pof sim sweep: capacity ratio pof / static, {profile.name} profile")
    for col in ("mix", "nodes", "long share", "static req/s", "pof req/s", "ratio"):
        t.add_column(col)
    for p in points:
        j = p.to_json()
        g = j["goodput_rps"]
        t.add_row(p.mix, str(p.nodes), "" if p.long_share is None else f"{p.long_share:g}",
                  str(g.get("static", "")), str(g.get("pof", "")), str(j["ratio"]))
    out_console().print(t)
    return 0


def _read_sources(paths: list[Path]) -> tuple[Path, dict[str, Any] | None]:
    capacity: Path | None = None
    vllm: dict[str, Any] | None = None
    for path in paths:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--from {path}: not a readable JSON file ({e})") from None
        kind = raw.get("bench") if isinstance(raw, dict) else None
        if kind == "capacity" and capacity is None:
            capacity = path
        elif kind == "vllm" and vllm is None:
            vllm = raw
        else:
            raise ConfigError(f"--from {path}: one pof bench capacity and at most one pof bench vllm JSON output "
                              f"are accepted (this one says bench {kind!r})")
    if capacity is None:
        raise ConfigError("--from: a `pof bench capacity --json` output is required")
    return capacity, vllm


def calibrate(args: argparse.Namespace) -> int:
    capacity, vllm = _read_sources(args.sources)
    run = load_bench(capacity)
    name = args.output.stem if args.output else "calibrated"
    f = fit(run, vllm, fit_setups=_fit_setups(args.fit_setups), name=name)
    text = profile_yaml(f)
    if args.output is not None:
        args.output.write_text(text)
    if args.json:
        print_json({**f.to_json(), **({"output": str(args.output)} if args.output else {})})
    elif args.output is None:
        out_console().print(text, markup=False, highlight=False, soft_wrap=True)
    else:
        progress(f"wrote {args.output} (fit error {f.error:.3g})")
    return 0


def validate_cmd(args: argparse.Namespace) -> int:
    run = load_bench(args.bench)
    if args.profile is not None:
        profile = load_profile(args.profile)
        fitted: dict[str, Any] | None = None
    else:
        f = fit(run, fit_setups=_fit_setups(args.fit_setups), name="calibrated")
        profile, fitted = f.profile, f.to_json()
        progress(f"calibrated on {args.bench} (fit error {f.error:.3g})")
    out = validate(run, profile)
    if fitted is not None:
        out["calibration"] = fitted
    if args.json:
        print_json(out)
        return 0
    t = Table(title=f"pof sim validate: {args.bench} ({run.servers} servers, SLO {run.slo_s:.3g} s) "
                    f"with profile {profile.name}")
    for col in ("set-up", "measured req/s", "simulated req/s", "rel. error", "measured p90 s", "simulated p90 s",
                "measured factor in", "finer sim. factor", "outside by"):
        t.add_column(col)
    for name, r in out["setups"].items():
        low, high = r["measured_bracket"]
        t.add_row(name, str(r["measured_goodput_rps"]), str(r["simulated_goodput_rps"]), str(r["rel_error"]),
                  str(r["measured_p90_ttft_s"]), str(r["simulated_p90_ttft_s"]),
                  f"[{low}, {'inf' if high is None else high})", str(r["simulated_fine_factor"]),
                  str(r["bracket_error"]))
    con = out_console()
    con.print(t)
    con.print(f"max_rel_error {out['max_rel_error']} (tolerance {out['tolerance']:g}); same ordering: "
              f"{out['same_ordering']} (measured {', '.join(out['measured_order'])}; simulated "
              f"{', '.join(out['simulated_order'])})")
    con.print(f"finer search against the measured intervals: max_bracket_error {out['max_bracket_error']} "
              f"(tolerance {out['tolerance']:g}); ordering of the pairs the bench orders: "
              f"{out['same_ordering_bracket']}")
    return 0
