"""Engine load from the engines' own Prometheus text (vLLM and SGLang gauge names)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest
from fastapi import FastAPI, Response
from fastapi.testclient import TestClient
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_asgi_app,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.routing import Mount

from pof_connector.locality.engine_load import (
    LOAD_QUERY,
    EngineLoad,
    MetricsPage,
    parse_engine_load,
    read_engine_load,
)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 7.0
"""


VLLM_KV = VLLM + """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="64",num_cpu_blocks="None"} 1.0
"""
"""vLLM 0.32's names (vllm/v1/metrics/loggers.py): the counter family ``vllm:num_preemptions`` is
exposed as ``..._total``; ``cache_config_info`` carries the cache geometry as labels."""
SGLANG_KV = SGLANG + """# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 8192.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 2.0
"""
"""SGLang's names (python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector)."""


def test_vllm_and_sglang_gauges_are_summed_over_label_sets() -> None:
    assert parse_engine_load(VLLM) == EngineLoad(running=4, waiting=5)
    assert parse_engine_load(SGLANG) == EngineLoad(running=2, waiting=7)
    assert parse_engine_load("# TYPE other gauge\nother 1.0\n") is None


def test_kv_occupancy_and_pressure_from_both_engines() -> None:
    assert parse_engine_load(VLLM_KV) == EngineLoad(running=4, waiting=5, kv_usage=0.75, kv_capacity_tokens=64 * 128,
                                                    block_tokens=128, preemptions=3)
    assert parse_engine_load(SGLANG_KV) == EngineLoad(running=2, waiting=7, kv_usage=0.5, kv_capacity_tokens=8192,
                                                      block_tokens=None, preemptions=2)
    # before the engine sized its cache vLLM writes num_gpu_blocks="None": capacity unknown, not 0
    early = VLLM_KV.replace('num_gpu_blocks="64"', 'num_gpu_blocks="None"')
    assert parse_engine_load(early) == EngineLoad(4, 5, 0.75, None, 128, 3)


def test_only_the_series_read_are_parsed_and_lookalike_names_do_not_count() -> None:
    # a vLLM page is mostly histograms; a series whose name only starts like a read one is not it
    noise = "".join(f'vllm:x{h}_seconds_bucket{{le="{b}"}} {b}.0\n' for h in range(40) for b in range(30))
    text = VLLM + noise + 'vllm:num_requests_running_peak{model_name="m"} 99.0\nnot prometheus at all {\n'
    load = parse_engine_load(text)
    assert load is not None and (load.running, load.waiting) == (4, 5)
    assert parse_engine_load(noise) is None


def test_meta_round_trip_and_missing_load() -> None:
    load = EngineLoad(running=4, waiting=5)
    assert EngineLoad.from_meta({"x": "y", **load.to_meta()}) == load
    full = EngineLoad(4, 5, 0.75, 8192, 128, 3)
    assert EngineLoad.from_meta(full.to_meta()) == full
    assert EngineLoad.from_meta({}) is None
    assert EngineLoad.from_meta({"running": "4", "waiting": "many"}) is None


class MetricsServer:
    """A stand-in engine ``/metrics`` endpoint (the text vLLM serves); ``text = None`` answers 500;
    ``delay_s``: how long each answer takes (an engine busy with a long prefill)."""

    def __init__(self, text: str | None, delay_s: float = 0.0) -> None:
        self.text = text
        self.delay_s = delay_s
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                time.sleep(me.delay_s)
                path = urlsplit(self.path).path          # a server that ignores the series query
                if path != "/metrics" or me.text is None:
                    self.send_error(404 if path != "/metrics" else 500)
                    return
                body = me.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    s = MetricsServer(VLLM)
    yield s
    s.close()


