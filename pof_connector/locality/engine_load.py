"""An engine's load and KV-memory pressure as its own Prometheus endpoint reports it.

``pof relay --engine-url`` reads it every heartbeat and publishes it in its index node, so the
locality API can answer "node load" for engines that no pof router fronts; `pof router` reads
its backends' ``/metrics`` itself (fresher) and routes on KV occupancy. vLLM and SGLang name the
series differently; gauges are summed (requests) or averaged (usage) over their label sets (one
per model / DP rank):

=================  ===================================  ======================================
field              vLLM                                 SGLang
=================  ===================================  ======================================
running            ``vllm:num_requests_running``        ``sglang:num_running_reqs``
waiting            ``vllm:num_requests_waiting``        ``sglang:num_queue_reqs``
kv_usage           ``vllm:kv_cache_usage_perc``         ``sglang:token_usage``
kv_capacity_tokens ``vllm:cache_config_info`` labels    ``sglang:max_total_num_tokens``
                   ``num_gpu_blocks`` x ``block_size``
block_tokens       ``vllm:cache_config_info`` label     (none: the router's ``block_tokens``)
                   ``block_size``
preemptions        ``vllm:num_preemptions_total``       ``sglang:num_retracted_requests_total``
=================  ===================================  ======================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlencode

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
"""Fraction (0..1) of the engine's KV blocks held by requests (cached, unreferenced blocks count as
free: the engine evicts them on demand). ``gpu_cache_usage_perc``: vLLM's older name."""
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
CACHE_CONFIG = "vllm:cache_config_info"
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
_WANTED = (*RUNNING, *WAITING, *KV_USAGE, *PREEMPTIONS, CACHE_CONFIG, SGLANG_CAPACITY)
LOAD_QUERY = urlencode([("name[]", name) for name in _WANTED])
"""Restricts a Prometheus page to the series read here: prometheus_client's exposition app renders
only the collectors named in ``name[]``. vLLM's whole page is ~57 KB (histograms per request
phase) that its API server renders on every read, on the engine's host: 11-13 ms of its CPU per
read against 1.2-1.4 ms for the restricted page (vLLM 0.32 on CPU, measured). Read twice a second
per engine by `pof router`, the whole page cost each API server ~2.5 % of a core."""
PLAIN = {"accept-encoding": "identity"}
"""Request headers for a load read: a restricted page is ~1.5 KB, not worth compressing on the
engine's host (httpx asks for gzip by default, and prometheus_client's app honours it)."""
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    """Requests the engine is running (prefill or decode)."""
    waiting: int
    """Requests queued in the engine's scheduler."""
    kv_usage: float | None = None
    """Fraction of the KV cache held by requests, 0..1; ``None``: the engine does not say."""
    kv_capacity_tokens: int | None = None
    """Tokens the KV cache holds in all; ``None``: the engine does not say."""
    block_tokens: int | None = None
    """Tokens per KV block; ``None``: the engine does not say (SGLang's pages are not exported)."""
    preemptions: int | None = None
    """Requests preempted (vLLM) or retracted (SGLang) since the engine started; ``None``: unknown."""

    def to_meta(self) -> dict[str, str]:
        meta = {"running": str(self.running), "waiting": str(self.waiting)}
        for key, value in (("kv_usage", self.kv_usage), ("kv_capacity_tokens", self.kv_capacity_tokens),
                           ("kv_block_tokens", self.block_tokens), ("preemptions", self.preemptions)):
            if value is not None:
                meta[key] = str(value)
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> EngineLoad | None:
        """The load a relay published; ``None`` when no relay reads the engine's metrics."""
        try:
            return cls(int(meta["running"]), int(meta["waiting"]), _opt(meta, "kv_usage", float),
                       _opt(meta, "kv_capacity_tokens", int), _opt(meta, "kv_block_tokens", int),
                       _opt(meta, "preemptions", int))
        except (KeyError, ValueError):
            return None


def _opt(meta: dict[str, str], key: str, kind: Callable[[str], _T]) -> _T | None:
    raw = meta.get(key)
    return kind(raw) if raw is not None else None


