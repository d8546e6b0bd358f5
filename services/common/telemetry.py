"""OpenTelemetry tracing for every service, built only when `--otlp-endpoint` is given.

A request's trace crosses three processes:

    router    conveyor.router.generate            (one span per Generate / ModelInfer)
      │ W3C `traceparent` in the Submit call's gRPC metadata
    scheduler conveyor.scheduler.request          (submit .. finish; one event per step)
      ├─ conveyor.scheduler.queue                 (submit .. first scheduled step)
      │ `StepPlan.trace_parent`: the request span of one traced request in the step
    worker    conveyor.worker.step                (one span per stage per step, all request
                                                   ids of the step as an attribute)

Endpoints: `http://HOST:PORT` or `grpc://HOST:PORT` export OTLP over gRPC (batched, in the
background); `file:///PATH` appends every finished span to PATH as one JSON line (written
at once; handy for tests and for a quick look without a collector).

Each process has its own `TracerProvider` (the global one is never set). Without the flag
the services hold `None` instead of a `Tracing` and create no span objects at all.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)

_SCHEMES = ("http", "https", "grpc", "file")


def check_endpoint(url: str) -> str:
    """`url` if its scheme is one we export to; ConfigError naming the choices otherwise."""
    parsed = urlparse(url)
    if parsed.scheme not in _SCHEMES or not (parsed.netloc or parsed.path):
        raise ConfigError(
            f"--otlp-endpoint={url!r} is not understood: use http://HOST:PORT or "
            "grpc://HOST:PORT (OTLP/gRPC) or file:///PATH (JSON lines)"
        )
    return url


@dataclass(slots=True)
class Tracing:
    """One process's tracer; `start_span` accepts a W3C traceparent as the parent."""

    tracer: object
    provider: object

    def start_span(
        self,
        name: str,
        traceparent: str | None = None,
        start_time: int | None = None,
        attributes: dict | None = None,
    ):
        """A started span, child of the span `traceparent` names (a root when None)."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = None
        if traceparent:
            context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        return self.tracer.start_span(
            name, context=context, start_time=start_time, attributes=attributes
        )

    @staticmethod
    def traceparent(span) -> str:
        """The W3C traceparent header value naming `span` as a parent."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def shutdown(self) -> None:
        """Flushes spans still queued for export."""
        self.provider.shutdown()


def make_tracing(endpoint: str | None, service_name: str, **attributes) -> Tracing | None:
    """A `Tracing` exporting to `endpoint`, or None (tracing off) when it is None or empty."""
    if not endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    check_endpoint(endpoint)
    resource = Resource.create({"service.name": service_name, **attributes})
    provider = TracerProvider(resource=resource)
    parsed = urlparse(endpoint)
    if parsed.scheme == "file":
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(parsed.path)))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = parsed.scheme != "https"
        exporter = OTLPSpanExporter(endpoint=parsed.netloc, insecure=insecure)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.info("tracing %s to %s", service_name, endpoint)
    return Tracing(provider.get_tracer(f"conveyor.{service_name}"), provider)


class JsonLinesSpanExporter:
    """Appends finished spans to a file, one JSON object a line (one `write` each, so
    several processes may share the file)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            os.write(self._fd, (json.dumps(span_to_dict(span)) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span) -> dict:
    """A finished SDK span as plain JSON: ids in hex, times in ns since the epoch."""
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes)}
            for e in span.events
        ],
    }
