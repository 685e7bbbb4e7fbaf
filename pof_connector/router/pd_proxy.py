"""`pof router`'s P/D mode: the prefill half of a request (config ``prefill:`` / ``decode:``).

vLLM's own protocol, as its proxies speak it: the request goes to a prefill server (chosen by the
prefill group's router: prefix locality and queue) with ``kv_transfer_params:
{"do_remote_decode": true}``, ``max_tokens: 1``, one choice, not streamed; the
``kv_transfer_params`` of its answer go with the unchanged request to a decode server (chosen by
the decode group's router: KV room, then locality), which loads the prompt's pages from the pool.
The client sees only the decode server's answer (streamed, ``n``, ``logprobs`` as it asked).

A prefill that fails (refused connection, an error status, no healthy prefill server) costs no
answer: the request goes to a decode server without a hand-off, which computes the prompt itself
(co-located). A decode server that fails is replaced by the next best one (proxy.py's loop); the
hand-off stays valid, since the pages are in the pool, not on the failed server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pof_connector.router.forward import BackendError, Forwarder
from pof_connector.router.router import NoBackend, Router

log = logging.getLogger("pof.router")
_DROP = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens", "logprobs",
         "top_logprobs", "prompt_logprobs", "echo")
"""Fields the prefill half does not send: it answers one token the client never sees."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as the prefill half: one choice of one token, not streamed, with the P/D flag."""
    half = {k: v for k, v in body.items() if k not in _DROP}
    half.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return half


async def prefill_half(prefill: Router, forwarder: Forwarder, path: str, body: dict[str, Any],
                       tokens: list[int] | None, headers: dict[str, str],
                       cache_salt: str | None) -> tuple[dict[str, Any] | None, str]:
    """Run the prefill half of ``body``; returns the decode half's ``kv_transfer_params``
    (``None``: the decode server computes the prompt) and what happened, for the
    ``x-pof-prefill`` header: the prefill server's name, or ``none:<why>``."""
    tried: set[str] = set()
    while True:
        try:
            decision = await asyncio.to_thread(prefill.choose, tokens, cache_salt=cache_salt,
                                               exclude=frozenset(tried), max_tokens=1)
        except NoBackend:
            return None, "none:no-prefill-server"
        b = decision.backend
        ticket = b.admit(decision.prefill_tokens, decision.kv_blocks, decision.chain)
        try:
            r = await forwarder.send("POST", b.url + path, json.dumps(prefill_body(body)).encode(),
                                     {**headers, "content-type": "application/json"})
            try:
                answer = await r.read()
            finally:
                r.close()
        except BackendError as e:
            b.check_failed(str(e), now=True)
            tried.add(b.name)
            log.warning("pof router: prefill server %s failed (%s); trying another", b.name, e)
            continue
        finally:
            b.finish(ticket)
        if r.status != 200:
            # The request itself may be bad: the decode server answers it, with its own error.
            return None, f"none:prefill-status-{r.status}"
        try:
            got = json.loads(answer)
        except ValueError:
            return None, "none:prefill-answer-not-json"
        params = got.get("kv_transfer_params") if isinstance(got, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None, "none:no-handoff"        # a prefill server without a P/D connector
        return params, b.name


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The client's request for the decode server, with the prefill's hand-off."""
    return json.dumps({**body, "kv_transfer_params": params} if params is not None else body).encode()
