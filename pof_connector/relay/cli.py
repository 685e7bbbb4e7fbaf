"""``pof relay``: run one engine's relay until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from pof_connector.cli_support import CommandError
from pof_connector.config import ConfigError, PofConfig, parse_size


def cmd_relay(args: argparse.Namespace) -> int:
    """Run a :class:`~pof_connector.relay.relay.Relay` until SIGTERM or Ctrl-C."""
    import logging
    import signal

    import zmq

    from pof_connector.relay.config import RelayConfig
    from pof_connector.relay.relay import Relay

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = PofConfig.from_file(args.config)
    try:
        max_frame = parse_size(args.max_frame_bytes, "--max-frame-bytes")
    except ConfigError as e:
        raise CommandError(f"relay: {e}") from e
    settings = RelayConfig(args.engine_events, args.bind, replay_bind=args.replay_bind, engine_topic=args.engine_topic,
                           advertise_engine_events=args.advertise_engine_events,
                           pool_residency=not args.no_pool_residency, poll_s=args.poll_s, refresh_s=args.refresh_s,
                           engine_url=args.engine_url, max_frame_bytes=max_frame)
    try:
        relay = Relay(config, settings)
    except zmq.ZMQError as e:            # e.g. the bind address is taken
        raise CommandError(f"relay: {e}") from e
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    relay.run(stop)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("relay", help="feed a KV-event router an engine's prefix cache and its pool",
                       description="Subscribe to a vLLM server's KV events; publish its prefix cache into the "
                                   "index (node <node_id>:engine) and re-publish its events plus the pages its "
                                   "pool can load (medium CPU) for vllm-router --policy kv_aware "
                                   "(--kv-event-source WORKER_URL=BIND).")
    p.add_argument("--config", required=True, metavar="FILE",
                   help="the engine's pof config (its node_id, index_url), JSON or YAML")
    p.add_argument("--engine-events", required=True, metavar="ENDPOINT",
                   help="the engine's KV event publisher, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="where routers connect, e.g. tcp://*:5657")
    p.add_argument("--replay-bind", metavar="ENDPOINT",
                   help="serve vLLM's replay protocol here (for --kv-event-replay-source)")
    p.add_argument("--engine-topic", default="", help="the engine's KV event topic (default: empty)")
    p.add_argument("--advertise-engine-events", metavar="ENDPOINT",
                   help="the engine endpoint as other hosts' relays reach it (default --engine-events)")
    p.add_argument("--no-pool-residency", action="store_true", help="forward the engine's events only")
    p.add_argument("--engine-url", metavar="URL",
                   help="the engine's HTTP base URL: its /metrics give the node load the locality API reports")
    p.add_argument("--poll-s", type=float, default=0.5, help="how often the pool view is refreshed (default 0.5)")
    p.add_argument("--refresh-s", type=float, default=30.0,
                   help="how often the whole pool view is re-sent, for routers that joined late (default 30)")
    p.add_argument("--max-frame-bytes", default="16MiB", metavar="SIZE",
                   help="largest KV-event frame taken from an engine; a larger one drops that link, which "
                        "ZMQ reconnects (default 16MiB)")
    p.set_defaults(handler=cmd_relay)
