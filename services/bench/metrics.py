"""Per-request timings and the benchmark summary (vLLM's `bench serve` definitions).

    TTFT  time to first token: send -> first streamed token
    ITL   inter-token latency: gap between streamed tokens; a message carrying k tokens
          counts as k tokens each 1/k of the gap after the previous message
    TPOT  time per output token, per request: (E2EL - TTFT) / (output tokens - 1)
    E2EL  end-to-end latency: send -> last message

Throughputs divide by the benchmark's wall time (first send -> last response).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

PERCENTILES = (50, 99)


@dataclass(slots=True)
class RequestOutput:
    """What one request lived, in seconds relative to its own send time."""

    prompt_len: int
    output_len: int = 0
    """Tokens received."""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    success: bool = False
    error: str = ""
    cached_tokens: int = 0
    sent_at: float = 0.0
    """`time.perf_counter()` of the send: the moment its times count from."""

    def count_from(self, moment: float) -> None:
        """Counts this request's times from `moment` instead of its send, when that is
        later (a held burst's release: the request waited in a paused scheduler's queue
        from its send until then, by the benchmark's design, not the server's doing)."""
        shift = moment - self.sent_at
        if shift <= 0:
            return
        self.sent_at = moment
        if self.ttft_s is not None:
            self.ttft_s = max(0.0, self.ttft_s - shift)
            self.latency_s = max(self.ttft_s, self.latency_s - shift)

    def add_tokens(self, elapsed_s: float, num_tokens: int) -> None:
        """Records `num_tokens` tokens that arrived `elapsed_s` after the send."""
        if num_tokens <= 0:
            return
        if self.ttft_s is None:
            self.ttft_s = elapsed_s
            previous, num_gaps = elapsed_s, num_tokens - 1
        else:
            previous, num_gaps = self.latency_s, num_tokens
        if num_gaps:
            gap = (elapsed_s - previous) / num_gaps
            self.itl_s.extend([gap] * num_gaps)
        self.output_len += num_tokens
        self.latency_s = elapsed_s

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)


def _stats_ms(name: str, values_s: list[float]) -> dict[str, float]:
    """mean / median / p99 of `values_s`, in ms, under vLLM's key names; 0 when empty."""
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values.size == 0:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"p99_{name}_ms": float(np.percentile(values, 99)),
    }


def summarize(outputs: list[RequestOutput], duration_s: float) -> dict[str, float | int]:
    """The benchmark result (flat, JSON-ready) of every request's outputs."""
    done = [o for o in outputs if o.success]
    num_in = sum(o.prompt_len for o in done)
    num_out = sum(o.output_len for o in done)
    duration_s = max(duration_s, 1e-9)
    result: dict[str, float | int] = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
    }
    result |= _stats_ms("ttft", [o.ttft_s for o in done if o.ttft_s is not None])
    result |= _stats_ms("tpot", [o.tpot_s for o in done if o.tpot_s is not None])
    result |= _stats_ms("itl", [gap for o in done for gap in o.itl_s])
    result |= _stats_ms("e2el", [o.latency_s for o in done])
    return result
