"""A stage's observers: per-step metrics and per-step spans.

The servicer holds one `StepObserver`, or None when `--metrics-port` and `--otlp-endpoint`
are both off (then no hook runs). It is called twice per step:

    on_plan(msg)          event loop, as the plan arrives: remembers the step's
                          `trace_parent` and request ids (only when tracing)
    on_outcome(outcome)   compute thread, when the stage finished the step: observes the
                          step's histograms and records a `conveyor.worker.step` span with the
                          step's own start and end times, child of the plan's trace_parent

Steps whose plan carries no trace_parent (no traced request in them) get no span.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.metrics import WorkerMetrics
    from services.common.telemetry import Tracing
    from services.worker.engine import StepOutcome, Timeline

logger = logging.getLogger(__name__)


class StepObserver:
    """Metrics and spans of one stage's steps."""

    def __init__(
        self, stage: int, metrics: WorkerMetrics | None = None, tracing: Tracing | None = None
    ):
        self.stage = stage
        self.metrics = metrics
        self.tracing = tracing
        self._traced: dict[int, tuple[str, list[str]]] = {}  # step id -> (parent, request ids)

    def on_plan(self, msg) -> None:
        """A StepPlan message arrived (before the engine sees it)."""
        if self.tracing is not None and msg.trace_parent:
            ids = [r.request_id for r in msg.new_requests]
            ids.extend(r.request_id for r in msg.cached_requests)
            ids.extend(msg.decode_request_ids)
            self._traced[msg.step_id] = (msg.trace_parent, ids)

    def reset(self) -> None:
        """The session ended: plans that never ran get no span."""
        self._traced.clear()

    def on_outcome(self, outcome: StepOutcome) -> None:
        record = outcome.record
        traced = self._traced.pop(outcome.step_id, None)
        if record is None or not record.num_requests:
            return
        if self.metrics is not None:
            m = self.metrics
            m.step_time.observe((record.end_ns - record.start_ns) / 1e9)
            m.wait_time.observe(record.wait_ns / 1e9)
            m.batch_size.observe(record.num_requests)
            m.batch_tokens.observe(record.num_tokens)
        if traced is not None:
            parent, request_ids = traced
            span = self.tracing.start_span(
                "conveyor.worker.step",
                parent,
                start_time=record.start_ns,
                attributes={
                    "conveyor.stage": self.stage,
                    "conveyor.step_id": outcome.step_id,
                    "conveyor.request_ids": request_ids,
                    "conveyor.num_tokens": record.num_tokens,
                    "conveyor.wait_ns": record.wait_ns,
                },
            )
            span.end(end_time=record.end_ns)


def bubble_of(
    timeline: Callable[[], Timeline | None],
) -> Callable[[], tuple[float, float] | None]:
    """The bubble and plan-wait fractions of the stage's timeline, read at scrape time (None
    before the model is loaded or before two steps were recorded)."""

    def read() -> float | None:
        current = timeline()
        if current is None or len(current.records) < 2:
            return None
        for _ in range(3):  # the compute thread may append while we copy
            try:
                _, bubble, plan_wait = current.fractions()
                return bubble, plan_wait
            except RuntimeError:
                continue
        return None

    return read


class QuantizationCollector:
    """`conveyor:stage_quantized_linears{stage,quantization}` and
    `conveyor:stage_quantized_weight_bytes{stage,quantization}`: what the stage's weights
    are stored as (absent before the model is loaded and when nothing is quantized)."""

    def __init__(self, stage: int, servicer) -> None:
        self._stage, self._servicer = str(stage), servicer

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        engine = self._servicer.engine
        summary = engine.runner.model.quantization if engine is not None else None
        if summary is None:
            return
        labels = [self._stage, summary.method]
        for name, doc, value in (
            ("linears", "Linear layers of the stage with quantized weights.", summary.num_linears),
            ("weight_bytes", "Bytes of the quantized weights and scales.", summary.weight_bytes),
        ):
            family = GaugeMetricFamily(
                f"conveyor:stage_quantized_{name}", doc, labels=["stage", "quantization"]
            )
            family.add_metric(labels, value)
            yield family


def install(servicer, stage: int, metrics_port: int | None, otlp_endpoint: str | None):
    """Sets `servicer.observer` as the flags ask; returns a function that stops it all."""
    from services.common.telemetry import make_tracing

    tracing = make_tracing(otlp_endpoint, "conveyor-worker", **{"conveyor.stage": stage})
    metrics = server = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from services.common.metrics import BubbleCollector, WorkerMetrics, serve_metrics

        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, stage)
        timeline = lambda: servicer.engine.timeline if servicer.engine else None  # noqa: E731
        registry.register(BubbleCollector(stage, bubble_of(timeline)))
        registry.register(QuantizationCollector(stage, servicer))
        server = serve_metrics(registry, metrics_port)
    if metrics is not None or tracing is not None:
        servicer.observer = StepObserver(stage, metrics, tracing)

    def close() -> None:
        if server is not None:
            server.close()
        if tracing is not None:
            tracing.shutdown()

    return close
