"""Every `pof …` command that README.md and the docs pages show exists, with the flags they show.

Commands are taken from fenced code blocks (shell-like ones: no language, bash, sh, console, text)
and from inline code spans that start with ``pof ``. Each is resolved in the real ``pof`` parser
(``sources.build_parser``): every sub-command word must name a command, and every ``--flag`` must
be an option of the command it follows. Usage synopses are understood: ``[--json]``, and
alternatives ``serve | stop | stats`` or ``sweep | calibrate --from F``.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import sources

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_INLINE = re.compile(r"(?<!`)`(pof [^`]+)`(?!`)")
_POF = re.compile(r"(?:^|[\s;&(])(?:\S*/)?pof(?=\s|$)")
_FLAG = re.compile(r"^--?[A-Za-z][\w-]*")
_PLACEHOLDER = {"…", "...", "COMMAND", "ARGS..."}


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)
    return files


def shown_commands(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, the text after ``pof``) of every command the file shows."""
    lines = path.read_text(encoding="utf-8").splitlines()
    fence: str | None = None
    lang = ""
    pending = ""
    pending_at = 0
    for n, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence, lang = m.group(2), m.group(3).lower()
            elif m.group(2).startswith(fence[0]) and len(m.group(2)) >= len(fence):
                fence = None
            continue
        if fence is not None:
            if lang not in SHELL_FENCES:
                continue
            text = pending + " " + line.strip() if pending else line.strip()
            at = pending_at if pending else n
            if text.endswith("\\"):
                pending, pending_at = text[:-1], at
                continue
            pending = ""
            found = _POF.search(text)
            if found:
                yield at, text[found.end():]
            continue
        for span in _INLINE.finditer(line):
            yield n, span.group(1)[len("pof"):]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _tokens(text: str) -> list[str]:
    text = re.split(r"\s#\s|\s#$|\s{2,}#", " " + text)[0]   # a trailing comment
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def problems(text: str, root: argparse.ArgumentParser) -> list[str]:
    """What in ``pof TEXT`` the parser does not know; empty when everything resolves."""
    parser, parent, path = root, None, ["pof"]
    words_allowed = True          # right after a command word, a further word may name a sub-command
    out: list[str] = []
    tokens = _tokens(text)
    i = 0
    while i < len(tokens):
        raw = tokens[i]
        tok = raw.strip("[](),")
        i += 1
        if tok in _PLACEHOLDER and words_allowed and _subcommands(parser):
            break                       # "pof bench … --json": any command of the group
        if not tok or tok in _PLACEHOLDER or raw.startswith(("<", "$")):
            words_allowed = False
            continue
        if tok == "|":
            nxt = tokens[i].strip("[]") if i < len(tokens) else ""
            if parent is not None and nxt in _subcommands(parent):
                parser, path[-1] = _subcommands(parent)[nxt], nxt
                i += 1
                words_allowed = True
                continue
            if not nxt.startswith("-"):
                break                   # piped into another program
            continue
        subs = _subcommands(parser)
        if words_allowed and subs and re.fullmatch(r"[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*", tok):
            names = tok.split("|")
            unknown = [w for w in names if w not in subs]
            if unknown:
                out.append(f"`{' '.join(path)} {unknown[0]}`: no such command (commands: {', '.join(subs)})")
                break
            parent, parser = parser, subs[names[0]]
            path.append(names[0])
            continue
        words_allowed = False
        flag = _FLAG.match(tok)
        if flag and tok[1:2] != " ":
            name = flag.group(0)
            if name not in parser._option_string_actions:
                out.append(f"`{' '.join(path)}` has no option `{name}`")
    return out


CASES = [(p, n, text) for p in doc_files() for n, text in shown_commands(p)]


def test_the_docs_show_commands() -> None:
    assert len(CASES) > 50, "the extractor found almost no `pof` commands: it is broken"


@pytest.mark.parametrize(("path", "line", "text"), CASES,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in CASES])
def test_command_exists_with_its_flags(path: Path, line: int, text: str) -> None:
    found = problems(text, sources.build_parser())
    assert not found, f"{path.relative_to(ROOT)}:{line}: pof{text}\n  " + "\n  ".join(found)


def test_the_checker_catches_what_it_should() -> None:
    root = sources.build_parser()
    assert problems(" bench capacity --json --no-such-flag", root)
    assert problems(" benchh tiers", root)
    assert problems(" sim sweep | calibrate --bench X", root)   # --bench is validate's, not calibrate's
    assert not problems(" sim sweep | calibrate --from X | validate --bench X", root)
    assert not problems(" index serve | stop | stats", root)
    assert not problems(" stats --json | jq .nodes", root)
