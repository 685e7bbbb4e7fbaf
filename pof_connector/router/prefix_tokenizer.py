"""Text prompts tokenized once per shared prefix: `pof router`'s local tokenizer with a cache.

Tokenizing a 2,900-token prompt costs the router about a millisecond (HF ``tokenizers``), most of
its own time per request, though most prompts begin with a system prompt it has seen before. So
the token ids of a prompt's leading text are kept, cut at fixed places, and a later prompt that
begins with the same text only has its rest tokenized.

The result is exact, not an estimate: a cut is only made where the tokenizer itself splits the
text, so ``ids(text[:c]) + ids(text[c:]) == ids(text)``. That holds for a byte-level BPE
tokenizer (GPT-2's pre-tokenizer regex, ``ByteLevel`` with ``use_regex``) with no normalizer at a
single space between two letters or digits: that regex never lets a piece cross such a space
and starts the next piece at it, whatever comes after, and reads nothing before a piece's start
(no look-behind), and the model encodes each piece on its own. Added tokens (``<|bos|>`` ...)
are matched in the text before that: no cut is made within reach of one. Any other tokenizer
(a normalizer, another pre-tokenizer, truncation) is used as it is, uncached.

Cuts: the first such space at or after every ``block_chars`` characters, so the cuts of a shared
prefix are the same whatever follows it. Kept: the ids before each cut of every prompt tokenized,
the least recently used forgotten past ``max_tokens`` in all.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

CUT = re.compile(r"(?<=[^\W_]) (?=[^\W_])")
"""A single space between two letters or digits (Python's ``\\w`` less ``_``: never whitespace in
any definition the tokenizer may use)."""
BLOCK_CHARS = 512
MAX_TOKENS = 1 << 21
SEARCH_CHARS = 256
"""How far past a block's start a cut is looked for (none found: that block has no cut)."""


class PrefixTokenizer:
    """``tokenizers.Tokenizer`` ``tok`` as a function of text to ids (special tokens added, as the
    engine adds them to a completions prompt, unless ``special_tokens`` is false: a rendered chat
    prompt), caching leading text when ``tok`` allows it (:attr:`cached`)."""

    def __init__(self, tok: Any, *, block_chars: int = BLOCK_CHARS, max_tokens: int = MAX_TOKENS) -> None:
        self.tok = tok
        self.block_chars = block_chars
        self.max_tokens = max_tokens
        self._kept: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        """Leading text -> its ids, as tuples: the collector stops tracking a tuple of ints the first
        time it sees one, where it would walk a list of thousands of ids in every collection."""
        self._kept_tokens = 0
        self._lock = threading.Lock()
        self._looked: tuple[str | None, list[int], int, tuple[int, ...]] = (None, [], 0, ())
        """The last text looked at, its cuts and longest kept head (read and written whole: threads
        may tokenize at once, and a head kept is never wrong, only perhaps not the longest)."""
        added = [t for t in tok.get_added_tokens_decoder().values() if t.content]
        self._added = re.compile("|".join(re.escape(t.content) for t in added)) if added else None
        self._reach = max((len(t.content) for t in added), default=0) + 2
        self.cached = _splits_at_spaces(tok)
        """Whether ``tok`` splits where :data:`CUT` matches (else every call tokenizes it all)."""
        ends = _special_ends(tok) if self.cached else None
        self.cached = ends is not None
        self._pre, self._post = ends or ([], [])

    def __call__(self, text: str, special_tokens: bool = True) -> list[int]:
        if not self.cached:
            return list(self.tok.encode(text, add_special_tokens=special_tokens).ids)
        looked = self._looked
        cuts, at, head = looked[1:] if looked[0] is text else self._look(text)
        enc = self.tok.encode(text[at:] if at else text, add_special_tokens=False)
        # One list for the answer (special ids, the cached head, the rest): each copy of a
        # 3,000-token list costs a few microseconds, and this was four of them.
        out = self._pre.copy() if special_tokens else []
        pre = len(out)
        out += head
        out += enc.ids
        if special_tokens:
            out += self._post
        for c in cuts:
            if c > at:
                # the ids before cut c: the tokens before the first of the piece that starts at its
                # space (the space may be a token of its own)
                word = enc.char_to_word(c + 1 - at)
                span = enc.word_to_tokens(word) if word is not None else None
                if span is not None:
                    self._keep(text[:c], tuple(out[pre:pre + len(head) + span[0]]))
        return out

    def uncached_chars(self, text: str) -> int:
        """Characters of ``text`` a call would tokenize (the rest is cached)."""
        if not self.cached:
            return len(text)
        return len(text) - self._look(text)[1]

    def _look(self, text: str) -> tuple[list[int], int, tuple[int, ...]]:
        """``text``'s cuts and its longest kept head (:meth:`_longest_kept`), remembered for a call
        on the same string right after (the router asks :meth:`uncached_chars` first)."""
        cuts = self._cuts(text)
        at, head = self._longest_kept(text, cuts)
        self._looked = (text, cuts, at, head)
        return cuts, at, head

    def _cuts(self, text: str) -> list[int]:
        out: list[int] = []
        for start in range(self.block_chars, len(text) - 1, self.block_chars):
            m = CUT.search(text, start, min(start + SEARCH_CHARS, len(text)))
            if m is None or (out and m.start() == out[-1]):
                continue
            c = m.start()
            if self._added is not None and self._added.search(text, max(c - self._reach, 0), c + self._reach):
                continue
            out.append(c)
        return out

    def _longest_kept(self, text: str, cuts: list[int]) -> tuple[int, tuple[int, ...]]:
        """(the last cut whose leading text is kept, its ids); (0, []) when none is."""
        with self._lock:
            for c in reversed(cuts):
                ids = self._kept.get(text[:c])
                if ids is not None:
                    self._kept.move_to_end(text[:c])
                    return c, ids
        return 0, ()

    def _keep(self, prefix: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            if prefix in self._kept:
                return
            self._kept[prefix] = ids
            self._kept_tokens += len(ids)
            while self._kept_tokens > self.max_tokens and self._kept:
                self._kept_tokens -= len(self._kept.popitem(last=False)[1])


def _splits_at_spaces(tok: Any) -> bool:
    """Whether ``tok`` is a tokenizer that :data:`CUT` splits exactly (see the module doc)."""
    import json

    cfg = json.loads(tok.to_str())
    pre = cfg.get("pre_tokenizer") or {}
    return (cfg.get("normalizer") is None and cfg.get("truncation") is None and cfg.get("padding") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True)


def _special_ends(tok: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a prompt's own (``<|bos|>``, ...);
    ``None`` when it changes the prompt's own."""
    probe = "pof prefix probe"
    core = list(tok.encode(probe, add_special_tokens=False).ids)
    full = list(tok.encode(probe, add_special_tokens=True).ids)
    at = next((i for i in range(len(full) - len(core) + 1) if full[i:i + len(core)] == core), None)
    if at is None:
        return None
    return full[:at], full[at + len(core):]
