"""The generated references: every configuration key and every ``pof`` command, read from the code.

- :func:`config_reference` renders the pool config (``PofConfig`` and its sections) and the
  ``pof router`` config (``RouterConfig``): key, type, default, allowed values and one line of
  meaning. The meaning is the field's own documentation (its docstring, the class docstring's
  ``name``: paragraph, or pydantic's ``description``); "—" where the source has none. The allowed
  values are what the validator itself says: each key is given a value no validator accepts and
  the error message it answers with is shown (pydantic constraints for the router).
- :func:`config_key_problems` compares the keys the reference lists with the keys the parsers
  accept and with the dataclass fields: the build fails on any difference.
- :func:`cli_reference` walks the ``pof`` argparse tree: usage, help and every option.

Imports of the project's classes live in :mod:`sources` only.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import sources as src


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    allowed: str
    meaning: str


# ---------------------------------------------------------------- field documentation

_DOC_ITEM = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)``(?:=\S+)?((?:\s*/\s*``[A-Za-z_][A-Za-z0-9_]*``)*)\s*:\s")


def _own_doc(cls: type) -> str:
    """The class's own docstring, one line; "" when it has none (not a base class's, not the
    signature dataclasses write in its place)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split())


def _class_doc_items(cls: type) -> dict[str, str]:
    """``name``: text paragraphs of a class docstring, by field name."""
    doc = _own_doc(cls)
    out: dict[str, str] = {}
    # an item starts the docstring or a sentence; "(``None``: ...)" inside one is not an item
    matches = [m for m in _DOC_ITEM.finditer(doc)
               if m.start() == 0 or doc[:m.start()].rstrip().endswith((".", ";"))]
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(doc)
        text = doc[m.end():end].strip()
        names = [m.group(1), *re.findall(r"``([A-Za-z_][A-Za-z0-9_]*)``", m.group(2) or "")]
        for name in names:
            out.setdefault(name, text)
    return out


