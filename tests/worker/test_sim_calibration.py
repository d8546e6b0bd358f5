"""Calibrating the "cpu" profile from a real stack's steps (`calibrate --in-stack`), and the
predicted-against-measured table of `conveyor bench --compare --device sim --calibration`:
the pure parts (reading the traces, the weighted fit, the table)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from services.bench import cli as bench_cli
from services.bench.sim_experiment import calibration_table
from services.worker.model.config import ModelConfig
from services.worker.sim import MODELS_DIR
from services.worker.sim.calibrate import Case, Sample, Stage, fit, predict, stack_samples
from services.worker.sim.profiles import load_profile

SMOLLM2 = ModelConfig.from_dir(MODELS_DIR / "smollm2-135m")


def _write_traces(tmp_path, steps, durations, transitions=()):
    """steps: step id -> [(request id, tokens)]; durations: (step id, stage) -> ms;
    transitions: (before step id, request id, new state)."""
    lines = []
    for step_id, entries in steps.items():
        for before, request_id, state in transitions:
            if before == step_id:
                lines.append({"event": "transition", "request_id": request_id, "to": state})
        lines.append(
            {
                "event": "step",
                "step_id": step_id,
                "request_ids": [r for r, _ in entries],
                "num_tokens": [n for _, n in entries],
            }
        )
    trace = tmp_path / "scheduler.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0}]
    for (step_id, stage), ms in durations.items():
        events.append(
            {"ph": "X", "pid": 0, "tid": stage, "name": f"step {step_id}", "dur": ms * 1000}
        )
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"traceEvents": events}))
    return trace, timeline


def test_stack_samples_rebuild_each_steps_contexts_and_weigh_kinds_by_time(tmp_path):
    steps = {
        0: [("a", 100), ("b", 100)],  # prefill: contexts 100, 100
        1: [("a", 1), ("b", 1)],  # decode at 101, 101
        2: [("a", 1), ("b", 1)],  # 102, 102
        3: [("a", 1), ("b", 1)],  # 103, 103
        4: [("b", 1), ("a", 50)],  # a was preempted: recomputes from 0
    }
    durations = {(s, stage): 10.0 for s in (1, 2, 3) for stage in (0, 1)}
    durations[(2, 0)] = 40.0  # a disturbed step: the median of its kind ignores it
    durations.update({(0, 0): 200.0, (0, 1): 150.0, (4, 0): 60.0, (4, 1): 50.0})
    trace, timeline = _write_traces(tmp_path, steps, durations, [(4, "a", "preempted")])

    samples = stack_samples(SMOLLM2, 2, 1, trace, timeline)

    by = {(s.stage.index, s.case.name): s for s in samples}
    assert len(samples) == 6  # 3 kinds x 2 stages
    prefill = by[(0, "2 seqs, 200 tok")]
    assert prefill.case == Case("2 seqs, 200 tok", "prefill", (100, 100), (100, 100))
    assert prefill.measured_s == pytest.approx(0.2)
    decode = by[(0, "decode B=2 ctx~64")]
    assert decode.case.kind == "decode" and decode.case.seq_lens in {(101, 101), (103, 103)}
    assert decode.measured_s == pytest.approx(0.010)  # the median of 10, 40, 10 ms
    mixed = by[(1, "2 seqs, 51 tok")]
    assert mixed.case.query_lens == (1, 50) and mixed.case.seq_lens == (104, 50)
    # The workers' split (logits weigh as layers): 18 | 12 for SmolLM2's 30 layers.
    assert (prefill.num_layers, prefill.is_first, prefill.is_last) == (18, True, False)
    assert (mixed.num_layers, mixed.is_first, mixed.is_last) == (12, False, True)
    # Weights: each kind's share of the busy time, averaging 1.
    total_ms = sum(durations.values())
    assert sum(s.weight for s in samples) == pytest.approx(len(samples))
    assert decode.weight == pytest.approx(60 / total_ms * 6)
    assert prefill.weight == pytest.approx(200 / total_ms * 6)


def test_stack_samples_skip_steps_the_trace_does_not_name(tmp_path):
    trace, timeline = _write_traces(tmp_path, {0: [("a", 8)]}, {(0, 0): 5.0, (7, 0): 9.0})
    samples = stack_samples(SMOLLM2, 1, 2, trace, timeline)
    assert [(s.case.seq_lens, s.stage) for s in samples] == [((8,), Stage(0, 1, 2))]


def _samples(profile, disturbed_ms: float, disturbed_weight: float) -> list[Sample]:
    """Samples a profile predicts exactly, and one disturbed step."""
    stage, found = Stage(0, 1, 2), []
    for batch in (1, 8, 32, 64):
        for ctx in (128, 256):
            case = Case(f"B={batch} ctx={ctx}", "decode", (1,) * batch, (ctx,) * batch)
            found.append(Sample(stage, case, 30, True, True, 0.0))
    for n in (1, 4):
        case = Case(f"{n} x {512 // n}", "prefill", (512 // n,) * n, (512 // n,) * n)
        found.append(Sample(stage, case, 30, True, True, 0.0))
    found = [dataclasses.replace(s, measured_s=predict(SMOLLM2, profile, s)) for s in found]
    odd = found[2]
    found.append(dataclasses.replace(odd, measured_s=disturbed_ms / 1e3, weight=disturbed_weight))
    return found


def test_fit_follows_the_weights():
    truth = load_profile("cpu", threads=2)
    base = dataclasses.replace(truth, compute_efficiency=1.0, memory_efficiency=1.0)
    samples = _samples(truth, disturbed_ms=500.0, disturbed_weight=0.001)
    fitted = fit(SMOLLM2, base, samples)
    for s in samples[:-1]:  # the disturbed step, weighing nothing, does not pull the fit
        assert predict(SMOLLM2, fitted, s) == pytest.approx(s.measured_s, rel=0.05)
    heavy = fit(SMOLLM2, base, _samples(truth, disturbed_ms=500.0, disturbed_weight=50.0))
    odd = samples[-1]
    assert predict(SMOLLM2, heavy, odd) > 1.5 * predict(SMOLLM2, fitted, odd)


def _result(tok_s: float, tpot_ms: float, bubble: list[float]) -> dict:
    return {
        "output_throughput": tok_s,
        "mean_tpot_ms": tpot_ms,
        "mean_ttft_ms": 1000.0,
        "bubble_fraction": bubble,
    }


def test_calibration_table_prints_predicted_against_measured_medians():
    runs = {
        (2, 1, "real"): [_result(200, 250, [0.1, 0.2]), _result(220, 230, [0.1, 0.1])],
        (2, 1, "sim"): [_result(230, 240, [0.1, 0.1]), _result(230, 240, [0.1, 0.1])],
        (1, 2, "real"): [_result(300, 200, [0.0])],
        (1, 2, "sim"): [_result(240, 210, [0.0])],
    }
    rows = [line.split() for line in calibration_table(runs).splitlines()[2:]]
    two = [r for r in rows if r[:2] == ["2", "stages"]]
    assert two[0][-4:] == ["210.0", "230.0", "+9.5%", "ok"]  # median of 200 and 220
    assert two[1][-4:] == ["240.0", "240.0", "+0.0%", "ok"]
    assert two[3][-3:] == ["12%", "10%", "-20.0%"]  # the bubble: mean over stages, median
    one = [r for r in rows if r[:2] == ["1", "stage"]]
    assert one[0][-4:] == ["300.0", "240.0", "-20.0%", "OFF"]


def _flags(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    bench_cli._check_peer_flags(parser.parse_args(argv))


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--calibration"], "--calibration goes with --compare --device sim"),
        (["--compare", "--calibration"], "--calibration goes with --compare --device sim"),
        (
            ["--compare", "--device", "sim", "--rounds", "2"],
            "--rounds also with --compare --device sim --calibration or --sweep",
        ),
    ],
)
def test_calibration_flags_are_checked(argv, error):
    with pytest.raises(SystemExit, match=error):
        _flags(argv)


def test_calibration_and_the_sweep_take_rounds():
    _flags(["--compare", "--device", "sim", "--calibration", "--rounds", "3"])
    _flags(["--compare", "--device", "sim", "--sweep", "--rounds", "3"])
