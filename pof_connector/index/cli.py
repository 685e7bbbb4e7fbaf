"""``pof index serve | api | stop | stats`` and the top-level ``pof stats``: run, stop and inspect the
locality index."""

from __future__ import annotations

import argparse
import fcntl
import math
import threading
import time
from pathlib import Path
from typing import Any

from pof_connector.cli_support import CommandError, err_console, out_console, print_json, usage
from pof_connector.config import PofConfig, redact_url
from pof_connector.config.credentials import IndexAuth, read_secret
from pof_connector.index import redis_index
from pof_connector.index.embedded import PIDFILE, embedded_alive, embedded_url, restarts, stop_embedded, supervise
from pof_connector.index.server import ping
from pof_connector.index.stats_view import node_json, print_stats
from pof_connector.runtime_dir import private_dir

PIDFILE_GRACE_S = 2.0


def _load_config(path: str | None) -> PofConfig:
    """The config file's settings, or the defaults (``index_url: embedded``) without one."""
    return PofConfig() if path is None else PofConfig.from_file(path)


def _runtime_dir(args: argparse.Namespace) -> Path:
    """``--runtime-dir``, else the config's ``runtime_dir``: where the embedded server lives."""
    if args.runtime_dir:
        return Path(args.runtime_dir)
    return Path(_load_config(args.config).runtime_dir)


# ---- pof index serve / stop -------------------------------------------------------------------


def cmd_index_serve(args: argparse.Namespace) -> int:
    """Run the embedded index supervisor in this process until ``pof index stop`` or Ctrl-C."""
    runtime_dir = private_dir(_runtime_dir(args))
    token = _api_token(args) if args.http_port else None      # a missing secret stops us before anything starts
    url = embedded_url(runtime_dir)
    idle_s = math.inf if args.idle_s is None else args.idle_s
    # The lock is the one ensure_embedded() takes: holding it until our server answers keeps a
    # starting engine from launching a second server on the same socket meanwhile.
    with open(runtime_dir / "embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if embedded_alive(runtime_dir) or ping(url):
            raise CommandError(f"an index server already answers at {url}; stop it with "
                               f"`pof index stop --runtime-dir {runtime_dir}`")
        up = threading.Event()
        announcer = threading.Thread(target=_announce, args=(url, runtime_dir, lock, up), daemon=True)
        announcer.start()
        if args.http_port:
            _start_api(url, None, args, token)
        try:
            return supervise(runtime_dir, idle_s)
        except (OSError, RuntimeError, TimeoutError, ValueError) as e:
            raise CommandError(f"the index server failed: {e}") from e
        finally:
            up.set()
            announcer.join()      # before the lock file closes under it


def _api_token(args: argparse.Namespace) -> str | None:
    """The API's bearer token from ``--token``, ``--token-env`` or ``--token-file``; ``None``: no token."""
    given = [f for f in ("token", "token_env", "token_file") if getattr(args, f) is not None]
    if len(given) > 1:
        raise CommandError("give one of --token, --token-env and --token-file")
    if args.token is not None:
        err_console().print("warning: --token shows in `ps` to every user of this host; "
                            "prefer --token-env or --token-file", style="yellow")
        return str(args.token)
    return read_secret(args.token_env, args.token_file, "token")


def _start_api(index_url: str, auth: IndexAuth | None, args: argparse.Namespace,
               token: str | None) -> threading.Thread:
    """Serve the locality API (pof_connector.locality.api) on a thread of this process."""
    import uvicorn

    from pof_connector.body_limits import server_config
    from pof_connector.locality.api import READ_TIMEOUT_S, load_tokenizer, make_app

    tokenizers = {}
    for item in args.tokenizer or []:
        model, _, path = item.partition("=")
        if not path:
            raise CommandError(f"--tokenizer expects MODEL=DIR, got {item!r}")
        tokenizers[model] = load_tokenizer(path, special_tokens=False)
    app = make_app(redis_index(index_url, None, auth=auth), token=token, tokenizers=tokenizers)
    server = uvicorn.Server(server_config(app, args.http_host, args.http_port, timeout_s=READ_TIMEOUT_S))
    thread = threading.Thread(target=server.run, name="pof-api", daemon=True)
    thread.start()
    err_console().print(f"locality API on http://{args.http_host}:{args.http_port} (docs at /docs)", style="dim")
    return thread


def cmd_index_api(args: argparse.Namespace) -> int:
    """Serve the locality API for an index this process does not run (e.g. a Redis cluster's)."""
    url, auth = _target(args)
    token = _api_token(args)
    if not ping(url, auth=auth):
        raise CommandError(f"no index server answers at {redact_url(url)}")
    _start_api(url, auth, args, token).join()
    return 0


def _add_api_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--http-host", default="127.0.0.1", help="address of the locality API (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=port, help=f"its port; 0 disables it (default {port})")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on the API (not on /healthz); "
                                       "shows in `ps`: prefer --token-env / --token-file")
    token.add_argument("--token-env", metavar="NAME", help="the API token is in environment variable NAME")
    token.add_argument("--token-file", metavar="PATH", help="the API token is in file PATH (trailing newline "
                                                             "stripped)")
    p.add_argument("--tokenizer", action="append", metavar="MODEL=DIR",
                   help="accept text prompts for MODEL, tokenized with DIR/tokenizer.json (repeatable)")


