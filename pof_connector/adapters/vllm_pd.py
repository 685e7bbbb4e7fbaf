"""vLLM's prefill/decode protocol (``kv_transfer_params``) with the pool as the hand-off.

A proxy (stock ``vllm-router --vllm-pd-disaggregation``, vLLM's example proxies, ``pof router``
with ``prefill:``/``decode:`` groups) sends a request to a prefill server with
``{"do_remote_decode": true}`` and ``max_tokens: 1``, then to a decode server with the
``kv_transfer_params`` the prefill's response carries. Here:

* **Prefill**: the prompt's pages go to the pool by the ordinary save path during the forward;
  :meth:`PDBooks.handoff` names them (``pof_tokens``) for the decode side. Blocks are freed at
  once (``delay_free_blocks`` False): the pool holds copies, nothing reads the blocks later.
* **Decode**: the prefill's store thread publishes a few milliseconds after the response, so a
  lookup may find fewer pages than were named. :meth:`PDBooks.keep_waiting` then answers vLLM
  "not yet" (``get_num_new_matched_tokens`` returns ``None``: the request stays queued and is
  asked again next step) until the named pages are in the index or ``pd.wait_s`` passed. The
  load itself is the ordinary synchronous, checked load: a page that fails its checks is
  recomputed, like any pool hit. Waiting this way (instead of vLLM's ``load_kv_async`` and
  ``WAITING_FOR_REMOTE_KVS``) needs no blocks while nothing has arrived, and the worker half
  stays as it is.

Scheduler side only: books, no bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pof_connector.config import PDConfig

log = logging.getLogger("pof_connector.vllm")


@dataclass
class _Wait:
    deadline: float
    want: int          # pages (from the prompt's start) the prefill named
    asked: float = 0.0  # when the index was last asked


def is_decode(request: Any) -> bool:
    """Whether ``request`` came to this (decode) server with a prefill's hand-off."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return bool(params.get("do_remote_prefill"))


def is_prefill(request: Any) -> bool:
    """Whether ``request`` is the prefill half of a disaggregated request."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return bool(params.get("do_remote_decode"))


class PDBooks:
    def __init__(self, config: PDConfig, node_id: str, tp_size: int) -> None:
        self.config = config
        self.node_id = node_id
        self.tp_size = tp_size
        self._waits: dict[str, _Wait] = {}
        self._gave_up: set[str] = set()

    # ---- decode side -----------------------------------------------------------------------

    def named_pages(self, request: Any, page_tokens: int) -> int:
        """Pages of ``request``'s prompt the prefill said it put in the pool (0: not a hand-off)."""
        if not is_decode(request):
            return 0
        tokens = request.kv_transfer_params.get("pof_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            return 0        # another connector's prefill, or one that stored nothing: a plain lookup
        return tokens // page_tokens

    def may_ask(self, req_id: str) -> bool:
        """Whether a waiting request may ask the index now (``poll_s`` since the last time)."""
        wait = self._waits.get(req_id)
        now = time.monotonic()
        if wait is None or now - wait.asked >= self.config.poll_s:
            if wait is not None:
                wait.asked = now
            return True
        return False

    def keep_waiting(self, req_id: str, have: int, want: int) -> bool:
        """Whether to answer vLLM "not yet" for ``req_id``: the index shows ``have`` of the
        ``want`` leading pages the prefill named, and ``pd.wait_s`` has not passed since the
        request first asked. Once it passed, the request loads what is there and computes the
        rest (logged once)."""
        if have >= want or req_id in self._gave_up:
            wait = self._waits.pop(req_id, None)
            if wait is not None and have >= want:
                log.info("pof: request %s (P/D decode): the %d pages its prefill named are in the index after "
                         "%.2fs", req_id, want, time.monotonic() - wait.deadline + self.config.wait_s)
            return False
        now = time.monotonic()
        wait = self._waits.get(req_id)
        if wait is None:
            wait = self._waits[req_id] = _Wait(now + self.config.wait_s, want, now)
        if now < wait.deadline:
            return True
        self._waits.pop(req_id, None)
        self._gave_up.add(req_id)
        log.warning("pof: request %s: its prefill named %d pool pages, %d are in the index after %.1fs "
                    "(pd.wait_s): the rest is computed here", req_id, want, have, self.config.wait_s)
        return False

    def waiting(self, req_id: str) -> bool:
        return req_id in self._waits

    # ---- prefill side ----------------------------------------------------------------------

    def handoff(self, request: Any, pool_tokens: int) -> dict[str, Any]:
        """``kv_transfer_params`` for the decode half. ``pool_tokens``: leading prompt tokens whose
        pages this server put (or found) in the pool. The ``remote_*`` fields are those vLLM's
        NixlConnector returns, so proxies that read them (vllm-router's P/D mode) pass the
        hand-off on; a decode server with pof reads only ``do_remote_prefill`` and ``pof_tokens``.
        ``remote_block_ids`` is empty: nothing is pinned here for the decode server to read."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.node_id, "remote_request_id": request.request_id,
                "remote_block_ids": [], "remote_host": "", "remote_port": 0, "tp_size": self.tp_size,
                "remote_num_tokens": pool_tokens,
                "pof_node": self.node_id, "pof_tokens": pool_tokens}

    def finished(self, req_id: str) -> None:
        self._waits.pop(req_id, None)
        self._gave_up.discard(req_id)
