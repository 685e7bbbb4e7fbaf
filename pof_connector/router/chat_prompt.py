"""A chat request's prompt text, rendered in `pof router` as vLLM renders it (issue 42).

Routing on a chat request needs its prompt's token ids: the messages put through the model's
chat template, then tokenized. Asking a backend's ``/tokenize`` for them costs a round trip to a
busy API server per request, which a router that must not be slower than a stock one cannot pay.
So the router renders the template itself, with the library vLLM renders it with:
``transformers``' ``apply_chat_template`` on the tokenizer of the model directory (its
``chat_template.jinja`` or ``tokenizer_config.json``), and tokenizes the text without adding
special tokens, as vLLM does for chat unless the request sets ``add_special_tokens``.

Only the requests vLLM renders that plainly are rendered here: roles ``system``, ``user`` and
``assistant`` with string contents (and an optional ``name``), and no field that changes the
rendering beyond ``add_generation_prompt``, ``continue_final_message`` and
``add_special_tokens`` (:data:`ASK_BACKEND`). Any other request (tools, content parts, images, a
template of the request's own) is tokenized by a backend, as before. Tokens that differ from the
engine's only send a request to a node that holds less of it: the engine checks every page it
loads, so routing never decides what KV the engine reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pof.router")
ROLES = frozenset({"system", "user", "assistant"})
MESSAGE_KEYS = frozenset({"role", "content", "name"})
ASK_BACKEND = frozenset({"tools", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
                         "media_io_kwargs", "mm_processor_kwargs", "truncate_prompt_tokens"})
"""Request fields that change the prompt in ways only the engine knows (vLLM passes them to the
template or cuts the prompt): a request holding any of them is tokenized by a backend."""
FLAGS = ("add_generation_prompt", "continue_final_message", "add_special_tokens")
DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False}
"""vLLM's defaults for a chat request's rendering flags."""
TOKENIZE_FIELDS = ("model", "messages", *FLAGS, "chat_template", "chat_template_kwargs", "tools", "media_io_kwargs",
                   "mm_processor_kwargs")
"""What a chat request sent to a backend's ``/tokenize`` carries of it (a request not rendered
here): the fields of vLLM's ``TokenizeChatRequest``."""


class ChatPrompt:
    """Renders chat requests with ``tok`` (a ``transformers`` tokenizer) and its chat template, or
    ``template`` (a Jinja template's text: the engine's ``--chat-template``) when given."""

    def __init__(self, tok: Any, template: str | None = None) -> None:
        import jinja2

        self.tok = tok
        self.template = template
        self._refusals = (jinja2.TemplateError, ValueError, TypeError)
        """What a template raises for a request it refuses (the engine refuses it too, and says why)."""

    @classmethod
    def load(cls, model_dir: str, template: str | None = None) -> ChatPrompt | None:
        """The renderer of ``model_dir``'s chat template (``template``: that template's text
        instead); ``None`` when transformers or jinja2 is missing, or there is no template: chat
        requests are then tokenized by a backend (logged once, here)."""
        try:
            import jinja2  # noqa: F401  (transformers renders with it, and imports it only then)
            from transformers import AutoTokenizer
        except ImportError as e:
            log.warning("pof router: chat requests are tokenized by a backend's /tokenize, a round trip each (%s; "
                        "pip install transformers jinja2)", e)
            return None
        try:
            tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:       # transformers raises what the model's loader raises
            log.warning("pof router: cannot load the tokenizer of %s for chat templates (%s); chat requests are "
                        "tokenized by a backend's /tokenize", model_dir, e)
            return None
        if template is None and not getattr(tok, "chat_template", None):
            log.info("pof router: %s has no chat template; chat requests are tokenized by a backend's /tokenize",
                     model_dir)
            return None
        log.info("pof router: chat requests are rendered locally with %s", "the configured chat_template"
                 if template is not None else f"the chat template of {model_dir}")
        return cls(tok, template)

    def render(self, body: dict[str, Any]) -> tuple[str, bool] | None:
        """The prompt text of chat request ``body`` and whether special tokens are added to it;
        ``None``: not a request rendered here (see the module doc), or the template refused it."""
        if not ASK_BACKEND.isdisjoint(body):
            return None
        flags = {}
        for k in FLAGS:
            v = body.get(k, DEFAULTS[k])
            if not isinstance(v, bool):
                return None
            flags[k] = v
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            if (not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                    or not MESSAGE_KEYS.issuperset(m) or not isinstance(m.get("name", ""), str)):
                return None
        try:
            text = self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=flags["add_generation_prompt"],
                                                continue_final_message=flags["continue_final_message"])
        except self._refusals:
            return None
        return (text, flags["add_special_tokens"]) if isinstance(text, str) else None

    def tokens(self, body: dict[str, Any], tokenize: Callable[[str, bool], list[int]]) -> list[int] | None:
        """Chat request ``body``'s prompt ids: :meth:`render`, then ``tokenize(text,
        special_tokens)`` (a :class:`~pof_connector.router.prefix_tokenizer.PrefixTokenizer`, as
        the router's); ``None`` as for :meth:`render`. The router itself renders and tokenizes in
        two steps, the second maybe on a thread."""
        rendered = self.render(body)
        return tokenize(*rendered) if rendered is not None else None
