"""`conveyor bench --compare --device sim`: the arithmetic and tables (the runs themselves
are the benchmark's, not the tests')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench import sim_experiment as sx
from services.worker.model.config import ModelConfig
from services.worker.model.stages import stage_spec
from services.worker.sim.profiles import load_profile
from services.worker.sim.timing import StageTimingModel


def _point(
    stages: int, scheduling: str, tok_s: float, tpot: float, bubbles, step_ms=None, ttft=100.0
):
    result = {
        "output_throughput": tok_s,
        "mean_ttft_ms": ttft,
        "mean_tpot_ms": tpot,
        "bubble_fraction": bubbles,
        "plan_wait_fraction": [b / 2 for b in bubbles],
        "mean_schedule_us": 250.0,
        "plans_per_s": 800.0,
        "max_inflight": stages if scheduling == "sync" else 2 * stages,
    }
    return sx.Point("short", "burst", stages, scheduling, step_ms, result)


def test_ideal_is_the_throughput_over_the_busiest_stages_busy_fraction():
    point = _point(4, "sync", 600.0, 50.0, [0.4, 0.25, 0.5, 0.3])
    assert point.ideal_throughput == pytest.approx(600.0 / 0.75)


def test_experiment_table_pairs_sync_and_async_of_the_same_shape():
    points = [
        _point(2, "sync", 500.0, 40.0, [0.3, 0.3]),
        _point(2, "async", 650.0, 30.0, [0.05, 0.04], ttft=90.0),
        _point(4, "sync", 400.0, 80.0, [0.5, 0.5, 0.5, 0.5]),
    ]
    table = sx.experiment_table(points)
    assert "short burst P=2        1.30  0.75  0.90" in table
    # stage 0's plan wait, and the window async's lead adapted to
    assert table.splitlines()[3].split()[-3:] == ["4%-5%", "2%", "4"]
    assert "P=4" not in table.split("async vs sync")[1]  # no async run of P=4 to pair


@pytest.mark.parametrize("step_ms", [20.0, 2.0, 0.5])
def test_scaled_profile_gives_the_asked_decode_step(tmp_path, step_ms):
    sx.WORKLOADS["sweep"] = (256, 128, 128)
    model = sx.SIM_MODELS / "llama-3-70b"
    path = sx._scaled_profile("h200", model, 8, step_ms, tmp_path)
    profile = load_profile(path)
    assert json.loads(Path(path).read_text())["name"].startswith("h200-x")
    config = ModelConfig.from_dir(model)
    stage = stage_spec(config.num_hidden_layers, 8, 0)
    timing = StageTimingModel(config, profile, stage.num_layers, True, False)
    modeled = timing.step([1] * 32, [192] * 32, 0).total_s
    assert modeled * 1000 == pytest.approx(step_ms, rel=0.01)


def test_sweep_table_shows_both_bubbles_and_the_plan_rate():
    points = [
        _point(8, "sync", 300.0, 60.0, [0.3] * 8, step_ms=2.0),
        _point(8, "async", 420.0, 43.0, [0.04] * 8, step_ms=2.0),
    ]
    row = sx.sweep_table(points).splitlines()[-1].split()
    assert row[:6] == ["8", "2", "30%-30%", "4%-4%", "1.40", "0.72"]
    assert row[-5:] == ["n/a", "2%", "16", "250", "800"]  # no timeline: no round trip


def _slice(stage: int, step_id: int, start_ms: float, dur_ms: float) -> dict:
    return {"ph": "X", "tid": stage, "name": f"step {step_id}", "ts": start_ms * 1e3,
            "dur": dur_ms * 1e3}  # fmt: skip


def test_round_trip_is_last_stage_end_to_stage_0_start_p_steps_later(tmp_path):
    # 2 stages, sync: steps 0 and 1 in flight; step 2 starts 3 ms after step 0 left stage 1,
    # step 3 4 ms after step 1, step 4 5 ms after step 2.
    events = [{"ph": "M", "name": "thread_name", "tid": 0}]
    for step, start in enumerate([0.0, 10.0, 23.0, 34.0, 48.0]):
        events += [_slice(0, step, start, 10.0), _slice(1, step, start + 10.0, 10.0)]
    trace = {"traceEvents": events}
    assert sx.round_trip_ms(trace, 2) == pytest.approx(4.0)  # median of 3, 4, 5 ms
    assert sx.round_trip_ms({"traceEvents": events[:3]}, 2) is None
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    sync = _point(2, "sync", 300.0, 60.0, [0.3] * 2, step_ms=10.0)
    sync.result["trace"] = str(path)
    points = [sync, _point(2, "async", 420.0, 43.0, [0.04] * 2, step_ms=10.0)]
    row = sx.sweep_table(points).splitlines()[-1].split()
    assert row[-5:] == ["4.00", "2%", "4", "250", "800"]


def test_median_run_keeps_one_whole_run_and_the_range():
    runs = [
        {"output_throughput": 300.0, "mean_tpot_ms": 9.0},
        {"output_throughput": 100.0, "mean_tpot_ms": 30.0},
        {"output_throughput": 200.0, "mean_tpot_ms": 15.0},
    ]
    assert sx.median_run(runs) == {
        "output_throughput": 200.0,
        "mean_tpot_ms": 15.0,
        "throughput_range": [100.0, 300.0],
    }
    assert sx.median_run(runs[:2])["output_throughput"] == 100.0  # the lower middle of two
    assert sx.median_run(runs[:1]) == runs[0]  # one run: as it is