def _announce(url: str, runtime_dir: Path, lock: Any, done: threading.Event) -> None:
    """Once the server answers: release the start lock and tell the user the URL clients use."""
    while not done.is_set():
        if ping(url) and (runtime_dir / PIDFILE).exists():   # stoppable from now on
            fcntl.flock(lock, fcntl.LOCK_UN)
            print(f"pof index server running; clients use index_url: {url}\n"
                  f"(index_url: embedded with runtime_dir: {runtime_dir} finds it too); "
                  f"stop with `pof index stop --runtime-dir {runtime_dir}` or Ctrl-C", flush=True)
            return
        done.wait(0.05)


def cmd_index_stop(args: argparse.Namespace) -> int:
    """Stop the embedded server by its supervisor's PID, but only when a server answers:
    a stale pidfile's PID may belong to an unrelated process by now."""
    runtime_dir = _runtime_dir(args)
    url = embedded_url(runtime_dir)
    pidfile = runtime_dir / PIDFILE
    answers = ping(url) or embedded_alive(runtime_dir)      # a frozen or busy server is stopped too
    if answers and not _wait_for(pidfile, PIDFILE_GRACE_S):
        raise CommandError(f"a server answers at {url} but {pidfile} is missing; it was not started by "
                           f"`pof index serve` or ensure_embedded, stop it yourself")
    if not pidfile.exists():
        raise CommandError(f"no embedded index server in {runtime_dir} (no {PIDFILE})")
    if not answers:
        raise CommandError(f"no index server answers at {url}; {pidfile} is stale (remove it), "
                           f"no process was signalled")
    stop_embedded(runtime_dir)
    out_console().print(f"stopped the index server at {url}")
    return 0


