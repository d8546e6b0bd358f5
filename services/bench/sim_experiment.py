"""`conveyor bench --compare --device sim`: what async scheduling buys a pipeline at
accelerator speed, on modeled devices (`--device sim`, docs/simulation.md).

For each workload, arrival pattern and pipeline depth P, one `conveyor up --device sim`
stack per scheduling mode (sync, async) serves the same requests:

    workloads  short: 256 requests x 128 / 128 tokens     long: 64 x 2048 / 512
    arrivals   burst: all at once                         poisson: 0.9 x the burst's req/s
    P          2, 4, 8 stages of Llama-3-70B on H200 (by default)

Per run: output throughput, TTFT, TPOT, the bubble of every stage, and the modeled ideal:
what a bubble-free pipeline would give for the same plans, i.e. the measured throughput
over the busy fraction of the busiest stage. `--sweep` instead scales the profile's speed so
that a decode step of one stage takes from ~20 ms down to ~0.5 ms, and prints, per point,
sync's bubble beside async's, their ratio, and the scheduler's planning time and plan rate:
where the control plane, not the devices, becomes the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from services.bench.datasets import random_requests
from services.bench.driver import DriverOptions, token_pool
from services.bench.plot import plot_trace
from services.bench.report import grid
from services.bench.run import BenchTarget, run_benchmark
from services.bench.stack import Mode, start_stack

logger = logging.getLogger(__name__)

SIM_MODELS = Path(__file__).resolve().parents[1] / "worker" / "sim" / "models"
WORKLOADS = {"short": (256, 128, 128), "long": (64, 2048, 512)}
SWEEP_STEP_MS = (20.0, 10.0, 5.0, 2.0, 1.0, 0.5)


@dataclass(slots=True)
class Point:
    """One run: a stack shape and what it served."""

    workload: str
    arrival: str
    stages: int
    scheduling: str
    step_ms: float | None
    result: dict

    @property
    def ideal_throughput(self) -> float:
        """The busiest stage's busy time is the least a bubble-free pipeline needs."""
        bubbles = self.result.get("bubble_fraction") or [0.0]
        return self.result["output_throughput"] / max(1e-9, 1.0 - min(bubbles))


