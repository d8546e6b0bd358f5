"""Prometheus metrics of every service: names, units, buckets, and the HTTP endpoint.

Names keep vLLM's meanings under the `conveyor:` prefix; times are in seconds; prometheus
appends `_total` to counters and `_bucket` / `_sum` / `_count` to histograms. Who owns what:

    router     time_to_first_token_seconds, inter_token_latency_seconds,
               e2e_request_latency_seconds, prompt_tokens, generation_tokens,
               request_success{finished_reason},
               http_requests{endpoint, status}                     (what the client sees)
    scheduler  request_queue_time_seconds, num_requests_running / _waiting,
               num_preemptions, kv_cache_usage_perc, prefix_cache_queries / _hits,
               redis_round_trip_seconds, scheduler_steps           (queue, KV, Redis)
    worker     stage_step_seconds, stage_wait_seconds, stage_batch_size,
               stage_batch_tokens, pipeline_bubble_fraction        (all with a `stage` label)

Each process builds its own `CollectorRegistry` (nothing is registered at import) and only
when `--metrics-port` is given; without it no metric object exists and the services skip
every hook. Gauges that mirror state (queue sizes, KV usage, bubble) are read at scrape time
by a collector, so they cost nothing per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)

# 1 ms .. ~10 min: request latencies (TTFT, e2e, queue time, inter-token).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
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
    320.0,
    640.0,
)
# 50 us .. 10 s: one step of one stage, one Redis round trip.
STEP_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class MetricsServer:
    """The HTTP endpoint serving one registry in Prometheus text format."""

    registry: CollectorRegistry
    port: int
    _server: object = None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serves `registry` on http://host:port/metrics (a daemon thread of prometheus-client).
    Raises ConfigError when the port is out of range or taken."""
    if not 0 < port < 65536:
        raise ConfigError(f"--metrics-port={port} is out of range: must be in [1, 65535]")
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port={port}: cannot listen ({exc.strerror}); pick a free port"
        ) from exc
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return MetricsServer(registry, port, server)


class RouterMetrics:
    """Latencies and token counts as the client sees them."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.ttft = Histogram(
            "conveyor:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "conveyor:inter_token_latency_seconds",
            "Time between two outputs of one request (one observation per streamed delta).",
            labels,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "conveyor:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "conveyor:prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "conveyor:generation_tokens",
            "Output tokens streamed to clients.",
            labels,
            registry=registry,
        ).labels(model_name)
        success = Counter(
            "conveyor:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.http_requests = Counter(
            "conveyor:http_requests",
            "Requests of the OpenAI-compatible HTTP API, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=registry,
        )


class SchedulerMetrics:
    """Histograms the scheduler observes; its gauges come from `SchedulerCollector`."""

    def __init__(self, registry: CollectorRegistry):
        self.queue_time = Histogram(
            "conveyor:request_queue_time_seconds",
            "Time from arrival to the first step that schedules the request.",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.redis_round_trip = Histogram(
            "conveyor:redis_round_trip_seconds",
            "One Redis round trip (a pipelined step write).",
            registry=registry,
            buckets=STEP_BUCKETS,
        )


@dataclass(slots=True)
class SchedulerSnapshot:
    """What `SchedulerCollector` reads at scrape time."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_inflight: int
    kv_usage: float
    num_free_blocks: int
    num_cached_blocks: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_poisoned: int = 0
    is_paused: bool = False
    weight_version: int = 0
    num_weight_updates: int = 0
    num_spec_steps: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_draft_calls: int = 0
    num_draft_failures: int = 0
    max_inflight: int = 0
    """Steps in flight at most now (async: P + the adaptive lead)."""