def _wait_for(path: Path, timeout_s: float) -> bool:
    """The supervisor writes its pidfile just after its server answers: give it that moment."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- pof index stats --------------------------------------------------------------------------


def cmd_index_stats(args: argparse.Namespace) -> int:
    """Live nodes and totals of a running index; never starts a server to answer."""
    url, auth = _stats_url(args)
    index = redis_index(url, None, auth=auth)
    try:
        nodes, totals = index.nodes(), index.stats()
    finally:
        index.close()
    runtime_dir = _embedded_dir(args)
    if runtime_dir is not None:
        restarted = restarts(runtime_dir)
        totals["restarts"] = len(restarted)
        if restarted and not args.json:
            out_console().print(f"the embedded index server was restarted {len(restarted)} time(s) after it died; "
                         f"last: {restarted[-1]}", style="yellow")
    if args.json:
        print_json({"url": redact_url(url), "nodes": [node_json(n) for n in nodes], "totals": totals})
    else:
        print_stats(url, nodes, totals)
    return 0


def _embedded_dir(args: argparse.Namespace) -> Path | None:
    """The runtime directory of the embedded server that ``pof stats`` asks; ``None`` for another index."""
    if args.url:
        return None
    config = _load_config(args.config)
    return Path(config.runtime_dir) if config.index_url == "embedded" else None


def _target(args: argparse.Namespace) -> tuple[str, IndexAuth | None]:
    """The index server ``--url`` or ``--config`` names, and how to authenticate to it (``None``:
    as the URL says)."""
    if args.url:
        return str(args.url), None
    config = _load_config(args.config)
    if config.index_url == "local":
        raise CommandError("index_url is 'local': that index lives inside one engine process and has "
                           "no server to ask")
    if config.index_url == "embedded":
        return embedded_url(config.runtime_dir), None
    return config.index_url, config.index_auth


def _stats_url(args: argparse.Namespace) -> tuple[str, IndexAuth | None]:
    """The URL of a server that answers now, and its :class:`IndexAuth`; :class:`CommandError`
    when there is none."""
    url, auth = _target(args)
    config = None if args.url else _load_config(args.config)
    if not ping(url, auth=auth):
        runtime_dir = _embedded_dir(args)
        shown = redact_url(url)
        if runtime_dir is not None and embedded_alive(runtime_dir):
            raise CommandError(f"the index server at {shown} runs but does not answer (a busy host, or stopped)")
        if config is None or config.index_url != "embedded":
            raise CommandError(f"no index server running at {shown}")
        serve = "pof index serve" + (f" --config {args.config}" if args.config else "")
        raise CommandError(f"no index server running at {shown}. Engines with index_url: embedded start it when "
                           f"they start; `{serve}` runs one in the foreground. The index of "
                           "examples/quickstart.sh and examples/core/two_nodes.py is private to their run "
                           "and stopped with it.")
    return url, auth


def index_server(args: argparse.Namespace) -> tuple[str, IndexAuth | None]:
    """The index server ``args.config`` / ``args.url`` name, answering now (for other commands
    that talk to it, e.g. ``pof pin``); :class:`CommandError` when none answers."""
    return _stats_url(args)


# ---- the parser -------------------------------------------------------------------------------


def _add_stats_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="pof YAML/JSON config (default: index_url embedded)")
    where.add_argument("--url", help="index server URL, e.g. redis://host:6379/0 or unix:///path.sock")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=cmd_index_stats)


def _add_index(sub: Any) -> None:
    index = sub.add_parser("index", help="run, stop and inspect the locality index",
                           description="Run, stop and inspect the locality index.")
    index.set_defaults(handler=usage(index))
    isub = index.add_subparsers(title="commands", metavar="COMMAND")
    serve = isub.add_parser("serve", help="run this host's embedded index server in the foreground",
                            description="Run the embedded index server (index_url: embedded) in the "
                                        "foreground and print the URL clients use.")
    serve.add_argument("--config", metavar="FILE", help="take runtime_dir from this pof config")
    serve.add_argument("--runtime-dir", metavar="DIR", help="where the socket and pidfile live "
                                                            "(default: the config's runtime_dir)")
    serve.add_argument("--idle-s", type=float, metavar="N", default=None,
                       help="stop after N seconds without clients (default: run until stopped)")
    _add_api_args(serve, 8470)
    serve.set_defaults(handler=cmd_index_serve)
    api = isub.add_parser("api", help="serve the locality API for a running index (e.g. redis://...)",
                          description="Serve POST /v1/locality, GET /v1/nodes, /metrics and /healthz for the "
                                      "index at --url.")
    where = api.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="index server URL (credentials in it show in `ps`: prefer --config)")
    where.add_argument("--config", metavar="FILE", help="pof config: its index_url and index_* credentials")
    _add_api_args(api, 8470)
    api.set_defaults(handler=cmd_index_api)
    stop = isub.add_parser("stop", help="stop this host's embedded index server",
                           description="Stop the embedded index server of a runtime directory.")
    stop.add_argument("--config", metavar="FILE", help="take runtime_dir from this pof config")
    stop.add_argument("--runtime-dir", metavar="DIR", help="default: the config's runtime_dir")
    stop.set_defaults(handler=cmd_index_stop)
    _add_stats_args(isub.add_parser("stats", help="live nodes and index totals",
                                    description="Show live nodes (tier capacity, use, domain) and index "
                                                "totals of a running index server."))


def add_parser(sub: Any) -> None:
    """Register ``pof index`` and its alias ``pof stats``."""
    _add_index(sub)
    _add_stats_args(sub.add_parser("stats", help="same as `pof index stats`",
                                   description="Show live nodes and index totals (same as `pof index stats`)."))
