"""`services.bench.plan_rate` against the real scheduler process: it starts, serves and plans
(its null stages must take a session as workers do, or the scheduler never serves)."""

from __future__ import annotations

import argparse

from services.bench.plan_rate import run


def test_plan_rate_measures_a_real_scheduler():
    args = argparse.Namespace(
        stages=2, num_requests=8, prompt_len=16, seconds=1.0, warmup=0.5, py_spy=None
    )
    result = run(args)
    assert result["plans_per_s"] > 0
    assert result["cpu_per_plan_ms"] > 0
    # every running request decodes in one of the P micro-batches: 8 / 2 tokens a plan
    assert 0 < result["tokens_per_plan"] <= 8