class SchedulerCollector(Collector):
    """Queue sizes, KV usage and prefix-cache counters, read from the scheduler per scrape."""

    def __init__(self, snapshot: Callable[[], SchedulerSnapshot | None]):
        self._snapshot = snapshot

    def collect(self) -> Iterable:
        snap = self._snapshot()
        if snap is None:  # still waiting for the workers
            return
        yield _gauge(
            "conveyor:num_requests_running", "Requests in the running set.", snap.num_running
        )
        yield _gauge(
            "conveyor:num_requests_waiting", "Requests waiting (incl. preempted).", snap.num_waiting
        )
        yield _gauge(
            "conveyor:num_steps_inflight", "Micro-batches in the pipeline.", snap.num_inflight
        )
        yield _gauge(
            "conveyor:max_steps_inflight",
            "Steps the scheduler keeps in flight at most (async: stages + the adaptive lead).",
            snap.max_inflight,
        )
        yield _gauge(
            "conveyor:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", snap.kv_usage
        )
        yield _gauge(
            "conveyor:kv_cache_free_blocks",
            "Free KV blocks (cached ones included).",
            snap.num_free_blocks,
        )
        yield _gauge(
            "conveyor:kv_cache_cached_blocks", "Blocks in the prefix cache.", snap.num_cached_blocks
        )
        yield _counter("conveyor:num_preemptions", "Preemptions (recompute).", snap.num_preemptions)
        yield _counter(
            "conveyor:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            snap.num_queried_tokens,
        )
        yield _counter(
            "conveyor:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            snap.num_hit_tokens,
        )
        yield _counter("conveyor:scheduler_steps", "Steps planned.", snap.num_steps)
        yield _counter(
            "conveyor:spec_decode_num_drafts",
            "Speculative decoding: request steps that carried proposed tokens.",
            snap.num_spec_steps,
        )
        yield _counter(
            "conveyor:spec_decode_num_draft_tokens",
            "Speculative decoding: tokens proposed.",
            snap.num_spec_draft_tokens,
        )
        yield _counter(
            "conveyor:spec_decode_num_accepted_tokens",
            "Speculative decoding: proposed tokens the model confirmed.",
            snap.num_spec_accepted_tokens,
        )
        yield _counter(
            "conveyor:spec_decode_draft_calls",
            "Speculative decoding, draft model: calls the draft worker answered.",
            snap.num_draft_calls,
        )
        yield _counter(
            "conveyor:spec_decode_draft_failures",
            "Speculative decoding, draft model: calls that failed or timed out (those steps "
            "ran without proposals).",
            snap.num_draft_failures,
        )
        yield _counter(
            "conveyor:poison_requests",
            "Requests failed because a pipeline stage failed on them alone.",
            snap.num_poisoned,
        )
        yield _gauge(
            "conveyor:engine_paused",
            "1 while paused (Pause): steps stop, requests queue; health stays SERVING.",
            float(snap.is_paused),
        )
        yield _gauge(
            "conveyor:weight_version",
            "Version of the weights the stages serve.",
            snap.weight_version,
        )
        yield _counter(
            "conveyor:weight_updates",
            "Weight updates committed (UpdateWeights).",
            snap.num_weight_updates,
        )


class WorkerMetrics:
    """Per-step histograms of one stage; the bubble gauge comes from `BubbleCollector`."""

    def __init__(self, registry: CollectorRegistry, stage: int):
        label = str(stage)
        self.step_time = Histogram(
            "conveyor:stage_step_seconds",
            "Compute time of one step on one stage.",
            ["stage"],
            registry=registry,
            buckets=STEP_BUCKETS,
        ).labels(label)
        self.wait_time = Histogram(
            "conveyor:stage_wait_seconds",
            "Time a step waited for activations or tokens from another stage.",
            ["stage"],
            registry=registry,
            buckets=STEP_BUCKETS,
        ).labels(label)
        self.batch_size = Histogram(
            "conveyor:stage_batch_size",
            "Requests in one step.",
            ["stage"],
            registry=registry,
            buckets=BATCH_BUCKETS,
        ).labels(label)
        self.batch_tokens = Histogram(
            "conveyor:stage_batch_tokens",
            "Tokens computed in one step.",
            ["stage"],
            registry=registry,
            buckets=BATCH_BUCKETS,
        ).labels(label)


class BubbleCollector(Collector):
    """`conveyor:pipeline_bubble_fraction{stage}`: idle / wall of a stage's recorded steps, and
    `conveyor:pipeline_plan_wait_fraction{stage}`: the part of it spent waiting for plans.

    `fractions` returns (bubble, plan wait), or None before there is a timeline."""

    def __init__(self, stage: int, fractions: Callable[[], tuple[float, float] | None]):
        self._stage = str(stage)
        self._fractions = fractions

    def collect(self) -> Iterable:
        values = self._fractions()
        if values is None:
            return
        bubble, plan_wait = values
        family = GaugeMetricFamily(
            "conveyor:pipeline_bubble_fraction",
            "Idle fraction of the stage's wall time over its recorded steps (0-1).",
            labels=["stage"],
        )
        family.add_metric([self._stage], bubble)
        yield family
        family = GaugeMetricFamily(
            "conveyor:pipeline_plan_wait_fraction",
            "Of the stage's wall time, the fraction it waited for the next plan to arrive "
            "(0-1, a part of the bubble): at stage 0 in async mode, the control plane late.",
            labels=["stage"],
        )
        family.add_metric([self._stage], plan_wait)
        yield family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
