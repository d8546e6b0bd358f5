"""Each stage's busy and idle time over a slice of a run, drawn from the Chrome trace.

One row per stage: a bar per step (colour by step id modulo the number of stages, so the
micro-batches of a pipeline can be told apart), grey where the stage waited. The slice is
taken from the middle of the run (steady state), wide enough for ~`num_steps` steps.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

logger = logging.getLogger(__name__)

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def stage_slices(trace: dict) -> dict[int, list[tuple[float, float, int]]]:
    """{stage: [(start_ms, duration_ms, step_id), ...]} of a Chrome trace's step slices."""
    stages: dict[int, list[tuple[float, float, int]]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        step_id = int(str(event.get("name", "step 0")).split()[-1])
        stages.setdefault(event["tid"], []).append((event["ts"] / 1e3, event["dur"] / 1e3, step_id))
    for slices in stages.values():
        slices.sort()
    return dict(sorted(stages.items()))


def steady_window(
    stages: dict[int, list[tuple[float, float, int]]], num_steps: int = 24
) -> tuple[float, float]:
    """(start_ms, end_ms): about `num_steps` median steps around the middle of the run."""
    all_slices = [s for slices in stages.values() for s in slices]
    start = min(s[0] for s in all_slices)
    end = max(s[0] + s[1] for s in all_slices)
    width = min(end - start, num_steps * statistics.median(s[1] for s in all_slices))
    middle = (start + end) / 2
    return max(start, middle - width / 2), min(end, middle + width / 2)


def busy_fraction(slices: list[tuple[float, float, int]], window: tuple[float, float]) -> float:
    """Share of `window` covered by `slices` (clipped to it)."""
    lo, hi = window
    busy = sum(max(0.0, min(hi, s + d) - max(lo, s)) for s, d, _ in slices)
    return busy / (hi - lo) if hi > lo else 0.0


def plot_trace(
    trace_path: str | Path, png_path: str | Path, title: str = "", num_steps: int = 24
) -> Path | None:
    """Writes the PNG; None (logged) when the trace has no steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = stage_slices(json.loads(Path(trace_path).read_text()))
    if not stages:
        logger.warning("%s has no steps to draw", trace_path)
        return None
    lo, hi = steady_window(stages, num_steps)
    num_stages = len(stages)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * num_stages))
    for row, slices in enumerate(stages.values()):
        y = (num_stages - 1 - row) * 10
        ax.broken_barh([(lo, hi - lo)], (y, 8), facecolors="#e8e8e8")  # idle background
        shown = [(s, d, i) for s, d, i in slices if s + d > lo and s < hi]
        ax.broken_barh(
            [(s, d) for s, d, _ in shown],
            (y, 8),
            edgecolor="white",
            linewidth=0.5,
            facecolors=[_COLOURS[i % num_stages % len(_COLOURS)] for *_, i in shown],
        )
        idle = 1.0 - busy_fraction(slices, (lo, hi))
        ax.text(hi, y + 4, f"  idle {idle:.0%}", va="center", fontsize=9)
    ax.set_yticks([(num_stages - 1 - r) * 10 + 4 for r in range(num_stages)])
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("ms since the first step (colour: step id mod stages; grey: idle)")
    ax.set_title(title or Path(trace_path).stem)
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
