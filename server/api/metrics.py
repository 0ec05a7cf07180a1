"""Prometheus metrics, one `CollectorRegistry` per app (tests build several apps in one process).

Request counts come from `MetricsMiddleware` (every route, every status, including 404s and auth failures);
token counts and latencies come from the engine's `Finish` events, the inter-token gaps from the arrival of
`Delta` events on the event loop. Queue depth, running, the slots, the KV in use and the prefixes kept for reuse, and
the graph calls by batch size are read from the engine at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.given import EngineAPI
from server.engine.types import Finish, KVUsage

PREFIX = "gemma4"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, engine: EngineAPI) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=r)

        self.requests = counter("http_requests", "HTTP requests by route and status", "route", "status")
        self.errors = counter("errors", "Errors by status code (HTTP and in-band stream errors)", "status")
        self.finished = counter("requests_finished", "Generation requests by finish reason", "reason")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.prefix_hit_tokens = counter("prefix_cache_hit_tokens", "Prompt tokens reused from the device KV cache")
        self.graph_calls = counter("graph_calls", "Graph (device) calls: prefill chunks and decode steps")
        self.device_seconds = counter("device_seconds", "Time inside graph calls (the device's share; the rest of a "
                                      "request's time is queueing and host work)")
        self.ttft = histogram("time_to_first_token_seconds", "Submission to first token")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Submission to finish")
        self.queue_wait = histogram("queue_wait_seconds", "Submission to start on the device")
        Gauge(f"{PREFIX}_queue_depth", "Requests waiting for the device", registry=r).set_function(
            lambda: engine.queue_depth)
        Gauge(f"{PREFIX}_requests_running", "Requests on the device, each in its own KV slot (prefilling or "
              "decoding), at most max_concurrency", registry=r).set_function(lambda: engine.running)
        Gauge(f"{PREFIX}_max_concurrency", "Requests that can run at once (KV slots the engine uses; 1 for a one-slot "
              "graph)", registry=r).set_function(lambda: engine.capacity)
        Gauge(f"{PREFIX}_slot_occupancy", "Share of those slots running a request now (requests_running / "
              "max_concurrency)", registry=r).set_function(lambda: engine.running / max(engine.capacity, 1))
        # What a prefix-aware router (an endpoint picker) reads beside the queue: how full the KV is, and how much of
        # it idle conversations keep for their next turn (server.engine.types.KVUsage; read once per gauge at scrape).
        for name, doc, read in (
            ("kv_slots_in_use", "KV slots held by a running request", lambda u: u.slots_in_use),
            ("kv_slots_in_use_ratio", "Share of the KV slots held by a running request (kv_slots_in_use / KV slots)",
             lambda u: u.slots_in_use / max(u.slots, 1)),
            ("kv_tokens_in_use", "KV positions written by running requests (prompt so far and generated tokens)",
             lambda u: u.tokens_in_use),
            ("kv_tokens_capacity", "KV positions the slots can hold (KV slots x the build's context)",
             lambda u: u.tokens_capacity),
            ("kv_tokens_in_use_ratio", "Share of the KV positions held by running requests (kv_tokens_in_use / "
             "kv_tokens_capacity)", lambda u: u.tokens_in_use / max(u.tokens_capacity, 1)),
            ("kv_cached_prefixes", "Idle KV slots keeping a conversation's prefix for reuse (until a newcomer needs "
             "the slot)", lambda u: u.cached_prefixes),
            ("kv_cached_prefix_tokens", "KV positions those idle slots keep for reuse", lambda u: u.cached_tokens),
            ("kv_blocks_in_use", "KV blocks lent from the pool (a v4 build; 0 without one): to running requests and "
             "idle slots' prefixes", lambda u: u.blocks_in_use),
            ("kv_blocks_capacity", "KV blocks the pool lends (0: KV per slot, no pool)", lambda u: u.blocks),
        ):
            Gauge(f"{PREFIX}_{name}", doc, registry=r).set_function(_reader(engine, read))
        r.register(_StepCollector(engine))

    def observe_finish(self, finish: Finish) -> None:
        self.finished.labels(finish.reason).inc()
        self.prompt_tokens.inc(finish.prompt_tokens)
        self.generation_tokens.inc(finish.completion_tokens)
        self.prefix_hit_tokens.inc(finish.reused_tokens)
        self.graph_calls.inc(finish.graph_calls)
        self.device_seconds.inc(finish.device_s)
        self.e2e.observe(finish.total_s)
        self.queue_wait.observe(finish.queue_wait_s)
        if finish.ttft_s is not None:
            self.ttft.observe(finish.ttft_s)

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()
        if status >= 400:
            self.errors.labels(str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _reader(engine: EngineAPI, read: Callable[[KVUsage], float]) -> Callable[[], float]:
    return lambda: read(engine.kv_usage)


class _StepCollector(Collector):
    """Graph calls by how many rows they ran (a decode step's batch size; a prefill chunk is a call of one row), read
    from the engine at scrape time: the batch size per step, as a histogram has it, without a hook per step."""

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(f"{PREFIX}_graph_steps", "Graph calls by the rows they ran (decode batch size; "
                                     "prefill chunks have one)", labels=["rows"])
        for rows, calls in sorted(self.engine.step_batches.items()):
            family.add_metric([str(rows)], calls)
        yield family


class MetricsMiddleware:
    """Counts every HTTP request by route (known paths only, else "other": bounded labels) and final status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Container[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers if the app raises before starting a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.observe_request(path if path in self.routes else "other", status)