def parse_engine_load(text: str) -> EngineLoad | None:
    """From Prometheus text; ``None`` when it carries neither engine's request gauges."""
    running = waiting = 0.0
    seen = False
    usage: list[float] = []
    preemptions: float | None = None
    capacity: float | None = None
    block: int | None = None
    # Only the series read here go to the parser: a vLLM /metrics page is 55-100 KB of histograms, and
    # parsing all of it twice a second per backend cost `pof router` a quarter of a core (measured).
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            name = sample.name
            if name in RUNNING:
                running += sample.value
                seen = True
            elif name in WAITING:
                waiting += sample.value
                seen = True
            elif name in KV_USAGE:
                usage.append(sample.value)
            elif name in PREEMPTIONS:
                preemptions = (preemptions or 0.0) + sample.value
            elif name == SGLANG_CAPACITY:
                capacity = (capacity or 0.0) + sample.value
            elif name == CACHE_CONFIG:
                blocks, size = _int_label(sample.labels, "num_gpu_blocks"), _int_label(sample.labels, "block_size")
                if size:
                    block = size
                if blocks and size:
                    capacity = (capacity or 0.0) + blocks * size
    if not seen:
        return None
    return EngineLoad(round(running), round(waiting), sum(usage) / len(usage) if usage else None,
                      round(capacity) if capacity else None, block,
                      round(preemptions) if preemptions is not None else None)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    """An integer label; ``None`` when absent or not a number (vLLM writes "None" before the
    engine has sized its cache)."""
    raw = labels.get(key, "")
    return int(raw) if raw.isdigit() else None


class MetricsPage:
    """Where one engine's load is read: ``/metrics/?`` :data:`LOAD_QUERY` first, else the whole
    ``/metrics``.

    The trailing slash matters: vLLM (0.32) answers ``GET /metrics`` with
    prometheus-fastapi-instrumentator's route, which ignores the query and renders everything;
    ``/metrics/`` reaches the prometheus_client app vLLM mounts beside it (its "307 redirect"
    workaround), which restricts the page. A server that has no ``/metrics/`` (404), ignores the
    query, or whose restricted page carries no load gauges (SGLang: its multiprocess collector
    names no series, so the filter drops everything) is read whole: after the first whole page that
    gives a load where the restricted one did not, only whole pages are asked for."""

    def __init__(self, base_url: str) -> None:
        base = base_url.rstrip("/")
        self.full_url = base + "/metrics"
        self.restricted_url = f"{base}/metrics/?{LOAD_QUERY}"
        self.restricts: bool = True
        """Whether the restricted page is asked for first; ``False`` once the whole page gave a
        load the restricted one did not."""

    def urls(self) -> tuple[str, ...]:
        """The pages to read in this order until one gives a load (a refused restricted page
        counts as one without)."""
        return (self.restricted_url, self.full_url) if self.restricts else (self.full_url,)

    def load_from(self, url: str, text: str) -> EngineLoad | None:
        """The load in the page read from ``url`` (one of :meth:`urls`); ``None``: none there, read
        the next one. Raises ``ValueError`` for text that is not Prometheus'."""
        load = parse_engine_load(text)
        if load is not None and url == self.full_url:
            self.restricts = False          # the engine cannot restrict its page: read it whole from now on
        return load


def read_engine_load(base_url: str | MetricsPage, client: httpx.Client) -> EngineLoad | None:
    """GET the engine's ``/metrics`` (``base_url``'s, or the :class:`MetricsPage`, which remembers
    whether the engine restricts its page). Raises ``httpx.HTTPError`` when the engine does not
    answer; ``None`` when it answers without load gauges."""
    page = MetricsPage(base_url) if isinstance(base_url, str) else base_url
    load = None
    for url in page.urls():
        r = client.get(url, headers=PLAIN)
        if url != page.full_url and r.status_code != 200:
            continue                        # no restricted page here: the whole one says
        r.raise_for_status()
        load = page.load_from(url, r.text)
        if load is not None:
            break
    return load
