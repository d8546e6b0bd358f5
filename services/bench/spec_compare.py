"""`conveyor bench --compare --speculative-config JSON`: one workload on 2 stages async,
without and with speculative decoding, on this machine.

    2 stages async                 ─┐  warm-up, the workload's first request alone (its
    2 stages async + speculation   ─┘  TPOT), then the whole workload with scheduler stats

Prints the TPOT and throughput ratios (speculative / plain) and the acceptance the
scheduler measured; writes `spec-compare.json` under the results directory. Run it with
`--dataset repeat` (outputs copy the prompt: proposals are accepted) and with
`--dataset random --temperature 1` (sampled outputs rarely repeat: little is accepted, and
adaptivity must keep the cost small).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict
from pathlib import Path

from services.bench.cpu import CpuMeter
from services.bench.datasets import BenchRequest, random_requests
from services.bench.driver import DriverOptions, token_pool
from services.bench.report import grid
from services.bench.run import BenchTarget, Workload, build_requests, run_benchmark
from services.bench.stack import Mode, RunningStack, start_stack

PLAIN = Mode("async-2stage", "2 stages async", stages=2, scheduling="async", threads=1)
SPEC = Mode("async-2stage-spec", "2 stages async + speculation", 2, "async", threads=1)


async def _bench(stack: RunningStack, requests: list[BenchRequest], options: DriverOptions):
    pool = await token_pool(stack.router)
    quiet = DriverOptions(progress=False, ignore_eos=True, temperature=options.temperature)
    await run_benchmark(BenchTarget(stack.router, None, quiet), random_requests(pool, 4, 16, 8))
    alone = await run_benchmark(BenchTarget(stack.router, stack.scheduler, quiet), requests[:1])
    meter = CpuMeter([stack.proc.pid, os.getpid()])
    meter.start()
    result = await run_benchmark(BenchTarget(stack.router, stack.scheduler, options), requests)
    result["cpu"] = meter.stop()
    result["single_request_tpot_ms"] = alone["mean_tpot_ms"]
    return result


def _run(model_dir: Path, mode: Mode, workload, options, results_dir, requests, extra_args):
    stack = start_stack(model_dir, mode, results_dir, extra_args=extra_args)
    try:
        if requests is None:
            requests = asyncio.run(build_requests(stack.router, workload))
        print(f"--- {mode.label}: {len(requests)} {workload.dataset} requests", flush=True)
        return asyncio.run(_bench(stack, requests, options)), requests
    finally:
        stack.stop()


def spec_ratios(plain: dict, spec: dict) -> dict[str, float]:
    """Speculative / plain: mean TPOT (the workload's and one request alone) and output
    throughput."""
    return {
        "tpot_ratio": spec["mean_tpot_ms"] / plain["mean_tpot_ms"],
        "single_request_tpot_ratio": spec["single_request_tpot_ms"]
        / plain["single_request_tpot_ms"],
        "throughput_ratio": spec["output_throughput"] / plain["output_throughput"],
    }


def run_spec_compare(args: argparse.Namespace, workload: Workload, options: DriverOptions) -> int:
    from services.models.fetch import fetch_model

    model_dir = Path(args.model) if args.model else fetch_model("smollm2-135m")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    plain, requests = _run(model_dir, PLAIN, workload, options, results_dir, None, None)
    spec_args = ["--speculative-config", args.speculative_config]
    spec, _ = _run(model_dir, SPEC, workload, options, results_dir, requests, spec_args)
    ratios = spec_ratios(plain, spec)
    report = {
        "workload": asdict(workload),
        "speculative_config": json.loads(args.speculative_config),
        "temperature": options.temperature,
        "modes": {PLAIN.key: plain, SPEC.key: spec},
        "ratios": ratios,
    }
    out = results_dir / "spec-compare.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        [
            mode.label,
            f"{res['output_throughput']:.1f}",
            f"{res['mean_ttft_ms']:.0f}",
            f"{res['mean_tpot_ms']:.1f}",
            f"{res['single_request_tpot_ms']:.1f}",
            f"{res.get('spec_acceptance_rate', 0):.0%}",
            f"{res.get('spec_mean_accepted_length', 0):.2f}",
        ]
        for mode, res in ((PLAIN, plain), (SPEC, spec))
    ]
    header = ["mode", "out tok/s", "TTFT ms", "TPOT ms", "1-req TPOT ms", "accepted", "tok/step"]
    print(grid(header, rows), flush=True)
    print(
        grid(
            ["ratio (speculative / plain)", "measured"],
            [[k, f"{v:.2f}"] for k, v in ratios.items()],
        ),
        flush=True,
    )
    print(f"\nwrote {out}", flush=True)
    failed = plain.get("failed", 0) + spec.get("failed", 0)
    return 0 if failed == 0 else 1