def test_read_over_http_and_errors(metrics: MetricsServer) -> None:
    with httpx.Client(timeout=2) as client:
        assert read_engine_load(metrics.url + "/", client) == EngineLoad(4, 5)
        metrics.text = None
        with pytest.raises(httpx.HTTPStatusError):
            read_engine_load(metrics.url, client)
        metrics.close()
        with pytest.raises(httpx.HTTPError):
            read_engine_load(metrics.url, client)


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class PrometheusServer:
    """A real prometheus_client exposition (what vLLM's and SGLang's ``/metrics`` mount) of
    ``registry``, recording each request's query string."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries: list[str] = []
        app = make_wsgi_app(registry)

        def recorded(environ: dict[str, Any], start: Any) -> Iterable[bytes]:
            self.queries.append(environ.get("QUERY_STRING", ""))
            return app(environ, start)

        self.server: WSGIServer = make_server("127.0.0.1", 0, recorded, handler_class=_Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _vllm_registry() -> CollectorRegistry:
    """vLLM 0.32's registry (prometheus_client's global one is ``auto_describe=True``): the load
    series, plus histograms like the per-request ones that make up most of its page."""
    r = CollectorRegistry(auto_describe=True)
    labels = ["engine", "model_name"]
    Gauge("vllm:num_requests_running", "running", labels, registry=r).labels("0", "m").set(3)
    Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r).labels("0", "m").set(2)
    Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=r).labels("0", "m").set(0.5)
    Counter("vllm:num_preemptions", "preemptions", labels, registry=r).labels("0", "m").inc(7)
    Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks", "engine"],
          registry=r).labels("128", "32", "0").set(1)
    for i in range(20):
        Histogram(f"vllm:latency_{i}", "a histogram", labels, registry=r,
                  buckets=[0.01 * 2 ** k for k in range(20)]).labels("0", "m").observe(0.3)
    return r


VLLM_LOAD = EngineLoad(running=3, waiting=2, kv_usage=0.5, kv_capacity_tokens=32 * 128, block_tokens=128,
                       preemptions=7)


def test_a_vllm_page_is_read_restricted_to_the_load_series() -> None:
    """The engine renders and sends only the load series (a few hundred bytes, not its histograms),
    and the load read from them is the whole page's."""
    server = PrometheusServer(_vllm_registry())
    try:
        page = MetricsPage(server.url + "/")
        whole = httpx.get(page.full_url).text
        part = httpx.get(page.restricted_url).text
        assert "vllm:latency_0" in whole and "vllm:latency" not in part
        assert len(part) * 20 < len(whole)
        assert parse_engine_load(whole) == VLLM_LOAD
        server.queries.clear()
        with httpx.Client(timeout=2) as client:
            assert read_engine_load(page, client) == VLLM_LOAD
            assert read_engine_load(page, client) == VLLM_LOAD
        assert server.queries == [LOAD_QUERY, LOAD_QUERY] and page.restricts
    finally:
        server.close()


def test_vllm_routes_serve_the_restricted_page_under_the_trailing_slash() -> None:
    """vLLM 0.32's two ``/metrics`` routes (vllm/entrypoints/serve/instrumentator/metrics.py): the
    instrumentator's ``GET /metrics`` renders the whole registry whatever the query; the
    prometheus_client app mounted after it answers ``/metrics/...`` and restricts."""
    registry = _vllm_registry()
    app = FastAPI()
    seen: list[str] = []

    @app.get("/metrics")
    def everything() -> Response:              # what prometheus-fastapi-instrumentator's expose() adds
        seen.append("instrumentator")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    mount = Mount("/metrics", make_asgi_app(registry=registry))
    mount.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(mount)
    with TestClient(app) as client:
        assert "vllm:latency_0" in client.get("/metrics?" + LOAD_QUERY).text      # the query is ignored there
        assert seen == ["instrumentator"]
        page = MetricsPage(str(client.base_url))
        assert read_engine_load(page, client) == VLLM_LOAD
        assert seen == ["instrumentator"] and page.restricts          # the mount answered
        assert "vllm:latency" not in client.get(page.restricted_url).text


class _MultiProcess:
    """Stands in for prometheus_client's MultiProcessCollector (SGLang's ``/metrics``): a collector
    that names no series, so a registry without ``support_collectors_without_names`` leaves it out
    of a restricted page."""

    def collect(self) -> Iterator[Metric]:
        for name, value in (("sglang:num_running_reqs", 2.0), ("sglang:num_queue_reqs", 7.0),
                            ("sglang:token_usage", 0.25)):
            g = GaugeMetricFamily(name, name, labels=["tp_rank"])
            g.add_metric(["0"], value)
            yield g


def test_an_engine_that_cannot_restrict_its_page_is_read_whole() -> None:
    registry = CollectorRegistry()                 # as SGLang builds it
    registry.register(_MultiProcess())
    server = PrometheusServer(registry)
    try:
        page = MetricsPage(server.url)
        assert "sglang" not in httpx.get(page.restricted_url).text      # the filter drops everything
        server.queries.clear()
        with httpx.Client(timeout=2) as client:
            first = read_engine_load(page, client)
            assert first == EngineLoad(running=2, waiting=7, kv_usage=0.25)
            assert not page.restricts
            assert read_engine_load(page, client) == first
        assert server.queries == [LOAD_QUERY, "", ""]       # one restricted try, then whole pages only
    finally:
        server.close()


def test_an_engine_without_load_gauges_keeps_being_asked_restricted_first() -> None:
    """No load in either page (an engine still starting, or no engine): nothing is concluded."""
    r = CollectorRegistry(auto_describe=True)
    Gauge("other", "other", registry=r).set(1)
    server = PrometheusServer(r)
    try:
        page = MetricsPage(server.url)
        with httpx.Client(timeout=2) as client:
            assert read_engine_load(page, client) is None
        assert page.restricts and server.queries == [LOAD_QUERY, ""]
    finally:
        server.close()