def _attribute_docs(cls: type) -> dict[str, str]:
    """Docstrings written under a field (a string right after its annotated assignment)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            out[node.target.id] = " ".join(after.value.value.split())
    return out


def field_docs(cls: type) -> dict[str, str]:
    docs = _class_doc_items(cls)
    docs.update(_attribute_docs(cls))
    return docs


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    text = re.sub(r":(?:mod|class|func|data|attr|meth):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|") or "—"


# ---------------------------------------------------------------- values

class _Bad:
    """A value no validator accepts; its name and repr are cut from the messages."""

    def __repr__(self) -> str:
        return "BAD"


_BAD = _Bad()
_GOT = re.compile(r",?\s*(?:got|but got)\s+(?:BAD|_Bad|'BAD')\.?\s*$")


def _allowed_from(build: Callable[[Any], Any], key: str) -> str:
    """What the validator says when ``key`` holds a value it cannot accept."""
    try:
        build(_BAD)
    except src.ConfigError as e:
        msg = str(e)
        head = re.match(r"^[A-Za-z_][\w.<>\[\]-]*(?: is)?( required)?: ", msg)
        if head:
            msg = ("required: " if head.group(1) else "") + msg[head.end():]
        return _one_line(_GOT.sub("", msg))
    except Exception as e:  # shown, not hidden: a validator that crashes is worth seeing
        return _one_line(f"(validator raised {type(e).__name__})")
    return "any"


_WRITTEN_AS = {
    # internal representation -> what a user writes in the file
    "tuple[tuple[str, float], ...]": "mapping str → float",
    "tuple[tuple[str, int], ...]": "mapping medium → size",
    "tuple[Tenant, ...]": "mapping name → tenant",
    "bytes": "str (hex)",
}


def _type_name(ann: Any) -> str:
    if isinstance(ann, str):
        return _WRITTEN_AS.get(ann, ann)
    if isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "").replace("pof_connector.router.router_config.", "")


def _show(value: Any, key: str) -> str:
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value) + "}`"
    if isinstance(value, bool) or value is None:
        return f"`{str(value).lower() if value is not None else 'null'}`"
    if isinstance(value, int) and key.endswith("size") and value >= 1024:
        return f"`{_size(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    return f"`{value}`"


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


_COMPUTED = {
    "gethostname": "the host name",
    "_default_runtime_dir": "`$XDG_RUNTIME_DIR/pof-<uid>` (else `/tmp/pof-<uid>`)",
}


def _dc_default(f: dataclasses.Field[Any], key: str) -> str:
    if f.default is not dataclasses.MISSING:
        return _show(f.default, key)
    factory = f.default_factory
    if factory is dataclasses.MISSING:
        return "required"
    name = getattr(factory, "__name__", "")
    return _COMPUTED.get(name, f"computed at start-up (`{name}`)")


# ---------------------------------------------------------------- the pool config

def _pool_build(path: list[str], base: dict[str, Any] | None = None) -> Callable[[Any], Any]:
    def build(value: Any) -> Any:
        raw: dict[str, Any] = dict(base or {})
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        return src.PofConfig.from_mapping(raw)
    return build


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def pool_rows() -> Iterator[Row]:
    top = _fields(src.PofConfig)
    docs = field_docs(src.PofConfig)
    sections = {"tiers", "index_auth", "tenants", *src.POOL_SECTIONS}
    for name, f in top.items():
        if name in sections:
            continue
        yield Row(name, _type_name(f.type), _dc_default(f, name), _allowed_from(_pool_build([name]), name),
                  _one_line(docs.get(name, "")))
    # tiers: a mapping medium -> options, in preference order
    yield Row("tiers", "mapping medium → options", "`{cpu_dram: {size: 1GiB}}`",
              _allowed_from(_pool_build(["tiers"]), "tiers"), _one_line(docs.get("tiers", "")))
    tier_fields = _fields(src.TierConfig)
    tier_docs = field_docs(src.TierConfig)
    needs = {"cxl": {"size": "1GiB", "path": "/dev/shm/x"}, "peer_hbm": {"size": "1GiB", "device": "cpu"},
             "cpu_dram": {"size": "1GiB"}}
    for medium in src.KNOWN_MEDIA:
        for opt in src.TIER_OPTIONS[medium]:
            f = tier_fields[opt]
            key = f"tiers.{medium}.{opt}"
            default = "required" if opt == "size" else ("`auto`" if opt == "partition" else _dc_default(f, opt))
            build = _pool_build(["tiers", medium, opt], {"tiers": {medium: dict(needs[medium])}})
            yield Row(key, _type_name(f.type), default, _allowed_from(build, key), _one_line(tier_docs.get(opt, "")))
    # the index credentials: flat index_* keys of IndexAuth's fields
    auth_fields = _fields(src.IndexAuth)
    auth_docs = field_docs(src.IndexAuth)
    for key in src.INDEX_AUTH_KEYS:
        opt = key.removeprefix("index_")
        f = auth_fields[opt]
        yield Row(key, _type_name(f.type), _dc_default(f, opt),
                  _allowed_from(_pool_build([key], {"index_url": "redis://127.0.0.1:6379/0"}), key),
                  _one_line(auth_docs.get(opt, "")))
    # fabric, audit, pd: one dataclass each
    for section, (cls, accepted) in src.POOL_SECTIONS.items():
        yield Row(section, "mapping", "(below)", _allowed_from(_pool_build([section]), section),
                  _one_line(docs.get(section, "")))
        sec_docs = field_docs(cls)
        for name, f in _fields(cls).items():
            key = f"{section}.{name}"
            if name not in accepted:
                continue  # reported by config_key_problems
            yield Row(key, _type_name(f.type), _dc_default(f, name), _allowed_from(_pool_build([section, name]), key),
                      _one_line(sec_docs.get(name, "")))
    # tenants
    yield Row("tenants", "mapping", "`{}` (no tenants: every page is the default tenant's)",
              _allowed_from(_pool_build(["tenants"]), "tenants"), _one_line(docs.get("tenants", "")))
    t_docs = field_docs(src.TenantsConfig)
    for name, f in _fields(src.TenantsConfig).items():
        key = f"tenants.{name}"
        yield Row(key, _type_name(f.type), _dc_default(f, name), _allowed_from(_pool_build(["tenants", name]), key),
                  _one_line(t_docs.get(name, "")))
    tenant_fields = _fields(src.Tenant)
    tenant_docs = field_docs(src.Tenant)
    for opt in src.TENANT_KEYS:
        key = f"tenants.named.<name>.{opt}"
        f = tenant_fields.get(opt)
        meaning = tenant_docs.get(opt, "")
        if f is None:  # accepted by the parser, stored as another field (salt -> salt_sha256)
            kind, default = "str", "—"
        else:
            kind, default = _type_name(f.type), _dc_default(f, opt)
        base = {} if opt == "salt_sha256" else {"salt": "s"}
        build = _pool_build(["tenants", "named", "acme", opt], {"tenants": {"named": {"acme": base}}})
        yield Row(key, kind, default, _allowed_from(build, key), _one_line(meaning))


# ---------------------------------------------------------------- the router config

def _pydantic_allowed(info: Any) -> str:
    parts = []
    ann = info.annotation
    if typing.get_origin(ann) is typing.Literal:
        parts.append("one of " + ", ".join(f"`{a}`" for a in typing.get_args(ann)))
    for m in info.metadata:
        for attr, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            parts.append(f"matches `{m.pattern}`")
    return ", ".join(parts) or "any"


def _pydantic_rows(model: Any, prefix: str) -> Iterator[Row]:
    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = info.annotation
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is list and typing.get_args(ann) else None
        default_value = info.default_factory() if info.default_factory is not None else info.default
        if isinstance(default_value, BaseModel):
            default = "(below)"
        elif default_value is ... or info.is_required():
            default = "required"
        else:
            default = _show(default_value, name)
        meaning = info.description or ""
        if not meaning and isinstance(ann, type) and issubclass(ann, BaseModel):
            meaning = _own_doc(ann)
        yield Row(key, _type_name(ann), default, _pydantic_allowed(info), _one_line(meaning))
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _pydantic_rows(ann, f"{key}.")
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _pydantic_rows(inner, f"{key}[].")


def router_rows() -> Iterator[Row]:
    yield from _pydantic_rows(src.RouterConfig, "")


# ---------------------------------------------------------------- checks

def pool_accepted_keys() -> set[str]:
    """Every key the pool config's parsers accept, from their own lists of allowed names."""
    top = [n for n in _fields(src.PofConfig) if n != "index_auth"]
    keys = set(top) | set(src.INDEX_AUTH_KEYS)
    keys |= {f"tiers.{m}.{o}" for m in src.KNOWN_MEDIA for o in src.TIER_OPTIONS[m]}
    for section, (_, accepted) in src.POOL_SECTIONS.items():
        keys |= {f"{section}.{o}" for o in accepted}
    keys |= {f"tenants.{o}" for o in src.TENANTS_KEYS}
    keys |= {f"tenants.named.<name>.{o}" for o in src.TENANT_KEYS}
    return keys


