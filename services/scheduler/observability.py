"""The scheduler's observers: event trace (JSON lines), request spans, queue-time metric.

`SchedulerService` holds one `SchedulerObserver`, or None when `--trace-scheduler`,
`--otlp-endpoint` and `--metrics-port` are all off; then none of this runs. With one, the
service calls:

    on_submit(request, traceparent)   a request was queued (traceparent from the router)
    begin_step(step_id)               the step being planned or processed (for transitions)
    on_state(request)                 after every state change (StepOutputs hook)
    on_plan(plan) -> traceparent      a step plan is about to go out

The event trace (`--trace-scheduler FILE`, the seed's VLLM_TRACE_SCHEDULER) has two kinds
of lines, never with prompt text or token ids::

    {"event": "transition", "request_id": "r1", "from": "waiting", "to": "running",
     "step": 12, "time": 1718000000.123}
    {"event": "step", "step_id": 12, "request_ids": ["r1", "r2"], "num_tokens": [37, 1],
     "num_new": 1, "num_cached": 1, "num_finished": 0, "time": 1718000000.123}

`from` is null for a request first seen (submitted, or recovered from Redis after a restart).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from services.common.step import StepPlan
from services.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.common.metrics import SchedulerMetrics, SchedulerSnapshot
    from services.common.telemetry import Tracing
    from services.scheduler.service import SchedulerService

logger = logging.getLogger(__name__)


class EventTrace:
    """Appends one JSON line per request transition and per step plan to a file."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - long-lived

    def transition(self, request_id: str, old: str | None, new: str, step: int | None) -> None:
        self._write(
            {
                "event": "transition",
                "request_id": request_id,
                "from": old,
                "to": new,
                "step": step,
                "time": time.time(),
            }
        )

    def plan(self, plan: StepPlan) -> None:
        entries = (*plan.new_requests, *plan.cached_requests)
        self._write(
            {
                "event": "step",
                "step_id": plan.step_id,
                "request_ids": [r.request_id for r in entries],
                "num_tokens": [r.num_scheduled_tokens for r in entries],
                "num_new": len(plan.new_requests),
                "num_cached": len(plan.cached_requests),
                "num_finished": len(plan.finished_request_ids),
                "time": time.time(),
            }
        )

    def close(self) -> None:
        self._file.close()

    def _write(self, entry: dict) -> None:
        self._file.write(json.dumps(entry) + "\n")


class RequestSpans:
    """One span per request (submit .. finish) with a child span for its queue wait."""

    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self._spans: dict[str, tuple] = {}  # request id -> (span, queue span | None, traceparent)

    def start(self, request: Request, traceparent: str | None) -> None:
        span = self.tracing.start_span(
            "conveyor.scheduler.request",
            traceparent,
            attributes={
                "conveyor.request_id": request.request_id,
                "conveyor.num_prompt_tokens": request.num_prompt_tokens,
            },
        )
        own = self.tracing.traceparent(span)
        queue = self.tracing.start_span("conveyor.scheduler.queue", own)
        self._spans[request.request_id] = (span, queue, own)

    def on_plan(self, plan: StepPlan) -> str:
        """Adds a `step` event to every traced request of the plan; returns the traceparent
        of the first one (the parent of the workers' step spans), or ''."""
        parent = ""
        for entry in (*plan.new_requests, *plan.cached_requests):
            spans = self._spans.get(entry.request_id)
            if spans is None:
                continue
            span, queue, own = spans
            if queue is not None:
                queue.end()
                self._spans[entry.request_id] = (span, None, own)
            span.add_event(
                "step",
                {
                    "conveyor.step_id": plan.step_id,
                    "conveyor.num_tokens": entry.num_scheduled_tokens,
                },
            )
            parent = parent or own
        return parent

    def on_state(self, request: Request) -> None:
        spans = self._spans.get(request.request_id)
        if spans is None:
            return
        span, queue, _ = spans
        status = request.status
        if status is RequestStatus.PREEMPTED:
            span.add_event("preempted")
        elif status.is_finished:
            del self._spans[request.request_id]
            if queue is not None:
                queue.end()
            span.set_attribute("conveyor.finish_reason", status.finish_reason)
            span.set_attribute("conveyor.num_output_tokens", request.num_output_tokens)
            span.end()

    def end_all(self) -> None:
        for span, queue, _ in self._spans.values():
            if queue is not None:
                queue.end()
            span.end()
        self._spans.clear()


