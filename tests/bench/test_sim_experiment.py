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


def _point(stages: int, scheduling: str, tok_s: float, tpot: float, bubbles, step_ms=None):
    result = {
        "output_throughput": tok_s,
        "mean_ttft_ms": 100.0,
        "mean_tpot_ms": tpot,
        "bubble_fraction": bubbles,
        "mean_schedule_us": 250.0,
        "plans_per_s": 800.0,
    }
    return sx.Point("short", "burst", stages, scheduling, step_ms, result)


def test_ideal_is_the_throughput_over_the_busiest_stages_busy_fraction():
    point = _point(4, "sync", 600.0, 50.0, [0.4, 0.25, 0.5, 0.3])
    assert point.ideal_throughput == pytest.approx(600.0 / 0.75)


def test_experiment_table_pairs_sync_and_async_of_the_same_shape():
    points = [
        _point(2, "sync", 500.0, 40.0, [0.3, 0.3]),
        _point(2, "async", 650.0, 30.0, [0.05, 0.04]),
        _point(4, "sync", 400.0, 80.0, [0.5, 0.5, 0.5, 0.5]),
    ]
    table = sx.experiment_table(points)
    assert "short burst P=2        1.30  0.75" in table
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
    assert row[-2:] == ["250", "800"]
