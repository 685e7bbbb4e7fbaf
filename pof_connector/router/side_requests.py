"""`pof router`'s calls to its backends besides the requests it routes, on one httpx client: the
health checks, the ``/metrics`` readings of KV-aware admission, ``POST /tokenize`` for prompts it
cannot tokenize itself (and, in proxy.py, ``GET /v1/models``). They stay on httpx, which the
locality package's engine readers use too: but for ``/tokenize`` they are off the routed
requests' path, where aiohttp's client (:mod:`~pof_connector.router.forward`) saves its time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from pof_connector.locality.engine_load import PLAIN, EngineLoad, MetricsPage
from pof_connector.router.backend import Backend
from pof_connector.router.router import Router
from pof_connector.router.tokenizer_source import TokenizerSource

log = logging.getLogger("pof.router")
STALE = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""A health check on a kept-alive connection the backend has just closed: sent once more (the
routed requests' equivalent is :data:`pof_connector.router.forward.STALE`)."""


async def tokenize(router: Router, client: httpx.AsyncClient, body: dict[str, Any]) -> list[int] | None:
    """Token ids from the least busy healthy backend's ``/tokenize``; ``None`` when none answers."""
    for b in sorted(router.healthy(), key=lambda b: b.running):
        try:
            # ASCII JSON: a prompt may hold lone surrogates (valid JSON escapes, not encodable as
            # UTF-8); the backend judges them, the router must not fail on them
            r = await client.post(b.url + "/tokenize", content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"}, timeout=10.0)
        except httpx.TransportError:
            continue
        if r.status_code == 200:
            tokens = r.json().get("tokens")
            if isinstance(tokens, list):
                return tokens
        return None            # the backend understood the request and refused it: others will too
    return None


async def health_loop(router: Router, client: httpx.AsyncClient, tokens_source: TokenizerSource) -> None:
    h = router.config.health
    while True:
        await asyncio.gather(*(_check(b, client, h.timeout_s) for b in router.backends))
        if not tokens_source.settled:
            await tokens_source.discover(client, [b.url for b in router.healthy()])
        await asyncio.sleep(h.interval_s)


async def load_loop(router: Router, client: httpx.AsyncClient) -> None:
    """Read every backend's ``/metrics`` each ``capacity.metrics_interval_s`` (KV usage, queue,
    preemptions) for KV-aware admission."""
    cap = router.config.capacity
    silent: set[str] = set()
    pages = {b.name: MetricsPage(b.url) for b in router.backends}
    while True:
        readings = await asyncio.gather(*(_read_load(b, pages[b.name], client, cap.metrics_interval_s * 4)
                                          for b in router.backends))
        for b, load in zip(router.backends, readings, strict=True):
            b.record_load(load)
            if (load is None or load.kv_usage is None) and b.name not in silent:
                silent.add(b.name)
                log.info("pof router: backend %s exports no KV usage on %s/metrics (yet); it is routed without "
                         "KV-capacity awareness until it does", b.name, b.url)
            elif load is not None and load.kv_usage is not None:
                silent.discard(b.name)
        await asyncio.sleep(cap.metrics_interval_s)


async def _read_load(b: Backend, page: MetricsPage, client: httpx.AsyncClient, timeout_s: float) -> EngineLoad | None:
    """``b``'s load from ``page`` (only the series the router reads, where the engine can restrict
    its page); ``None`` when it is out of service, does not answer or exports no load."""
    if not b.healthy:
        return None
    for url in page.urls():
        try:
            r = await client.get(url, headers=PLAIN, timeout=max(timeout_s, 1.0))
        except httpx.TransportError:
            return None
        if r.status_code != 200:
            if url != page.full_url:
                continue            # no restricted page here: the whole one says
            return None
        try:
            # a whole page (an engine that cannot restrict it) is ~55 KB: parsed off the event loop
            load = page.load_from(url, r.text) if url != page.full_url else \
                await asyncio.to_thread(page.load_from, url, r.text)
        except ValueError:          # not Prometheus text
            return None
        if load is not None:
            return load
    return None


async def _check(b: Backend, client: httpx.AsyncClient, timeout_s: float) -> None:
    try:
        try:
            r = await client.get(b.url + "/health", timeout=timeout_s)
        except STALE:
            r = await client.get(b.url + "/health", timeout=timeout_s)
    except httpx.TransportError as e:
        b.check_failed(f"health check: {type(e).__name__}")
        log.debug("health check of %s failed: %s", b.name, e)
        return
    if r.status_code == 200:
        b.check_passed()
    else:
        b.check_failed(f"health check answered {r.status_code}")
