"""`pof router`'s Prometheus series (``/metrics``), registered per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pof_connector.router.backend import Backend
from pof_connector.router.inline_gate import InlineGate
from pof_connector.router.router import Router
from pof_connector.router.stage_clock import BUCKETS, STAGES, StageClock


class ProxyMetrics:
    def __init__(self, router: Router, gate: InlineGate) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(router.index_health)
        self.registry.register(_ChoicesRan(gate))
        self.requests = Counter("pof_router_requests", "Requests routed", ["backend", "reason"],
                                registry=self.registry)
        self.errors = Counter("pof_router_backend_errors", "Requests a backend failed", ["backend"],
                              registry=self.registry)
        self.abandoned = Counter("pof_router_abandoned", "Requests whose client left before the answer began "
                                 "(the backend connection was closed, so the engine aborts them)", ["backend"],
                                 registry=self.registry)
        self.ttft = Histogram("pof_router_ttft_seconds", "Time to first streamed chunk", ["backend"],
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8))
        healthy = Gauge("pof_router_backend_healthy", "1 when the backend is in service", ["backend"],
                        registry=self.registry)
        for b in router.backends:
            healthy.labels(b.name).set_function(_healthy_of(b))
        learnt = Gauge("pof_router_cost", "The cost model's learnt coefficients", ["coefficient"],
                       registry=self.registry)
        learnt.labels("overhead_s").set_function(lambda: router.cost.overhead_s)
        learnt.labels("prefill_s_per_token").set_function(lambda: router.cost.s_per_token)
        learnt.labels("s_per_decoding_request").set_function(lambda: router.cost.s_per_decoding)
        learnt.labels("fetch_factor").set_function(lambda: router.cost.fetch_factor)
        learnt.labels("estimate_error_s").set_function(lambda: router.cost.error_s)
        self.routes = Counter("pof_router_routes", "Requests routed by policy pof, by why that node "
                              "(x-pof-route-reason)", ["backend", "route_reason"], registry=self.registry)
        self.overhead = Histogram("pof_router_overhead_seconds", "Time the router spent on a request before "
                                  "sending it on (body, tokenizing, index lookup, choice)", registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        stage = Histogram("pof_router_stage_seconds", "The router's own time on a request by stage: parse (body, "
                          "JSON), tokenize, lookup (the locality index), choose (cost and admission), proxy (until "
                          "the request is written to the backend)", ["stage"], registry=self.registry,
                          buckets=BUCKETS)
        self._stages = [(name, stage.labels(name)) for name in STAGES]
        self.tokens_from = Counter("pof_router_prompt_tokens_from", "Where routed prompts' token ids came "
                                   "from", ["source"], registry=self.registry)
        engine = Gauge("pof_router_engine", "Each backend's last /metrics reading: kv_usage (0..1), "
                       "kv_capacity_tokens, waiting, running, preemptions; NaN when unknown",
                       ["backend", "quantity"], registry=self.registry)
        saturated = Gauge("pof_router_backend_preempting", "1 when the backend's preemption counter grew "
                          "between its last two readings", ["backend"], registry=self.registry)
        for b in router.backends:
            for q in ("kv_usage", "kv_capacity_tokens", "waiting", "running", "preemptions"):
                engine.labels(b.name, q).set_function(_engine_value(b, q))
            saturated.labels(b.name).set_function(_preempting_of(b))

    def observe_stages(self, clock: StageClock) -> None:
        """One routed request's total overhead and its stages."""
        self.overhead.observe(clock.total)
        seconds = clock.seconds
        for name, child in self._stages:
            child.observe(seconds[name])


class _ChoicesRan(Collector):
    """``pof_router_choices_total{ran}``: routing choices run on the event loop (``inline``) and on
    a thread (``thread``, after a slow one: :mod:`~pof_connector.router.inline_gate`)."""

    def __init__(self, gate: InlineGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("pof_router_choices", "Routing choices by where they ran: inline (the event "
                                     "loop) or thread (after a slow index answer)", labels=["ran"])
        for where, n in self.gate.ran.items():
            family.add_metric([where], n)
        yield family


def _healthy_of(b: Backend) -> Callable[[], float]:
    return lambda: float(b.healthy)


def _preempting_of(b: Backend) -> Callable[[], float]:
    return lambda: float(b.preempting)


def _engine_value(b: Backend, quantity: str) -> Callable[[], float]:
    def value() -> float:
        load = b.engine_load
        v = getattr(load, quantity) if load is not None else None
        return float("nan") if v is None else float(v)
    return value