def run_sim_compare(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else SIM_MODELS / "llama-3-70b"
    results_dir = Path(args.results_dir) / "sim"
    results_dir.mkdir(parents=True, exist_ok=True)
    stages = [int(p) for p in args.stages_list.split(",")]
    points: list[Point] = []
    if args.sweep:  # --num-prompts / --input-len / --output-len size it (default: short)
        num, inp, out = WORKLOADS["short"]
        WORKLOADS["sweep"] = (
            args.num_prompts or num,
            args.input_len or inp,
            args.output_len or out,
        )
        for num_stages in stages:
            for step_ms in SWEEP_STEP_MS:
                profile = _scaled_profile(args.sim_profile, model, num_stages, step_ms, results_dir)
                for scheduling in ("sync", "async"):
                    result = _run(
                        model, profile, num_stages, scheduling, "sweep", None, results_dir
                    )
                    points.append(Point("sweep", "burst", num_stages, scheduling, step_ms, result))
        print(sweep_table(points), flush=True)
    else:
        for workload in args.workloads.split(","):
            for arrival in args.arrivals.split(","):
                for num_stages in stages:
                    rate = None
                    for scheduling in ("sync", "async"):
                        if arrival == "poisson" and rate is None:
                            burst = _run(
                                model,
                                args.sim_profile,
                                num_stages,
                                "async",
                                workload,
                                None,
                                results_dir,
                            )
                            rate = 0.9 * burst["request_throughput"]
                        result = _run(
                            model,
                            args.sim_profile,
                            num_stages,
                            scheduling,
                            workload,
                            rate if arrival == "poisson" else None,
                            results_dir,
                        )
                        points.append(
                            Point(workload, arrival, num_stages, scheduling, None, result)
                        )
        print(experiment_table(points), flush=True)
    out = results_dir / ("sweep.json" if args.sweep else "experiment.json")
    out.write_text(json.dumps([dataclasses.asdict(p) for p in points], indent=2) + "\n")
    print(f"\nwrote {out} and the stages' timelines beside it", flush=True)
    return 0 if all(p.result.get("failed", 0) == 0 for p in points) else 1


def _run(
    model: Path,
    profile: str,
    num_stages: int,
    scheduling: str,
    workload: str,
    rate: float | None,
    results_dir: Path,
    device_args: list[str] | None = None,
) -> dict:
    """One stack, one workload. `device_args` replace the sim device's (e.g. a real
    `--device cuda` beside the simulated one, services/bench/check_gpu.py)."""
    num_prompts, input_len, output_len = WORKLOADS[workload]
    device = "sim-" + Path(profile).stem if device_args is None else "real"
    arrival = "poisson" if rate else "burst"
    key = f"{device}-{workload}-{arrival}-p{num_stages}-{scheduling}"
    mode = Mode(key, key, stages=num_stages, scheduling=scheduling, threads=1)
    if device_args is None:
        device_args = ["--device", "sim", "--sim-profile", profile]
    stack = start_stack(model, mode, results_dir, extra_args=device_args)
    try:
        options = DriverOptions(progress=False, request_rate=rate or float("inf"))
        print(f"--- {key}", flush=True)

        async def bench() -> dict:
            pool = await token_pool(stack.router)
            requests = random_requests(pool, num_prompts, input_len, output_len, seed=0)
            return await run_benchmark(
                BenchTarget(stack.router, stack.scheduler, options), requests
            )

        result = asyncio.run(bench())
    finally:
        stack.stop()
    if stack.trace_path.exists():
        png = plot_trace(stack.trace_path, results_dir / f"bubble-{key}.png", title=key)
        result["trace"], result["png"] = str(stack.trace_path), str(png) if png else None
    return result


def _scaled_profile(name: str, model: Path, num_stages: int, step_ms: float, out: Path) -> str:
    """A copy of profile `name`, its peaks scaled so that a decode step of the sweep's
    workload (its requests / P) on one stage of `num_stages` takes about `step_ms`."""
    from services.worker.model.config import ModelConfig
    from services.worker.model.stages import stage_spec
    from services.worker.sim.profiles import load_profile
    from services.worker.sim.timing import StageTimingModel

    profile = load_profile(name)
    config = ModelConfig.from_dir(model)
    stage = stage_spec(config.num_hidden_layers, num_stages, 0)
    timing = StageTimingModel(config, profile, stage.num_layers, True, False)
    batch = max(1, WORKLOADS["sweep"][0] // num_stages)
    modeled_s = timing.step([1] * batch, [192] * batch, 0).total_s
    scale = modeled_s / (step_ms / 1000.0)
    fields = profile.to_dict()
    for key in ("peak_flops", "memory_bandwidth", "link_bandwidth", "tp_bandwidth"):
        fields[key] *= scale
    for key in ("step_overhead_s", "layer_overhead_s", "seq_overhead_s", "link_latency_s"):
        fields[key] /= scale
    fields["name"] = f"{profile.name}-x{scale:.3g}"
    path = out / f"profile-p{num_stages}-{step_ms:g}ms.json"
    path.write_text(json.dumps(fields, indent=2) + "\n")
    return str(path)


def _bubble(result: dict) -> str:
    bubbles = result.get("bubble_fraction") or []
    return f"{min(bubbles):.0%}-{max(bubbles):.0%}" if bubbles else "n/a"


def experiment_table(points: list[Point]) -> str:
    header = ["workload", "arrival", "P", "mode", "out tok/s", "ideal tok/s", "of ideal"]
    header += ["TTFT ms", "TPOT ms", "bubble"]
    rows, ratios = [], []
    for p in points:
        r = p.result
        rows.append(
            [
                p.workload,
                p.arrival,
                str(p.stages),
                p.scheduling,
                f"{r['output_throughput']:.0f}",
                f"{p.ideal_throughput:.0f}",
                f"{r['output_throughput'] / p.ideal_throughput:.0%}",
                f"{r['mean_ttft_ms']:.0f}",
                f"{r['mean_tpot_ms']:.1f}",
                _bubble(r),
            ]
        )
    for sync, async_ in _pairs(points):
        ratios.append(
            [
                f"{async_.workload} {async_.arrival} P={async_.stages}",
                f"{async_.result['output_throughput'] / sync.result['output_throughput']:.2f}",
                f"{async_.result['mean_tpot_ms'] / sync.result['mean_tpot_ms']:.2f}",
            ]
        )
    return grid(header, rows) + "\n\n" + grid(["async vs sync", "throughput", "TPOT"], ratios)


def sweep_table(points: list[Point]) -> str:
    header = ["P", "step ms", "sync bubble", "async bubble", "async/sync tok/s"]
    header += ["async/sync TPOT", "async of ideal", "plan us", "plans/s"]
    rows = []
    for sync, async_ in _pairs(points):
        a, s = async_.result, sync.result
        rows.append(
            [
                str(async_.stages),
                f"{async_.step_ms:g}",
                _bubble(s),
                _bubble(a),
                f"{a['output_throughput'] / s['output_throughput']:.2f}",
                f"{a['mean_tpot_ms'] / s['mean_tpot_ms']:.2f}",
                f"{a['output_throughput'] / async_.ideal_throughput:.0%}",
                f"{a.get('mean_schedule_us', 0):.0f}",
                f"{a.get('plans_per_s', 0):.0f}",
            ]
        )
    return grid(header, rows)


def _pairs(points: list[Point]) -> list[tuple[Point, Point]]:
    """(sync, async) of the same workload, arrival, P and step time."""
    by_key = {}
    for p in points:
        by_key.setdefault((p.workload, p.arrival, p.stages, p.step_ms), {})[p.scheduling] = p
    return [(v["sync"], v["async"]) for v in by_key.values() if {"sync", "async"} <= set(v)]
