"""Calibrate the "cpu" profile: real SmolLM2 steps beside the timing model, and a fit.

    python -m services.worker.sim.calibrate [--model DIR] [--peaks FILE] [--iters 5] [--write]

Runs the real worker's stages (`StageRunner.from_config`: oneDNN matmuls, the C++ decode
attention, float32) as the 64 x 128/128 comparison runs them: 2 stages of 1 thread each
(the default split, 18 | 12 layers + logits) and 1 stage of 2 threads. Each step kind
(decode at several batch sizes and contexts, prefill chunks) is timed as the device part
of a step (forward + sampling; the runner's input building is real in the sim too, so it
is not modeled), the fastest of interleaved rounds (the step undisturbed by the
other processes of a shared machine). Then, per thread count, the profile's
efficiencies and overheads are fitted to those times (least squares on log time, from
this machine's measured peaks: `measure.py`), and every case is printed with the
measured time, the prediction of the peaks alone (efficiency 1, no overhead) and the
fitted prediction. `--write` saves the fitted variants as the "cpu" profile (cpu.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.worker.model.config import ModelConfig
from services.worker.sim.fit import nelder_mead
from services.worker.sim.profiles import CPU_PROFILE_PATH, HardwareProfile, write_profiles
from services.worker.sim.timing import StageTimingModel

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
FITTED = (
    "compute_efficiency",
    "memory_efficiency",
    "attention_compute_efficiency",
    "attention_memory_efficiency",
    "step_overhead_s",
    "layer_overhead_s",
    "seq_overhead_s",
)
START = (0.8, 0.8, 0.5, 0.5, 200e-6, 20e-6, 5e-6)
_MAX_EFFICIENCY = 1.5


@dataclass(slots=True, frozen=True)
class Case:
    """One step kind: sequence i computes query_lens[i] tokens, ending at seq_lens[i]."""

    name: str
    kind: str
    """"decode" or "prefill"."""
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Stage:
    """A stage layout of the real runs: stage `index` of `num_stages`, on `threads`."""

    index: int
    num_stages: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.index + 1}/{self.num_stages} ({self.threads}t)"


@dataclass(slots=True)
class Sample:
    """A case measured on a stage; `layers`, `is_first`, `is_last` for the timing model."""

    stage: Stage
    case: Case
    num_layers: int
    is_first: bool
    is_last: bool
    measured_s: float


def cases() -> list[Case]:
    """Decode at batch 1-64 and contexts 128/256 (the 128/128 workload's range), and the
    prefill steps of a 512-token budget: four 128-token prompts, or one of 512."""
    found = []
    for ctx in (128, 256):
        for batch in (1, 8, 32, 64):
            found.append(
                Case(f"decode B={batch} ctx={ctx}", "decode", (1,) * batch, (ctx,) * batch)
            )
    found.append(Case("prefill 4 x 128", "prefill", (128,) * 4, (128,) * 4))
    found.append(Case("prefill 1 x 512", "prefill", (512,), (512,)))
    return found


def measure_stage(model_dir: Path, stage: Stage, iters: int) -> list[Sample]:
    """Fastest device time (forward + sampling) of every case on the real stage."""
    import torch

    from services.common.sampling import SamplingParams
    from services.common.step import NewRequest, StepPlan
    from services.worker.config import WorkerConfig
    from services.worker.runner import StageRunner

    runner = StageRunner.from_config(
        WorkerConfig(
            model_dir=str(model_dir),
            stage_index=stage.index,
            num_stages=stage.num_stages,
            max_model_len=MAX_MODEL_LEN,
            num_threads=stage.threads,
        )
    )
    spec, hidden_size = runner.model.stage, runner.model.config.hidden_size

    def run(case: Case) -> float:
        new, next_block = [], 0
        for i, (q, c) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
            num_blocks = -(-c // BLOCK_SIZE)
            blocks = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            new.append(NewRequest(f"r{i}", [5] * c, c, SamplingParams(), blocks, c - q, q))
        hidden = None if spec.is_first else torch.randn(sum(case.query_lens), hidden_size)
        runner.execute(StepPlan(0, new_requests=new), hidden_in=hidden)
        runner.requests.clear()
        return runner.last_timing.forward_s + runner.last_timing.sample_s

    all_cases = cases()
    times: list[list[float]] = [[] for _ in all_cases]
    for round_ in range(iters + 2):  # interleaved: a shared machine's load falls on all alike
        for case, case_times in zip(all_cases, times, strict=True):
            seconds = run(case)
            if round_ >= 2:
                case_times.append(seconds)
    return [
        Sample(stage, case, spec.num_layers, spec.is_first, spec.is_last, min(t))
        for case, t in zip(all_cases, times, strict=True)
    ]


def predict(model: ModelConfig, profile: HardwareProfile, sample: Sample) -> float:
    timing = StageTimingModel(model, profile, sample.num_layers, sample.is_first, sample.is_last)
    num_sampled = len(sample.case.query_lens) if sample.is_last else 0
    return timing.step(sample.case.query_lens, sample.case.seq_lens, num_sampled).total_s


def _with_params(base: HardwareProfile, x: np.ndarray) -> HardwareProfile:
    values = {name: float(math.exp(v)) for name, v in zip(FITTED, x, strict=True)}
    for name in FITTED[:4]:
        values[name] = min(values[name], _MAX_EFFICIENCY)
    return dataclasses.replace(base, **values)


def fit(model: ModelConfig, base: HardwareProfile, samples: list[Sample]) -> HardwareProfile:
    """`base` with FITTED minimising the squared log error of its predictions."""
    measured = np.log([s.measured_s for s in samples])
    x0 = np.log(START)

    def loss(x: np.ndarray) -> float:
        profile = _with_params(base, x)
        predicted = np.log([predict(model, profile, s) for s in samples])
        return float(np.sum((predicted - measured) ** 2) + 1e-4 * np.sum((x - x0) ** 2))

    best = nelder_mead(loss, x0, step=0.5, iterations=3000)
    fitted = _with_params(base, best)
    return dataclasses.replace(
        fitted, description=f"this machine, {base.threads} thread(s) (measured peaks, fitted)"
    )


def report(model: ModelConfig, peaks: HardwareProfile, fitted: HardwareProfile, samples) -> str:
    """The table of one thread count: measured, peaks-only and fitted predictions."""
    lines = [
        f"{'stage':<10}{'case':<22}{'measured ms':>12}{'peaks ms':>10}{'fitted ms':>11}{'error':>8}"
    ]
    errors: dict[str, list[float]] = {}
    for s in samples:
        raw, pred = predict(model, peaks, s), predict(model, fitted, s)
        error = pred / s.measured_s - 1
        errors.setdefault(s.case.kind, []).append(error)
        lines.append(
            f"{s.stage.name:<10}{s.case.name:<22}{s.measured_s * 1e3:>12.2f}{raw * 1e3:>10.2f}"
            f"{pred * 1e3:>11.2f}{error:>+8.1%}"
        )
    for kind, errs in errors.items():
        rms = math.sqrt(sum(e * e for e in errs) / len(errs))
        worst = max(errs, key=abs)
        lines.append(f"  {kind}: rms error {rms:.1%}, worst {worst:+.1%} ({len(errs)} cases)")
    params = ", ".join(
        f"{name} {getattr(fitted, name) * (1e6 if name.endswith('_s') else 1):.3g}"
        + (" us" if name.endswith("_s") else "")
        for name in FITTED
    )
    lines.append(f"  fitted: {params}")
    return "\n".join(lines)


def load_peaks(path: Path | None, threads: list[int]) -> dict[int, HardwareProfile]:
    """Peaks per thread count: from a `measure.py --write` file, else measured now."""
    if path is not None:
        raw = json.loads(path.read_text())
        found = {v["threads"]: HardwareProfile(**v) for v in raw["variants"]}
        return {n: found[n] for n in threads}
    from services.worker.sim.measure import measure

    return {n: measure(n).profile() for n in threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M")
    parser.add_argument("--peaks", type=Path, default=None, help="`measure.py --write` file")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--write", action="store_true", help=f"save {CPU_PROFILE_PATH.name}")
    args = parser.parse_args()
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m")
    model = ModelConfig.from_dir(args.model)
    layouts = {1: [Stage(0, 2, 1), Stage(1, 2, 1)], 2: [Stage(0, 1, 2)]}
    peaks = load_peaks(args.peaks, sorted(layouts))
    fitted = []
    for threads, stages in layouts.items():
        samples = [s for stage in stages for s in measure_stage(args.model, stage, args.iters)]
        profile = fit(model, peaks[threads], samples)
        fitted.append(profile)
        p = peaks[threads]
        print(
            f"\n{threads} thread(s): peaks {p.peak_flops / 1e9:.1f} GF/s matmul, "
            f"{p.memory_bandwidth / 1e9:.1f} GB/s read"
        )
        print(report(model, p, profile, samples))
    if args.write:
        write_profiles(CPU_PROFILE_PATH, fitted)
        print(f"\nwrote {CPU_PROFILE_PATH}")


if __name__ == "__main__":
    main()