def pool_field_keys() -> set[str]:
    """Every dataclass field of the pool config, as the key a user writes."""
    keys = {n for n in _fields(src.PofConfig) if n != "index_auth"}
    keys |= {f"index_{n}" for n in _fields(src.IndexAuth)}
    for section, (cls, _) in src.POOL_SECTIONS.items():
        keys |= {f"{section}.{n}" for n in _fields(cls)}
    keys |= {f"tenants.{n}" for n in _fields(src.TenantsConfig)}
    keys |= {f"tenants.named.<name>.{n}" for n in _fields(src.Tenant) if n != "name"}  # the name is the key
    tier_fields = set(_fields(src.TierConfig)) - {"medium"}                                # the medium is the key
    options = {o for m in src.KNOWN_MEDIA for o in src.TIER_OPTIONS[m]}
    keys |= {f"tiers.<medium>.{o}" for o in tier_fields - options}  # a field no medium accepts: reported
    return keys


def router_field_keys(model: Any = None, prefix: str = "") -> set[str]:
    from pydantic import BaseModel

    model = model or src.RouterConfig
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(prefix + name)
        ann = info.annotation
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is list and typing.get_args(ann) else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= router_field_keys(ann, f"{prefix}{name}.")
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            keys |= router_field_keys(inner, f"{prefix}{name}[].")
    return keys


def config_key_problems(pool: list[Row], router: list[Row]) -> list[str]:
    """Differences between the keys listed and the keys the code knows; empty when none."""
    problems = []
    listed = {r.key for r in pool}
    fields = {k for k in pool_field_keys() if not k.startswith("tiers.<medium>.")}
    for key in sorted(pool_accepted_keys() - listed):
        problems.append(f"pool config: the parser accepts `{key}` but the reference does not list it")
    for key in sorted(listed - pool_accepted_keys()):
        problems.append(f"pool config: the reference lists `{key}` but the parser does not accept it")
    for key in sorted(fields - listed):
        problems.append(f"pool config: dataclass field `{key}` is missing from the reference")
    for key in sorted(k for k in pool_field_keys() if k.startswith("tiers.<medium>.")):
        problems.append(f"pool config: TierConfig field `{key.rsplit('.', 1)[1]}` is accepted by no medium")
    r_listed = {r.key for r in router}
    for key in sorted(router_field_keys() - r_listed):
        problems.append(f"router config: field `{key}` is missing from the reference")
    for key in sorted(r_listed - router_field_keys()):
        problems.append(f"router config: the reference lists `{key}`, which RouterConfig does not have")
    return problems


# ---------------------------------------------------------------- pages

