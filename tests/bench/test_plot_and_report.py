"""The bubble picture's slices and window, the result table and the comparison ratios."""

import pytest

from services.bench.compare import collective_fractions, ratios
from services.bench.plot import busy_fraction, plot_trace, stage_slices, steady_window
from services.bench.report import result_table
from services.scheduler.timeline import chrome_trace_events


class _Step:
    def __init__(self, step_id, start_ms, end_ms):
        self.step_id, self.num_requests, self.num_tokens = step_id, 4, 4
        self.start_ns, self.end_ns, self.wait_ns = int(start_ms * 1e6), int(end_ms * 1e6), 0
        self.collective_ns = int((end_ms - start_ms) * 1e6 * 0.25)  # a quarter in all-reduces
        self.plan_wait_ns = 0


class _Timeline:
    def __init__(self, stage, steps):
        self.stage, self.steps = stage, steps


def _trace():
    # stage 0 busy 8 of every 10 ms, stage 1 busy 5 of every 10 ms, 100 steps each
    stage0 = [_Step(i, 10 * i, 10 * i + 8) for i in range(100)]
    stage1 = [_Step(i, 10 * i + 2, 10 * i + 7) for i in range(100)]
    return {"traceEvents": chrome_trace_events([_Timeline(0, stage0), _Timeline(1, stage1)])}


def test_stage_slices_reads_the_schedulers_trace():
    stages = stage_slices(_trace())
    assert sorted(stages) == [0, 1]
    assert stages[0][3] == pytest.approx((30.0, 8.0, 3))


def test_steady_window_and_busy_fraction_from_the_middle_of_the_run():
    stages = stage_slices(_trace())
    lo, hi = steady_window(stages, num_steps=20)
    assert 400 < lo < hi < 600  # the middle of a 1 s run
    assert busy_fraction(stages[0], (lo, hi)) == pytest.approx(0.8, abs=0.06)
    assert busy_fraction(stages[1], (lo, hi)) == pytest.approx(0.5, abs=0.06)


def test_collective_fractions_per_stage_from_the_trace(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_trace()))
    assert collective_fractions(trace) == [pytest.approx(0.25), pytest.approx(0.25)]


def test_plot_trace_writes_a_png(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_trace()))
    png = plot_trace(trace, tmp_path / "bubble.png", title="test")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_result_table_shows_scheduler_rows_only_with_a_scheduler():
    base = {"completed": 8, "failed": 0, "output_throughput": 12.5, "mean_ttft_ms": 3.0}
    assert "Bubble" not in result_table(base)
    pipeline = {"bubble_fraction": [0.1, 0.02], "plan_wait_fraction": [0.04, 0.0]}
    table = result_table(base | pipeline | {"preemptions": 0})
    assert "10.0%, 2.0%" in table and "12.50" in table
    assert "Of it, waiting for plans:" in table and "4.0%, 0.0%" in table
    cpu = {"plans_per_s": 512.25, "scheduler_cpu_per_plan_us": 1234.4}
    table = result_table(base | cpu | {"scheduler_cpu_per_token_us": 38.57})
    assert "512.2" in table and "1234" in table and "38.6" in table
    assert "released at once" not in table
    assert "Burst held, released at once:" in result_table(base | {"released_at_once": True})


def test_ratios_against_the_issue_targets():
    results = {
        "sync-2stage": {"output_throughput": 100.0, "mean_tpot_ms": 40.0},
        "async-2stage": {
            "output_throughput": 140.0,
            "mean_tpot_ms": 28.0,
            "single_request_tpot_ms": 35.0,
            "bubble_fraction": [0.03, 0.08],
        },
        "async-1stage": {"output_throughput": 150.0, "mean_tpot_ms": 25.0},
        "transformers": {"output_throughput": 100.0, "mean_tpot_ms": 50.0},
    }
    by_name = {r["name"]: r for r in ratios(results)}
    assert by_name["async / sync output throughput"]["value"] == pytest.approx(1.4)
    assert by_name["async / sync output throughput"]["met"]
    assert by_name["async / sync mean TPOT"]["value"] == pytest.approx(0.7)
    assert not by_name["2-stage async / 1-stage throughput"]["met"]  # 0.93 < 0.95
    assert by_name["async bubble, worst stage"]["value"] == pytest.approx(0.08)
    assert not by_name["async bubble, worst stage"]["met"]