class SchedulerObserver:
    """Fans the service's hooks out to whichever of trace / spans / metrics are on."""

    def __init__(
        self,
        events: EventTrace | None = None,
        spans: RequestSpans | None = None,
        metrics: SchedulerMetrics | None = None,
    ):
        self.events, self.spans, self.metrics = events, spans, metrics
        self.step: int | None = None
        self._status: dict[str, str] = {}  # last state seen per unfinished request

    def on_submit(self, request: Request, traceparent: str | None) -> None:
        if self.spans is not None:
            self.spans.start(request, traceparent)
        self.on_state(request)

    def begin_step(self, step_id: int) -> None:
        self.step = step_id

    def on_state(self, request: Request) -> None:
        new = request.status.value
        old = self._status.get(request.request_id)
        if old == new:
            return
        if request.status.is_finished:
            self._status.pop(request.request_id, None)
        else:
            self._status[request.request_id] = new
        if self.events is not None:
            self.events.transition(request.request_id, old, new, self.step)
        if self.spans is not None:
            self.spans.on_state(request)
        if (
            self.metrics is not None
            and request.status is RequestStatus.RUNNING
            and old in (None, "waiting")
            and request.num_preemptions == 0
        ):
            self.metrics.queue_time.observe(max(0.0, time.time() - request.arrival_time))

    def on_plan(self, plan: StepPlan) -> str:
        if self.events is not None:
            self.events.plan(plan)
        return self.spans.on_plan(plan) if self.spans is not None else ""

    def close(self) -> None:
        if self.spans is not None:
            self.spans.end_all()
        if self.events is not None:
            self.events.close()


def snapshot(service: SchedulerService) -> SchedulerSnapshot | None:
    """What the metrics collector exposes, read from the live service (scrape thread)."""
    from services.common.metrics import SchedulerSnapshot

    core = service.scheduler
    if core is None:
        return None
    bm = core.block_manager
    for _ in range(3):  # the event loop may resize a dict under us: read again
        try:
            stats = bm.stats()
            break
        except RuntimeError:
            continue
    else:
        return None
    return SchedulerSnapshot(
        num_running=len(core.running),
        num_waiting=core.num_waiting,
        num_preemptions=core.num_preemptions,
        num_steps=service.counters.num_steps,
        num_inflight=service.inflight,
        max_inflight=service.max_inflight,
        kv_usage=stats.usage,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_queried_tokens=bm.num_queried_tokens,
        num_hit_tokens=bm.num_hit_tokens,
        num_poisoned=core.num_poisoned,
        is_paused=service.pause_mode is not None,
        weight_version=service.weight_version,
        num_weight_updates=service.num_weight_updates,
        num_spec_steps=core.spec_stats.num_steps,
        num_spec_draft_tokens=core.spec_stats.num_draft_tokens,
        num_spec_accepted_tokens=core.spec_stats.num_accepted_tokens,
        num_draft_calls=service.drafts.counters.num_calls if service.drafts else 0,
        num_draft_failures=service.drafts.counters.num_failures if service.drafts else 0,
    )


def install(
    service: SchedulerService,
    store,
    metrics_port: int | None,
    otlp_endpoint: str | None,
    trace_path: str | None,
):
    """Builds what the flags ask for and hooks it into `service` and `store`; returns a
    function that stops it all (flushes spans, closes the metrics endpoint). With every
    flag off it installs nothing and `service.observer` stays None."""
    from services.common.telemetry import make_tracing

    tracing = make_tracing(otlp_endpoint, "conveyor-scheduler")
    metrics = server = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from services.common.metrics import SchedulerCollector, SchedulerMetrics, serve_metrics

        registry = CollectorRegistry()
        metrics = SchedulerMetrics(registry)
        registry.register(SchedulerCollector(lambda: snapshot(service)))
        store.on_round_trip = metrics.redis_round_trip.observe
        server = serve_metrics(registry, metrics_port)
    events = EventTrace(trace_path) if trace_path else None
    if tracing or metrics or events:
        service.observer = SchedulerObserver(
            events, RequestSpans(tracing) if tracing else None, metrics
        )

    def close() -> None:
        if server is not None:
            server.close()
        if tracing is not None:
            tracing.shutdown()

    return close
