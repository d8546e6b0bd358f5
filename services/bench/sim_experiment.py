"""`conveyor bench --compare --device sim`: what async scheduling buys a pipeline at
accelerator speed, on modeled devices (`--device sim`, docs/simulation.md).

For each workload, arrival pattern and pipeline depth P, one `conveyor up --device sim`
stack per scheduling mode (sync, async) serves the same requests:

    workloads  short: 256 requests x 128 / 128 tokens     long: 64 x 2048 / 512
    arrivals   burst: all at once (held in the scheduler's queue until every request is
               there, then released: the client's sending speed does not shape it)
               poisson: 0.9 x the burst's req/s
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
import statistics
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
CALIBRATION_WORKLOAD = (64, 128, 128)
"""(requests, input tokens, output tokens) the "cpu" profile is fitted to and checked on."""
WORKLOADS = {"short": (256, 128, 128), "long": (64, 2048, 512), "calibration": CALIBRATION_WORKLOAD}
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
    results_dir = Path(args.results_dir) / "sim"
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.calibration:
        return run_calibration(args, results_dir)
    model = Path(args.model) if args.model else SIM_MODELS / "llama-3-70b"
    args.sim_profile = args.sim_profile or "h200"
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
                runs: dict[str, list[dict]] = {"sync": [], "async": []}
                for n in range(max(1, args.rounds)):  # alternated: a drifting host hits both
                    tag = f"-r{n + 1}" if args.rounds > 1 else ""  # each round's own trace
                    for scheduling, results in runs.items():
                        results.append(
                            serve_workload(
                                model,
                                profile,
                                num_stages,
                                scheduling,
                                "sweep",
                                None,
                                results_dir,
                                tag=tag,
                            )
                        )
                for scheduling, results in runs.items():
                    result = median_run(results)
                    points.append(Point("sweep", "burst", num_stages, scheduling, step_ms, result))
        print(sweep_table(points), flush=True)
    else:
        for workload in args.workloads.split(","):
            for arrival in args.arrivals.split(","):
                for num_stages in stages:
                    rate = None
                    for scheduling in ("sync", "async"):
                        if arrival == "poisson" and rate is None:
                            burst = serve_workload(
                                model,
                                args.sim_profile,
                                num_stages,
                                "async",
                                workload,
                                None,
                                results_dir,
                            )
                            rate = 0.9 * burst["request_throughput"]
                        result = serve_workload(
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


def median_run(results: list[dict]) -> dict:
    """The run of median output throughput (the lower middle one of an even count), whole:
    its bubble, TPOT and plan rate stay those of one run. With one run, that run; with
    several, `throughput_range` gives the lowest and highest throughput of all."""
    ranked = sorted(results, key=lambda r: r["output_throughput"])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    if len(ranked) > 1:
        chosen["throughput_range"] = [
            ranked[0]["output_throughput"],
            ranked[-1]["output_throughput"],
        ]
    return chosen


CALIBRATION_LAYOUTS = ((2, 1), (1, 2))
"""(stages, threads per stage) of the real runs the "cpu" profile is fitted to and checked
against (services/worker/sim/calibrate.py): 2 stages of 1 thread, 1 stage of 2 threads."""
CALIBRATION_TOLERANCE = 0.15
"""How far the simulated throughput and TPOT may be from the real ones (issue 16)."""


def run_calibration(args: argparse.Namespace, results_dir: Path) -> int:
    """`--calibration`: the real SmolLM2 stacks against the same stacks on the simulated
    device (`--sim-profile`, default the fitted `cpu`), the 64 x 128/128 burst in async
    mode by default, real and simulated alternating for `--rounds` rounds; prints
    predicted against measured (medians)."""
    from services.models.fetch import fetch_model

    model = Path(args.model) if args.model else fetch_model("smollm2-135m")
    profile = args.sim_profile or "cpu"
    num, inp, out = CALIBRATION_WORKLOAD  # not WORKLOADS[...]: an earlier run may have set it
    WORKLOADS["calibration"] = (
        args.num_prompts or num,
        args.input_len or inp,
        args.output_len or out,
    )
    runs: dict[tuple[int, int, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for stages, threads in CALIBRATION_LAYOUTS:
            for device in ("real", "sim"):
                device_args = ["--device", "cpu"] if device == "real" else None
                result = serve_workload(
                    model, profile, stages, "async", "calibration", None, results_dir,
                    device_args, threads, tag=f"-r{round_}",
                )  # fmt: skip
                runs.setdefault((stages, threads, device), []).append(result)
    print(calibration_table(runs), flush=True)
    out = results_dir / "calibration.json"
    out.write_text(
        json.dumps([{"stages": s, "threads": t, "device": d, "runs": r}
                    for (s, t, d), r in runs.items()], indent=2) + "\n"
    )  # fmt: skip
    print(f"\nwrote {out}", flush=True)
    failed = any(r.get("failed", 0) for results in runs.values() for r in results)
    return 1 if failed else 0


def calibration_table(runs: dict[tuple[int, int, str], list[dict]]) -> str:
    """Per layout and metric: measured (real), predicted (sim), the error, and whether it
    is within CALIBRATION_TOLERANCE (throughput and TPOT; TTFT and bubble for reading)."""
    metrics = (
        ("out tok/s", "output_throughput", True),
        ("TPOT ms", "mean_tpot_ms", True),
        ("TTFT ms", "mean_ttft_ms", False),
        ("bubble", "bubble_fraction", False),
    )
    rows = []
    for (stages, threads, device), real in runs.items():
        if device != "real":
            continue
        sim = runs[(stages, threads, "sim")]
        layout = (
            f"{stages} stage{'s' if stages > 1 else ''} x {threads} thread{'s' * (threads > 1)}"
        )
        for label, key, checked in metrics:
            measured, predicted = _median(real, key), _median(sim, key)
            error = predicted / measured - 1 if measured else float("nan")
            verdict = ("ok" if abs(error) <= CALIBRATION_TOLERANCE else "OFF") if checked else ""
            fmt = "{:.0%}" if key == "bubble_fraction" else "{:.1f}"
            rows.append(
                [layout, label, fmt.format(measured), fmt.format(predicted), f"{error:+.1%}",
                 verdict]
            )  # fmt: skip
    header = ["layout", "metric", "measured", "predicted", "error", "within 15%"]
    return grid(header, rows)


def _median(results: list[dict], key: str) -> float:
    """The median over runs of a metric; a per-stage list (the bubble) counts its mean."""
    values = []
    for r in results:
        value = r.get(key)
        if isinstance(value, list):
            value = sum(value) / len(value) if value else 0.0
        values.append(float(value or 0.0))
    return statistics.median(values)


def serve_workload(
    model: Path,
    profile: str,
    num_stages: int,
    scheduling: str,
    workload: str,
    rate: float | None,
    results_dir: Path,
    device_args: list[str] | None = None,
    threads: int = 1,
    tag: str = "",
) -> dict:
    """One stack, one workload. `device_args` replace the sim device's (e.g. a real
    `--device cuda` beside the simulated one, services/bench/check_gpu.py)."""
    num_prompts, input_len, output_len = WORKLOADS[workload]
    device = "sim-" + Path(profile).stem if device_args is None else "real"
    arrival = "poisson" if rate else "burst"
    key = f"{device}-{workload}-{arrival}-p{num_stages}-t{threads}-{scheduling}{tag}"
    mode = Mode(key, key, stages=num_stages, scheduling=scheduling, threads=threads)
    if device_args is None:
        device_args = ["--device", "sim", "--sim-profile", profile]
    stack = start_stack(model, mode, results_dir, extra_args=device_args)
    try:
        options = DriverOptions(progress=False, request_rate=rate or float("inf"))
        print(f"--- {key}", flush=True)

        async def bench() -> dict:
            pool = await token_pool(stack.router)
            requests = random_requests(pool, num_prompts, input_len, output_len, seed=0)
            # a burst is held in the scheduler's queue and released whole (SchedulerGate)
            target = BenchTarget(stack.router, stack.scheduler, options, release_at_once=not rate)
            return await run_benchmark(target, requests)

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


def _plan_wait(result: dict) -> str:
    """Stage 0's wait for plans, of the wall time: the control plane late (async) or the
    round trip (sync)."""
    waits = result.get("plan_wait_fraction") or []
    return f"{waits[0]:.0%}" if waits else "n/a"


def _window(result: dict) -> str:
    """Steps in flight at most at the end of the run (async: P + the lead it adapted to)."""
    return str(result["max_inflight"]) if result.get("max_inflight") else "n/a"


def experiment_table(points: list[Point]) -> str:
    header = ["workload", "arrival", "P", "mode", "out tok/s", "ideal tok/s", "of ideal"]
    header += ["TTFT ms", "TPOT ms", "bubble", "s0 plan wait", "window"]
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
                _plan_wait(r),
                _window(r),
            ]
        )
    for sync, async_ in _pairs(points):
        a, s = async_.result, sync.result
        ratios.append(
            [
                f"{async_.workload} {async_.arrival} P={async_.stages}",
                f"{a['output_throughput'] / s['output_throughput']:.2f}",
                f"{a['mean_tpot_ms'] / s['mean_tpot_ms']:.2f}",
                f"{a['mean_ttft_ms'] / s['mean_ttft_ms']:.2f}" if s["mean_ttft_ms"] else "n/a",
            ]
        )
    ratio_header = ["async vs sync", "throughput", "TPOT", "TTFT"]
    return grid(header, rows) + "\n\n" + grid(ratio_header, ratios)


def round_trip_ms(trace: dict, num_stages: int) -> float | None:
    """The control plane's round trip in a sync run, from its stages' timeline (a Chrome
    trace): with P steps in flight, step N + P is planned from step N's result, so the
    time from the last stage ending step N to stage 0 starting step N + P is the report,
    the scheduler's processing and Redis, the plan and its delivery. The median over the
    run's steps; None without such pairs."""
    starts, ends = {}, {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or not event["name"].startswith("step "):
            continue
        step_id = int(event["name"].split()[1])
        if event["tid"] == 0:
            starts[step_id] = event["ts"]
        if event["tid"] == num_stages - 1:
            ends[step_id] = event["ts"] + event["dur"]
    gaps = [
        (starts[step + num_stages] - end) / 1000.0
        for step, end in ends.items()
        if step + num_stages in starts and starts[step + num_stages] >= end
    ]
    return statistics.median(gaps) if gaps else None


def _round_trip(point: Point) -> str:
    path = point.result.get("trace")
    if not path or not Path(path).exists():
        return "n/a"
    rtt = round_trip_ms(json.loads(Path(path).read_text()), point.stages)
    return "n/a" if rtt is None else f"{rtt:.2f}"


def sweep_table(points: list[Point]) -> str:
    header = ["P", "step ms", "sync bubble", "async bubble", "async/sync tok/s"]
    header += ["async/sync TPOT", "async of ideal", "sync RTT ms", "async s0 plan wait"]
    header += ["async window", "plan us", "plans/s"]
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
                _round_trip(sync),
                _plan_wait(a),
                _window(a),
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
