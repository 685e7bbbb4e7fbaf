"""``pof pin``: pin a prompt prefix in the pool for a while, list pins, remove one.

    pof pin add --tokens 1,2,3,... --ttl 3600 [--hard] [--model M] [--salt-env NAME] [--replicas N] [--tenant T]
    pof pin add --text "You are..." --tokenizer DIR --ttl 600
    pof pin list [--json]
    pof pin rm ID

A salt is read from an environment variable or a file, never from the command line (where
``ps`` shows it), and never printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pof_connector.cli_support import CommandError, out_console, print_json, usage
from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.index import redis_index
from pof_connector.index.cli import index_server
from pof_connector.locality.locator import Locator, ModelRequired, UnknownModel, load_tokenizer
from pof_connector.pins.pin import HARD, SOFT, PinError
from pof_connector.pins.pin_desk import PinDesk


def _desk(args: argparse.Namespace) -> PinDesk:
    url, auth = index_server(args)
    index = redis_index(url, None, auth=auth)
    return PinDesk(index, Locator(index, nodes_ttl_s=0.0))


def _salt(args: argparse.Namespace) -> str | None:
    if args.salt_env:
        if args.salt_env not in os.environ:
            raise CommandError(f"--salt-env: environment variable {args.salt_env!r} is not set")
        return os.environ[args.salt_env]
    if args.salt_file:
        return Path(args.salt_file).read_text().rstrip("\n")
    return None


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise CommandError("--tokens: expected comma-separated token ids, e.g. 1,2,3") from None
    if not args.tokenizer:
        raise CommandError("--text needs --tokenizer DIR (the model's tokenizer.json), or give --tokens")
    return load_tokenizer(args.tokenizer, special_tokens=True)(args.text)


def cmd_add(args: argparse.Namespace) -> int:
    desk = _desk(args)
    try:
        pin = desk.pin(_tokens(args), model=args.model, cache_salt=_salt(args), ttl_s=args.ttl,
                       kind=HARD if args.hard else SOFT, replicas=args.replicas, label=args.label,
                       tenant=args.tenant)
    except (PinError, ModelRequired, UnknownModel) as e:
        raise CommandError(str(e)) from None
    finally:
        desk.index.close()
    _show([pin.summary(desk.now())], args.json)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    desk = _desk(args)
    try:
        pins = desk.list()
    finally:
        desk.index.close()
    _show([p.summary(desk.now()) for p in pins], args.json)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    desk = _desk(args)
    try:
        gone = desk.remove(args.pin_id)
    finally:
        desk.index.close()
    if not gone:
        raise CommandError(f"no pin {args.pin_id!r}")
    out_console().print(f"removed pin {args.pin_id}", markup=False)
    return 0


def _show(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json({"pins": rows})
        return
    from rich.table import Table

    table = Table(title="pins", title_justify="left")
    columns = ("id", "kind", "pages", "tokens", "model", "replicas", "label", "tenant", "expires_in_s")
    for name in columns:
        table.add_column(name)
    for r in rows:
        table.add_row(*(str(r[c]) for c in columns))
    out_console().print(table)


def _where(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="pof YAML/JSON config: its index_url and credentials")
    where.add_argument("--url", help="index server URL, e.g. redis://host:6379/0")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(sub: Any) -> None:
    pin = sub.add_parser("pin", help="pin a prompt prefix in the pool for a while; list and remove pins",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pin.set_defaults(handler=usage(pin))
    psub = pin.add_subparsers(title="commands", metavar="COMMAND")
    add = psub.add_parser("add", help="pin a prefix (given as token ids, or as text with a tokenizer)")
    prompt = add.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="comma-separated token ids of the prefix")
    prompt.add_argument("--text", help="the prefix as text (needs --tokenizer)")
    add.add_argument("--tokenizer", metavar="DIR", help="the model's tokenizer (a directory with tokenizer.json)")
    add.add_argument("--model", help="model as the engines' pof config names it (default: the only one)")
    salt = add.add_mutually_exclusive_group()
    salt.add_argument("--salt-env", metavar="NAME", help="the requests' cache_salt is in environment variable NAME")
    salt.add_argument("--salt-file", metavar="PATH", help="the requests' cache_salt is in file PATH")
    add.add_argument("--ttl", type=float, required=True, metavar="SECONDS", help="how long the pin lives")
    add.add_argument("--hard", action="store_true", help="never evict its pages while it lives (default: soft, "
                                                         "evicted after every other page)")
    add.add_argument("--replicas", type=int, default=1, help="nodes that should hold it whole (others copy it "
                                                             "from a holder until that many do)")
    add.add_argument("--tenant", default=DEFAULT_TENANT, help="whose quota its copies count against (the "
                                                               "tenant's name in the pool config)")
    add.add_argument("--label", default="", help="a name to list it by, e.g. the tenant's")
    _where(add)
    add.set_defaults(handler=cmd_add)
    ls = psub.add_parser("list", help="live pins")
    _where(ls)
    ls.set_defaults(handler=cmd_list)
    rm = psub.add_parser("rm", help="remove a pin")
    rm.add_argument("pin_id", metavar="ID")
    _where(rm)
    rm.set_defaults(handler=cmd_rm)
