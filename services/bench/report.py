"""Result tables, in the layout of `vllm bench serve`."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_WIDTH = 50

# (label, key, format) of the single-run table; None keys are section headers.
_ROWS = [
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Burst held, released at once", "released_at_once", "{}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Time to First Token", None, None),
    ("Mean TTFT (ms)", "mean_ttft_ms", "{:.2f}"),
    ("Median TTFT (ms)", "median_ttft_ms", "{:.2f}"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "{:.2f}"),
    ("Time per Output Token (excl. 1st token)", None, None),
    ("Mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("Median TPOT (ms)", "median_tpot_ms", "{:.2f}"),
    ("P99 TPOT (ms)", "p99_tpot_ms", "{:.2f}"),
    ("Inter-token Latency", None, None),
    ("Mean ITL (ms)", "mean_itl_ms", "{:.2f}"),
    ("Median ITL (ms)", "median_itl_ms", "{:.2f}"),
    ("P99 ITL (ms)", "p99_itl_ms", "{:.2f}"),
    ("Mean E2EL (ms)", "mean_e2el_ms", "{:.2f}"),
    ("Pipeline (scheduler)", None, None),
    ("Bubble fraction per stage", "bubble_fraction", "{}"),
    ("Of it, waiting for plans", "plan_wait_fraction", "{}"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate", "{:.3f}"),
    ("Preemptions", "preemptions", "{:d}"),
    ("Plans per second", "plans_per_s", "{:.1f}"),
    ("Scheduler CPU per plan (us)", "scheduler_cpu_per_plan_us", "{:.0f}"),
    ("Scheduler CPU per output token (us)", "scheduler_cpu_per_token_us", "{:.1f}"),
]


def result_table(result: dict, title: str = "Serving Benchmark Result") -> str:
    """The run's metrics as a fixed-width table (scheduler rows only when present)."""
    lines = [f" {title} ".center(_WIDTH, "=")]
    for label, key, fmt in _ROWS:
        if key is None:
            lines.append(f" {label} ".center(_WIDTH, "-"))
        elif key in result:
            value = result[key]
            if key in ("bubble_fraction", "plan_wait_fraction"):
                value = ", ".join(f"{b:.1%}" for b in value) or "n/a"
            elif key == "released_at_once":
                value = "yes" if value else "no"
            lines.append(f"{label + ':':<40}{fmt.format(value):>10}")
    if lines[-1].strip("- ").startswith("Pipeline"):
        lines.pop()
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def grid(header: list[str], rows: list[list[str]]) -> str:
    """A plain text grid, each column as wide as its widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*header), sep, *(fmt.format(*map(str, r)) for r in rows)])
