"""The pipeline timeline as a Chrome / Perfetto trace: one track per stage, one slice per step.

Open the file in https://ui.perfetto.dev or chrome://tracing. Gaps between slices on a track
are that stage's idle time: the pipeline bubble.
"""

from __future__ import annotations

import json
from pathlib import Path


def chrome_trace_events(timelines) -> list[dict]:
    """timelines: worker_pb2.Timeline per stage (with steps)."""
    events: list[dict] = []
    t0 = min((s.start_ns for t in timelines for s in t.steps), default=0)
    for timeline in timelines:
        tid = timeline.stage
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": tid,
                "args": {"name": f"stage {tid}"},
            }
        )
        for step in timeline.steps:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": tid,
                    "name": f"step {step.step_id}",
                    "ts": (step.start_ns - t0) / 1000.0,
                    "dur": (step.end_ns - step.start_ns) / 1000.0,
                    "args": {
                        "requests": step.num_requests,
                        "tokens": step.num_tokens,
                        "wait_ms": step.wait_ns / 1e6,
                        "collective_ms": step.collective_ns / 1e6,
                        "plan_wait_ms": step.plan_wait_ns / 1e6,
                    },
                }
            )
    return events


def write_chrome_trace(timelines, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"traceEvents": chrome_trace_events(timelines)}))
