"""`pof router --config FILE`: run the proxy with uvicorn until stopped."""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any

from pof_connector.body_limits import server_config
from pof_connector.config import ConfigError, redact_url
from pof_connector.index import redis_index
from pof_connector.index.redis import RedisIndex
from pof_connector.locality.locator import Locator
from pof_connector.router.router import Router
from pof_connector.router.router_config import RouterConfig

log = logging.getLogger("pof.router")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible proxy routing by estimated time to first token",
                       description="Route completions and chat requests to the vLLM / SGLang backend with the "
                                   "lowest estimated time to first token, from the pool's locality index. "
                                   "See examples/router/pof-router.yaml.")
    p.add_argument("--config", required=True, metavar="FILE", help="router YAML (examples/router/pof-router.yaml)")
    p.add_argument("--listen", metavar="HOST:PORT", help="override the config's listen address")
    p.add_argument("--policy", choices=("pof", "least_loaded", "round_robin"), help="override the config's policy")
    p.set_defaults(handler=run)


def build(config: RouterConfig) -> tuple[Router, RedisIndex | None]:
    """The router and its index client (``None`` without ``index_url``; the caller closes it).
    In P/D mode, the decode group's router (see :func:`build_prefill`)."""
    index = redis_index(config.index_url, None, auth=config.index_auth) if config.index_url else None
    locator = Locator(index) if index is not None else None
    return Router(config.group("decode") if config.pd else config, locator), index


def build_prefill(config: RouterConfig, index: RedisIndex | None) -> Router | None:
    """P/D mode: the prefill group's router on the same index; ``None`` otherwise."""
    if not config.pd:
        return None
    return Router(config.group("prefill"), Locator(index) if index is not None else None)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pof_connector.router.proxy import make_app

    config = RouterConfig.from_file(args.config)
    override: dict[str, Any] = {}
    if args.listen:
        override["listen"] = args.listen
    if args.policy:
        override["policy"] = args.policy
    if override:
        config = RouterConfig.from_mapping({**config.model_dump(), **override}, source=args.config)
    if config.policy == "pof" and not config.index_url:
        raise ConfigError(f"{args.config}: index_url: policy 'pof' needs the locality index "
                          f"(redis://... or unix://...); or set policy: least_loaded")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)     # one line per proxied request otherwise
    router, index = build(config)
    try:
        app = make_app(router, prefill=build_prefill(config, index))   # a bad tokenizer path stops here, named
        names = ", ".join(f"{b.name}={b.url}" for b in config.backends) or \
            "prefill " + ", ".join(f"{b.name}={b.url}" for b in config.prefill) + \
            "; decode " + ", ".join(f"{b.name}={b.url}" for b in config.decode)
        log.info("pof router on http://%s (policy %s, index %s): %s", config.listen, config.policy,
                 redact_url(config.index_url) if config.index_url else "none", names)
        # What start-up built (FastAPI, pydantic, the tokenizer, numpy, ...) lives as long as the
        # process: frozen out of the collector's sight, a full collection walks only what requests
        # left behind (one took 89 ms in the bench's router; issue 42).
        gc.collect()
        gc.freeze()
        uvicorn.Server(server_config(app, config.host, config.port, timeout_s=config.read_timeout_s)).run()
    finally:
        if index is not None:
            index.close()
    return 0
