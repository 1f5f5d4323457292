"""Prometheus metrics of one server, in their own `CollectorRegistry` (vLLM's names, `metainfer:` prefix)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metainfer.engine.request import RequestOutput
from metainfer.server.async_engine import EngineSnapshot

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _SnapshotCollector(Collector):
    """Engine gauges read from the latest `EngineSnapshot` at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"metainfer:{name}", doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"metainfer:{name}", doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_blocks_used", "Paged KV-cache blocks in use.", s.kv_blocks_used)
        yield gauge("kv_blocks_total", "Paged KV-cache blocks in the pool.", s.kv_blocks_total)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1).",
            s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        )
        yield gauge("state_slots_used", "DeltaNet state slots in use.", s.state_slots_used)
        yield gauge("state_slots_total", "DeltaNet state slots in the pool.", s.state_slots_total)
        yield gauge("engine_alive", "1 while the engine thread runs.", 1.0 if s.alive else 0.0)
        yield counter("num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.num_steps)
        yield counter("engine_step_failures", "Engine steps that raised.", s.num_step_failures)
        yield counter("spec_draft_tokens", "Speculative draft tokens verified.", s.spec_drafted)
        yield counter("spec_accepted_tokens", "Speculative draft tokens accepted.", s.spec_accepted)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)


class ServerMetrics:
    """Counters and histograms fed from engine outputs, plus engine gauges; `render()` for /metrics."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.requests = Counter(
            "metainfer:requests",
            "Engine requests by outcome (finish reason or rejected).",
            labels + ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "metainfer:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "metainfer:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.ttft = Histogram(
            "metainfer:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "metainfer:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "metainfer:e2e_request_latency_seconds",
            "Arrival to finish, per request.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        for o in OUTCOMES:
            self.requests.labels(model_name, o)
        for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            m.labels(model_name)
        r.register(_SnapshotCollector(snapshot, model_name))

    def observe(self, out: RequestOutput) -> None:
        """Called on the engine thread for every output delivered to a client."""
        m = self.model_name
        if out.new_token_ids:
            self.generation_tokens.labels(m).inc(len(out.new_token_ids))
            if len(out.token_ids) == len(out.new_token_ids) and out.ttft is not None:
                self.ttft.labels(m).observe(out.ttft)
        if not out.finished:
            return
        self.requests.labels(m, out.finish_reason or "error").inc()
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        if out.e2e is not None:
            self.e2e.labels(m).observe(out.e2e)
            n = len(out.token_ids)
            if n > 1 and out.ttft is not None:
                self.tpot.labels(m).observe(max(0.0, out.e2e - out.ttft) / (n - 1))

    def rejected(self, count: int = 1) -> None:
        self.requests.labels(self.model_name, "rejected").inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
