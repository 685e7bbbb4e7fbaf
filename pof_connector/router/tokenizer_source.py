"""Where `pof router` gets a text prompt's token ids: a local tokenizer by default.

Asking a backend's ``/tokenize`` costs a round trip per request (on a 2-core box it tripled
the mean TTFT of short prompts through the router: 154 ms against 46 ms with a local tokenizer),
so the router tokenizes completions prompts itself:

- config ``tokenizer: DIR`` or ``FILE``: that ``tokenizer.json``, loaded at start-up (a missing
  file stops the router naming the key);
- ``tokenizer: null`` (the default): the ``tokenizer.json`` of the model directory the backends
  serve, found from their ``GET /v1/models`` (vLLM and SGLang answer the model's path as
  ``root``); until a backend answers, and for good when that directory holds no
  ``tokenizer.json`` here (another host's path, a hub id), a backend's ``/tokenize``, said once in
  the log;
- ``tokenizer: backend``: always a backend's ``/tokenize``.

Chat requests are rendered with the same model directory's chat template (config
``chat_template``: the backends' own ``--chat-template`` file instead) and tokenized here too
(:class:`~pof_connector.router.chat_prompt.ChatPrompt`); those it does not render, and every one
without a local tokenizer, go to a backend's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import httpx

from pof_connector.config import ConfigError
from pof_connector.locality.locator import Tokenizer, hf_tokenizer
from pof_connector.router.chat_prompt import ChatPrompt
from pof_connector.router.prefix_tokenizer import PrefixTokenizer

log = logging.getLogger("pof.router")
BACKEND = "backend"
"""The ``tokenizer`` value that keeps tokenizing on the backends."""


class TokenizerSource:
    def __init__(self, setting: str | None, chat_template: str | None = None) -> None:
        self.setting = setting
        self.tokenizer: Tokenizer | None = None
        """The local tokenizer; ``None``: ask a backend."""
        self.chat: ChatPrompt | None = None
        """Renders chat requests for :attr:`tokenizer`; ``None``: a backend tokenizes them."""
        self._template: str | None = None
        if chat_template is not None:
            try:
                self._template = Path(chat_template).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"chat_template: cannot read {chat_template!r} ({e}); give the Jinja file the "
                                  f"backends run with (--chat-template), or null for the model's own") from None
        self.origin = "backend"
        """'local:<path>' or 'backend' (header ``x-pof-tokens``, ``/pof/backends``)."""
        self.settled = setting is not None
        """No more discovery: configured, or the backends' model directory was tried."""
        if setting is not None and setting != BACKEND:
            try:
                self.tokenizer = PrefixTokenizer(hf_tokenizer(setting))
            except Exception as e:       # tokenizers raises its own Exception type for a bad file
                raise ConfigError(f"tokenizer: cannot load {setting!r} ({e}); give a model directory holding "
                                  f"tokenizer.json, the file itself, '{BACKEND}' or null") from None
            self.origin = f"local:{setting}"
            log.info("pof router: text prompts are tokenized locally with %s", setting)
            self.chat = ChatPrompt.load(_model_dir(setting), self._template)

    async def discover(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        """Try the backends' model directory (``tokenizer: null``); settles after the first
        backend that answers ``/v1/models``."""
        if self.settled:
            return
        for url in urls:
            try:
                r = await client.get(url + "/v1/models", timeout=5.0)
                roots = [str(m.get("root") or m.get("id")) for m in r.json().get("data", [])]
            except (httpx.HTTPError, ValueError, AttributeError, TypeError):
                continue
            self.settled = True
            for root in roots:
                path = Path(root)
                if (path / "tokenizer.json").is_file():
                    try:
                        self.tokenizer = PrefixTokenizer(hf_tokenizer(str(path)))
                    except Exception as e:   # a corrupt file: say so, keep asking the backends
                        log.warning("pof router: cannot load %s/tokenizer.json (%s)", path, e)
                        continue
                    self.origin = f"local:{path}"
                    log.info("pof router: text prompts are tokenized locally with %s/tokenizer.json (the "
                             "backends' model)", path)
                    # transformers takes seconds to import: off the event loop, which serves meanwhile
                    self.chat = await asyncio.to_thread(ChatPrompt.load, str(path), self._template)
                    # What the import built lives as long as the process: out of the collector's
                    # sight, as serve.py freezes what start-up built.
                    gc.freeze()
                    return
            log.warning("pof router: no local tokenizer (the backends serve %s, which holds no tokenizer.json "
                        "on this host); text prompts are tokenized by a backend's /tokenize, a round trip per "
                        "request: set 'tokenizer: DIR' in the router config to avoid it", roots or "no model")
            return


def _model_dir(path: str) -> str:
    """The model directory of a ``tokenizer`` setting (a directory, or a tokenizer.json in one)."""
    p = Path(path)
    return str(p if p.is_dir() else p.parent)
