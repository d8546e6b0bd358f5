"""Calibrate the "cpu" profile: real SmolLM2 steps beside the timing model, and a fit.

    python -m services.worker.sim.calibrate [--model DIR] [--peaks FILE] [--iters 5] [--write]
        [--concurrent] [--save-samples FILE | --samples FILE]

Runs the real worker's stages (`StageRunner.from_config`: oneDNN matmuls, the C++ decode
attention, float32) as the 64 x 128/128 comparison runs them: 2 stages of 1 thread each
(the default split, 18 | 12 layers + logits; `--concurrent`: both at once, one process
each, each pinned to its own core) and 1 stage of 2 threads. Each step kind
(decode at several batch sizes and contexts, prefill chunks) is timed as the device part
of a step (forward + sampling; the runner's input building is real in the sim too, so it
is not modeled), the fastest of interleaved rounds (the step undisturbed by the
other processes of a shared machine). Then, per thread count, the profile's
efficiencies and overheads are fitted to those times (least squares on log time, from
this machine's measured peaks: `measure.py`), and every case is printed with the
measured time, the prediction of the peaks alone (efficiency 1, no overhead) and the
fitted prediction. The fit is made twice, with an operator's compute and memory times
added (the CPU profile's choice) and with their maximum (the GPUs'), to show which the
machine follows. `--write` saves the fitted variants as the "cpu" profile (cpu.json);
`--save-samples` keeps the measured times, `--samples` fits those again without measuring.
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
    weight: float = 1.0
    """Its share in the fit (in-stack samples: their kind's share of the run's time)."""


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


def measure_layout(
    model_dir: Path, stages: list[Stage], iters: int, concurrent: bool = False
) -> list[Sample]:
    """Every case on every stage of one layout, one stage after the other; `concurrent`:
    the stages at the same time, one process each, pinned to their own cores where they
    fit (as `conveyor up` runs them), starting each case together, so that a stage's time
    includes what the other takes from the memory bus, as in the real pipeline (this needs
    an otherwise idle machine: on a shared one the co-running stages are disturbed all the
    time, and no round is clean)."""
    if not concurrent or len(stages) == 1:
        return [s for stage in stages for s in measure_stage(model_dir, stage, iters)]
    import multiprocessing

    from services.common.affinity import stage_cpus

    cpus = stage_cpus(len(stages), stages[0].threads) or [None] * len(stages)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(stages)), context.Queue()
    procs = [
        context.Process(
            target=_measure_stage_process,
            args=(model_dir, stage, iters, barrier, cores, results),
            daemon=True,
        )
        for stage, cores in zip(stages, cpus, strict=True)
    ]
    for proc in procs:
        proc.start()
    found = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
    errors = [f for f in found if isinstance(f, str)]
    if errors:
        raise RuntimeError(f"measuring a stage failed: {errors[0]}")
    return [s for samples in sorted(found, key=lambda f: f[0].stage.index) for s in samples]


def _measure_stage_process(model_dir, stage, iters, barrier, cores, results) -> None:
    try:
        if cores is not None:
            from services.common.affinity import pin_process

            pin_process(cores)
        results.put(measure_stage(model_dir, stage, iters, barrier))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        barrier.abort()
        results.put(f"stage {stage.name}: {exc!r}")


def measure_stage(model_dir: Path, stage: Stage, iters: int, barrier=None) -> list[Sample]:
    """Fastest device time (forward + sampling) of every case on the real stage; with a
    `barrier`, each case starts when every stage of the layout is ready to start it."""
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
            if barrier is not None:
                barrier.wait()
            seconds = run(case)
            if round_ >= 2:
                case_times.append(seconds)
    return [
        Sample(stage, case, spec.num_layers, spec.is_first, spec.is_last, min(t))
        for case, t in zip(all_cases, times, strict=True)
    ]


def stack_samples(
    model: ModelConfig, num_stages: int, threads: int, scheduler_trace: Path, timeline: Path
) -> list[Sample]:
    """The steps a real stack ran (`calibrate --in-stack`), one Sample per step kind and
    stage: what each step computed from the scheduler's event trace (`--trace-scheduler`:
    each request's scheduled tokens; its context is what it computed before, from its first
    step, or from a preemption, which recomputes), how long each stage took from the
    stages' timeline (`--timeline`: a step's slice from its inputs to its sends). Steps of
    one kind (decode or with prefill, batch size, tokens, context to 64 tokens) are one
    sample: the step of median time among them (a disturbed step does not count), weighted
    by the kind's share of the run's busy time (the ramp's odd batches count for little,
    the steady state's steps for much), the weights averaging 1."""
    from services.worker.model.stages import logits_layer_equivalents, stage_spec

    logits_cost = logits_layer_equivalents(
        model.vocab_size, model.hidden_size, model.num_layer_params
    )  # the split the workers use
    steps: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    computed: dict[str, int] = {}
    for line in scheduler_trace.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "transition" and event["to"] != "running":
            computed.pop(event["request_id"], None)  # preempted (recomputes) or finished
        elif event["event"] == "step" and event["request_ids"]:
            seq_lens = []
            for request_id, num in zip(event["request_ids"], event["num_tokens"], strict=True):
                computed[request_id] = computed.get(request_id, 0) + num
                seq_lens.append(computed[request_id])
            steps[event["step_id"]] = (tuple(event["num_tokens"]), tuple(seq_lens))
    groups: dict[tuple, list[Sample]] = {}
    events = json.loads(timeline.read_text())["traceEvents"]
    for event in events:
        if event.get("ph") != "X" or not event["name"].startswith("step "):
            continue
        step = steps.get(int(event["name"].split()[1]))
        if step is None:
            continue
        query_lens, seq_lens = step
        spec = stage_spec(
            model.num_hidden_layers, num_stages, event["tid"], last_stage_extra=logits_cost
        )
        kind = "decode" if max(query_lens) == 1 else "prefill"
        context = sum(seq_lens) // len(seq_lens) // 64 * 64
        tokens = sum(query_lens)
        name = (
            f"decode B={len(query_lens)} ctx~{context}"
            if kind == "decode"
            else f"{len(query_lens)} seqs, {tokens} tok"
        )
        sample = Sample(
            Stage(event["tid"], num_stages, threads),
            Case(name, kind, query_lens, seq_lens),
            spec.num_layers,
            spec.is_first,
            spec.is_last,
            event["dur"] / 1e6,
        )
        key = (event["tid"], kind, len(query_lens), tokens // 64, context)
        groups.setdefault(key, []).append(sample)
    total_s = sum(s.measured_s for group in groups.values() for s in group)
    found = []
    for key in sorted(groups):
        group = sorted(groups[key], key=lambda s: s.measured_s)
        share = sum(s.measured_s for s in group) / total_s
        found.append(dataclasses.replace(group[len(group) // 2], weight=share * len(groups)))
    return found


def measure_in_stack(model_dir: Path, num_stages: int, threads: int, out: Path) -> list[Sample]:
    """Serves the 64 x 128/128 burst on a real `conveyor up` of this layout (async) with
    its timeline and event trace on, and reads the samples from them."""
    from services.bench.sim_experiment import serve_workload

    out.mkdir(parents=True, exist_ok=True)
    trace = (out / f"scheduler-{num_stages}x{threads}.jsonl").resolve()
    trace.unlink(missing_ok=True)
    result = serve_workload(
        model_dir, "cpu", num_stages, "async", "calibration", None, out,
        ["--device", "cpu", "--trace-scheduler", str(trace)], threads,
    )  # fmt: skip
    if result.get("failed") or "trace" not in result:
        raise RuntimeError(f"the real {num_stages}-stage run failed: {result}")
    return stack_samples(
        ModelConfig.from_dir(model_dir), num_stages, threads, trace, Path(result["trace"])
    )


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
    """`base` with FITTED minimising the (weighted) squared log error of its predictions."""
    measured = np.log([s.measured_s for s in samples])
    weights = np.array([s.weight for s in samples])
    x0 = np.log(START)

    def loss(x: np.ndarray) -> float:
        profile = _with_params(base, x)
        predicted = np.log([predict(model, profile, s) for s in samples])
        error = np.sum(weights * (predicted - measured) ** 2)
        return float(error + 1e-4 * np.sum((x - x0) ** 2))

    best = nelder_mead(loss, x0, step=0.5, iterations=4000)
    fitted = _with_params(base, best)
    return dataclasses.replace(
        fitted, description=f"this machine, {base.threads} thread(s) (measured peaks, fitted)"
    )


def rms_error(model: ModelConfig, profile: HardwareProfile, samples: list[Sample]) -> float:
    """The root mean square of the relative errors, each sample counting its weight."""
    errors = [(predict(model, profile, s) / s.measured_s - 1, s.weight) for s in samples]
    return _rms(errors)


def _rms(errors: list[tuple[float, float]]) -> float:
    return math.sqrt(sum(w * e * e for e, w in errors) / sum(w for _, w in errors))


def report(model: ModelConfig, peaks: HardwareProfile, fitted: HardwareProfile, samples) -> str:
    """The table of one thread count: measured, peaks-only and fitted predictions."""
    weighted = any(s.weight != 1.0 for s in samples)
    lines = [
        f"{'stage':<10}{'case':<22}{'measured ms':>12}{'peaks ms':>10}{'fitted ms':>11}{'error':>8}"
        + (f"{'weight':>8}" if weighted else "")
    ]
    errors: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        raw, pred = predict(model, peaks, s), predict(model, fitted, s)
        error = pred / s.measured_s - 1
        errors.setdefault(s.case.kind, []).append((error, s.weight))
        lines.append(
            f"{s.stage.name:<10}{s.case.name:<22}{s.measured_s * 1e3:>12.2f}{raw * 1e3:>10.2f}"
            f"{pred * 1e3:>11.2f}{error:>+8.1%}" + (f"{s.weight:>8.2f}" if weighted else "")
        )
    for kind, errs in errors.items():
        worst = max(errs, key=lambda ew: abs(ew[0]))[0]
        lines.append(
            f"  {kind}: rms error {_rms(errs):.1%}{' (weighted)' if weighted else ''}, "
            f"worst {worst:+.1%} ({len(errs)} cases)"
        )
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


def save_samples(path: Path, samples: list[Sample]) -> None:
    path.write_text(json.dumps([dataclasses.asdict(s) for s in samples], indent=1) + "\n")


def read_samples(path: Path) -> list[Sample]:
    found = []
    for raw in json.loads(path.read_text()):
        case = raw["case"]
        case = Case(case["name"], case["kind"], tuple(case["query_lens"]), tuple(case["seq_lens"]))
        found.append(Sample(**{**raw, "stage": Stage(**raw["stage"]), "case": case}))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M")
    parser.add_argument("--peaks", type=Path, default=None, help="`measure.py --write` file")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--write", action="store_true", help=f"save {CPU_PROFILE_PATH.name}")
    parser.add_argument(
        "--concurrent", action="store_true", help="run the 2 stages at once (an idle machine)"
    )
    parser.add_argument(
        "--in-stack",
        action="store_true",
        help="time the steps of real `conveyor up` stacks serving the 64 x 128/128 burst "
        "instead of stages alone (what the stack costs a step included)",
    )
    parser.add_argument(
        "--results-dir", type=Path, default=Path("bench/results/calibration"), help="--in-stack"
    )
    parser.add_argument("--save-samples", type=Path, default=None, metavar="FILE")
    parser.add_argument("--samples", type=Path, default=None, metavar="FILE", help="no measuring")
    args = parser.parse_args()
    if args.model is None:
        from services.models.fetch import fetch_model

        args.model = fetch_model("smollm2-135m")
    model = ModelConfig.from_dir(args.model)
    from services.bench.sim_experiment import CALIBRATION_LAYOUTS

    layouts = {  # threads per stage -> the stages of that layout
        threads: [Stage(i, stages, threads) for i in range(stages)]
        for stages, threads in CALIBRATION_LAYOUTS
    }
    peaks = load_peaks(args.peaks, sorted(layouts))
    if args.samples:
        all_samples = read_samples(args.samples)
    elif args.in_stack:
        all_samples = [
            s
            for threads, stages in layouts.items()
            for s in measure_in_stack(args.model, len(stages), threads, args.results_dir)
        ]
        if args.save_samples:
            save_samples(args.save_samples, all_samples)
    else:
        all_samples = [
            s
            for stages in layouts.values()
            for s in measure_layout(args.model, stages, args.iters, args.concurrent)
        ]
        if args.save_samples:
            save_samples(args.save_samples, all_samples)
    fitted = []
    for threads in layouts:
        samples = [s for s in all_samples if s.stage.threads == threads]
        base = peaks[threads]
        profile = fit(model, dataclasses.replace(base, overlap=False), samples)
        as_max = fit(model, dataclasses.replace(base, overlap=True), samples)
        fitted.append(profile)
        print(
            f"\n{threads} thread(s): peaks {base.peak_flops / 1e9:.1f} GF/s matmul, "
            f"{base.memory_bandwidth / 1e9:.1f} GB/s read"
        )
        print(report(model, dataclasses.replace(base, overlap=False), profile, samples))
        print(
            f"  rms error over all cases: {rms_error(model, profile, samples):.1%} with compute "
            f"+ memory (used), {rms_error(model, as_max, samples):.1%} with max(compute, memory)"
        )
    if args.write:
        write_profiles(CPU_PROFILE_PATH, fitted)
        print(f"\nwrote {CPU_PROFILE_PATH}")


if __name__ == "__main__":
    main()
