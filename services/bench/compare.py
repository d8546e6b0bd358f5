"""`conveyor bench --compare`: one workload against every serving mode, on this machine.

    2 stages sync (1 thread per worker)  ─┐
    2 stages async (1 thread per worker)  ├─ warm-up, 1 request alone (TPOT), the workload
    1 stage (2 threads)                   │
    1 stage (1 thread)                    │
    1 stage x 2 tp ranks async            │  (1 thread per worker; the rows with tp ranks
    2 stages x 2 tp ranks async          ─┘   also report the all-reduce's share of a step)
    transformers static batching (2 threads), the same prompts

Writes `compare.json`, each mode's Chrome trace and a PNG of its stages' busy/idle time
under the results directory, and prints one table with the ratios the issue targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
from dataclasses import asdict
from pathlib import Path

from services.bench.cpu import CpuMeter
from services.bench.datasets import BenchRequest, random_requests
from services.bench.driver import DriverOptions, token_pool
from services.bench.plot import plot_trace
from services.bench.report import grid
from services.bench.run import BenchTarget, Workload, build_requests, run_benchmark
from services.bench.stack import Mode, RunningStack, start_stack

logger = logging.getLogger(__name__)

MODES = (
    Mode("sync-2stage", "2 stages sync", stages=2, scheduling="sync", threads=1),
    Mode("async-2stage", "2 stages async", stages=2, scheduling="async", threads=1),
    Mode("async-1stage", "1 stage async", stages=1, scheduling="async", threads=2),
    Mode("async-1stage-1t", "1 stage async, 1 thread", stages=1, scheduling="async", threads=1),
    Mode("tp2-1stage", "1 stage x 2 tp async", 1, "async", threads=1, tensor_parallel_size=2),
    Mode("tp2-2stage", "2 stages x 2 tp async", 2, "async", threads=1, tensor_parallel_size=2),
)
HF_KEY = "transformers"

# (name, numerator mode, denominator mode, metric, target, higher is better)
RATIOS = (
    (
        "async / sync output throughput",
        "async-2stage",
        "sync-2stage",
        "output_throughput",
        1.3,
        True,
    ),
    ("async / sync mean TPOT", "async-2stage", "sync-2stage", "mean_tpot_ms", 0.75, False),
    (
        "2-stage async / 1-stage throughput",
        "async-2stage",
        "async-1stage",
        "output_throughput",
        0.95,
        True,
    ),
    ("stack / transformers throughput", "async-2stage", HF_KEY, "output_throughput", 1.4, True),
)


async def _bench_mode(
    stack: RunningStack, requests: list[BenchRequest], options: DriverOptions, seed: int
) -> dict:
    """Warm-up, one request alone (its TPOT), then the workload with scheduler stats."""
    pool = await token_pool(stack.router)
    quiet = DriverOptions(progress=False, ignore_eos=True)
    warmup = random_requests(pool, 4, 16, 8, seed=seed + 101)
    await run_benchmark(BenchTarget(stack.router, None, quiet), warmup)
    output_len = max(r.output_len for r in requests)
    single = random_requests(pool, 1, len(requests[0].prompt_ids), output_len, seed=seed + 202)
    alone = await run_benchmark(BenchTarget(stack.router, None, quiet), single)
    meter = CpuMeter([stack.proc.pid, os.getpid()])
    meter.start()
    server = stack.http if options.backend == "openai" else stack.router
    result = await run_benchmark(BenchTarget(server, stack.scheduler, options), requests, seed=seed)
    result["cpu"] = meter.stop()
    result["single_request_tpot_ms"] = alone["mean_tpot_ms"]
    return result


def _run_mode(
    model_dir,
    mode: Mode,
    workload: Workload,
    options: DriverOptions,
    results_dir: Path,
    requests: list[BenchRequest] | None,
    extra_args: list[str] | None = None,
):
    stack = start_stack(model_dir, mode, results_dir, extra_args=extra_args)
    try:
        if requests is None:
            requests = asyncio.run(build_requests(stack.router, workload))
        print(f"--- {mode.label}: {len(requests)} requests", flush=True)
        result = asyncio.run(_bench_mode(stack, requests, options, workload.seed))
    finally:
        stack.stop()
    if stack.trace_path.exists():
        png = plot_trace(
            stack.trace_path,
            results_dir / f"bubble-{mode.key}.png",
            title=f"{mode.label}: bubble {_bubbles(result)}",
        )
        result["trace"], result["png"] = str(stack.trace_path), str(png) if png else None
        if mode.tensor_parallel_size > 1:
            result["collective_fraction"] = collective_fractions(stack.trace_path)
    else:
        logger.warning("%s wrote no trace (see %s)", mode.label, stack.log_path)
    return result, requests


def collective_fractions(trace_path: Path) -> list[float]:
    """Per stage: time in tensor-parallel collectives / compute time, from the trace's steps."""
    busy: dict[int, float] = {}
    collective: dict[int, float] = {}
    for event in json.loads(trace_path.read_text())["traceEvents"]:
        if event.get("ph") == "X":
            tid = event["tid"]
            busy[tid] = busy.get(tid, 0.0) + event["dur"] / 1000.0
            collective[tid] = collective.get(tid, 0.0) + event["args"].get("collective_ms", 0.0)
    return [collective[tid] / busy[tid] if busy[tid] else 0.0 for tid in sorted(busy)]


