"""The router's observers: request latencies and token counts, and one span per request.

`RouterCore` builds a `RequestObservation` per request only when metrics or tracing are on
(`--metrics-port`, `--otlp-endpoint`); otherwise none exists and no hook runs. Times are
what the client sees: from the start of `RouterCore.generate` (after validation and
tokenization) to each output the router streams.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.metrics import RouterMetrics
    from services.common.telemetry import Tracing
    from services.router.output import OutputDelta

logger = logging.getLogger(__name__)


class RequestObservation:
    """One request's timings and span."""

    def __init__(
        self,
        metrics: RouterMetrics | None,
        tracing: Tracing | None,
        request_id: str,
        num_prompt_tokens: int,
    ):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._start = self._last = time.monotonic()
        self._has_output = False
        self._span = None
        self.metadata: tuple[tuple[str, str], ...] | None = None
        """gRPC metadata for Submit: the W3C traceparent of this request's span."""
        if tracing is not None:
            self._span = tracing.start_span(
                "conveyor.router.generate",
                attributes={
                    "conveyor.request_id": request_id,
                    "conveyor.num_prompt_tokens": num_prompt_tokens,
                },
            )
            self.metadata = (("traceparent", tracing.traceparent(self._span)),)

    def on_output(self, out: OutputDelta) -> None:
        """An output is about to be streamed to the client."""
        now = time.monotonic()
        num_tokens = len(out.token_ids)
        self.num_output_tokens += num_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if not num_tokens:
            return
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(num_tokens)
            if self._has_output:
                m.itl.observe(now - self._last)
            else:
                m.ttft.observe(now - self._start)
        if not self._has_output and self._span is not None:
            self._span.add_event("first_token")
        self._has_output = True
        self._last = now

    def end(self, finish_reason: str | None) -> None:
        """The request is over: `finish_reason` as the client saw it, or None when it failed
        before finishing (queue full, pipeline down): then it is not counted as finished."""
        reason = finish_reason or self.finish_reason
        m = self.metrics
        if m is not None and reason is not None:
            m.e2e.observe(time.monotonic() - self._start)
            m.prompt_tokens.inc(self.num_prompt_tokens)
            m.success[reason].inc()
        if self._span is not None:
            self._span.set_attribute("conveyor.finish_reason", reason or "failed")
            self._span.set_attribute("conveyor.num_output_tokens", self.num_output_tokens)
            self._span.end()