def _sections(rows: list[Row], nested: set[str]) -> str:
    """One table per section: the plain keys first, then each nested mapping under its own heading."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        head = r.key.split(".", 1)[0].split("[", 1)[0]
        if head in nested:
            title = f"`{head}`"
        elif head.startswith("index_") and head not in ("index_url", "index_timeout_s"):
            title = "Index credentials"
        else:
            title = "Top-level keys"
        groups.setdefault(title, []).append(r)
    return "\n\n".join(f"### {title}\n\n{_table(group)}" for title, group in groups.items())


def _table(rows: list[Row]) -> str:
    out = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r.key}` | `{r.type}` | {r.default} | {r.allowed} | {r.meaning} |")
    return "\n".join(out)


CONFIG_HEADER = """# Configuration reference

Generated from the code when this site is built (`docs/hooks/reference.py`): every key the pool's and
the router's parsers accept, its type and default, what the validator allows (for the pool config, the
validator's own answer to a wrong value) and the field's own documentation ("—" where the source has
none). The build fails when a key the code accepts is missing here. A guide with examples:
[Configuration](../configuration.md).
"""


def config_reference() -> tuple[str, list[str]]:
    """The page's markdown and the problems found (an empty list when the reference is complete)."""
    pool = list(pool_rows())
    router = list(router_rows())
    problems = config_key_problems(pool, router)
    page = "\n".join([
        CONFIG_HEADER,
        "## Pool node",
        "",
        "One `PofConfig` per pool node, read from vLLM's `kv_connector_extra_config`, SGLang's",
        "`--hicache-storage-backend-extra-config`, LMCache's `storage_plugin.pof.*` keys, or the YAML file",
        "of `pof … --config FILE`. An unknown key or a bad value stops start-up with a message naming the key.",
        "",
        _sections(pool, {"tiers", "tenants", *src.POOL_SECTIONS}),
        "",
        "## Router (`pof router --config FILE`)",
        "",
        "`RouterConfig`, from the YAML file given to `pof router --config`; unknown keys are refused. "
        "`examples/router/pof-router.yaml` has every key with its default.",
        "",
        _sections(router, {"backends", "prefill", "decode", "cost", "capacity", "health"}),
        "",
    ])
    return page, problems


def _option_row(a: argparse.Action) -> str:
    flags = ", ".join(f"`{s}`" for s in a.option_strings) if a.option_strings else f"`{a.metavar or a.dest}`"
    if a.nargs == 0:
        value = "—"
    else:
        metavar = a.metavar if isinstance(a.metavar, str) else a.dest.upper()
        value = f"`{metavar}`"
    choices = ", ".join(f"`{c}`" for c in a.choices) if a.choices and not isinstance(a.choices, dict) else ""
    default = "" if a.default in (None, argparse.SUPPRESS, False) or a.nargs == 0 else f"`{a.default}`"
    help_text = (a.help or "—").replace("%(default)s", str(a.default)).replace("%%", "%")
    return f"| {flags} | {value} | {default} | {choices} | {_one_line(help_text)} |"


def _commands(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            seen: set[int] = set()
            for name, sub in a.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                yield f"{path} {name}", sub, helps.get(name, "")
                yield from _commands(sub, f"{path} {name}")


def cli_reference() -> str:
    parser = src.build_parser()
    out = [
        "# CLI reference",
        "",
        "Generated from the `pof` command's argparse parsers when this site is built "
        "(`docs/hooks/reference.py`), so every command and option here exists. "
        "`pof COMMAND --help` prints the same. Every `pof …` command the README and these pages show is "
        "checked against these parsers by the docs stage of `ci/test.sh`.",
        "",
    ]
    commands = [("pof", parser, parser.description or "")]
    commands += list(_commands(parser, "pof"))
    out.append("| command | what it does |")
    out.append("|---|---|")
    for path, _, help_text in commands[1:]:
        anchor = path.replace(" ", "-")
        out.append(f"| [`{path}`](#{anchor}) | {_one_line(help_text)} |")
    out.append("")
    for path, sub, help_text in commands:
        anchor = path.replace(" ", "-")
        out.append(f"## `{path}` {{#{anchor}}}")
        out.append("")
        if help_text or sub.description:
            out.append(_one_line(sub.description or help_text))
            out.append("")
        usage = sub.format_usage().strip().removeprefix("usage: ")
        out.append("```text")
        out.append(usage)
        out.append("```")
        out.append("")
        rows = [a for a in sub._actions
                if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))]
        if rows:
            out.append("| option | value | default | choices | meaning |")
            out.append("|---|---|---|---|---|")
            out.extend(_option_row(a) for a in rows)
            out.append("")
    return "\n".join(out)