def _bubbles(result: dict) -> str:
    return "/".join(f"{b:.0%}" for b in result.get("bubble_fraction", [])) or "n/a"


def ratios(results: dict[str, dict]) -> list[dict]:
    """The issue's ratios (value, target, met) from the modes' results present."""
    rows = []
    for name, num, den, metric, target, higher in RATIOS:
        if num in results and den in results and results[den].get(metric):
            value = results[num][metric] / results[den][metric]
            met = value >= target if higher else value <= target
            rows.append(
                {
                    "name": name,
                    "value": value,
                    "target": f"{'>=' if higher else '<='} {target}",
                    "met": met,
                }
            )
    if "async-2stage" in results:
        res = results["async-2stage"]
        tpot = res["single_request_tpot_ms"]
        rows.append(
            {
                "name": "single-request TPOT (ms), 2-stage async",
                "value": tpot,
                "target": "<= 40",
                "met": tpot <= 40,
            }
        )
        worst = max(res.get("bubble_fraction") or [float("nan")])
        rows.append(
            {
                "name": "async bubble, worst stage",
                "value": worst,
                "target": "<= 0.05",
                "met": worst <= 0.05,
            }
        )
    return rows


def comparison_table(results: dict[str, dict], ratio_rows: list[dict]) -> str:
    labels = {m.key: m.label for m in MODES} | {HF_KEY: "transformers static batch"}
    header = [
        "mode",
        "out tok/s",
        "req/s",
        "TTFT ms",
        "TPOT ms",
        "p99 ITL ms",
        "bubble",
        "all-reduce",
        "1-req TPOT ms",
        "others' cores",
    ]
    rows = []
    for key, res in results.items():
        rows.append(
            [
                labels.get(key, key),
                f"{res['output_throughput']:.1f}",
                f"{res['request_throughput']:.2f}",
                f"{res['mean_ttft_ms']:.0f}",
                f"{res['mean_tpot_ms']:.1f}",
                f"{res['p99_itl_ms']:.1f}" if "p99_itl_ms" in res else "-",
                _bubbles(res) if "bubble_fraction" in res else "-",
                "/".join(f"{f:.0%}" for f in res.get("collective_fraction", [])) or "-",
                f"{res['single_request_tpot_ms']:.1f}" if "single_request_tpot_ms" in res else "-",
                res.get("cpu", {}).get("other_cores", "-"),
            ]
        )
    ratio_grid = grid(
        ["ratio", "measured", "target", ""],
        [
            [r["name"], f"{r['value']:.2f}", r["target"], "ok" if r["met"] else "MISS"]
            for r in ratio_rows
        ],
    )
    note = (
        "others' cores: CPU used by other processes during the run (of "
        f"{os.cpu_count()}); ratios between runs with different values are noise"
    )
    return grid(header, rows) + "\n" + note + "\n\n" + ratio_grid


def run_compare(args: argparse.Namespace, workload: Workload, options: DriverOptions) -> int:
    from services.models.fetch import fetch_model

    model_dir = Path(args.model) if args.model else fetch_model("smollm2-135m")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    requests = None
    for mode in MODES:
        results[mode.key], requests = _run_mode(
            model_dir, mode, workload, options, results_dir, requests
        )
    if not args.skip_hf:
        from services.bench.hf_baseline import hf_static_batching

        print(f"--- transformers static batching: {len(requests)} requests", flush=True)
        meter = CpuMeter([os.getpid()])
        meter.start()
        results[HF_KEY] = hf_static_batching(model_dir, requests, threads=2)
        results[HF_KEY]["cpu"] = meter.stop()
    ratio_rows = ratios(results)
    report = {
        "workload": asdict(workload),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "model": str(model_dir),
        },
        "modes": results,
        "ratios": ratio_rows,
    }
    out = results_dir / "compare.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(comparison_table(results, ratio_rows), flush=True)
    print(f"\nwrote {out} and the traces / PNGs beside it", flush=True)
    failed = sum(r.get("failed", 0) for r in results.values())
    return 0 if failed == 0 else 1
