"""`conveyor bench --compare-routing`: the routing policies over two pipelines, and one
pipeline against two, on this machine (docs/scale-out.md).

    2 pipelines, --routing round-robin  ─┐  each a fresh `conveyor up --pipelines 2
    2 pipelines, --routing least-load    ├─ --stages 1` (cold caches); warm-up, then the
    2 pipelines, --routing prefix       ─┘  workload; hit rate from the schedulers' counters
    1 pipeline                              the same workload on `conveyor up --stages 1`

Size the workload with `--dataset prefix --num-prefixes N --prefix-len L` and
`--kv-cache-memory` so that the distinct prefixes fit in both pipelines' KV caches together
but not in one's: that is where prefix routing pays. Writes `routing.json` and prints a table
with the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import grpc

from services.bench.datasets import BenchRequest, random_requests
from services.bench.driver import DriverOptions, token_pool
from services.bench.report import grid
from services.bench.run import BenchTarget, Workload, run_benchmark
from services.bench.stack import Mode, RunningStack, start_stack
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-load", "prefix")
ONE_PIPELINE = "1-pipeline"


def scheduler_addresses(stack: RunningStack) -> list[str]:
    """Every pipeline's scheduler, as `conveyor up` printed them."""
    for line in stack.log_path.read_text().splitlines():
        if line.startswith("conveyor is serving") and "scheduler on " in line:
            return line.rsplit("scheduler on ", 1)[1].strip().split(",")
    return [stack.scheduler]


async def prefix_counters(addresses: list[str]) -> tuple[int, int]:
    """(hit, queried) prompt tokens of every pipeline's prefix cache."""
    hit = queried = 0
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        hit += stats.num_prefix_hit_tokens
        queried += stats.num_prefix_queried_tokens
    return hit, queried


async def _measure(stack: RunningStack, requests: list[BenchRequest], options) -> dict:
    addresses = scheduler_addresses(stack)
    pool = await token_pool(stack.router)
    quiet = DriverOptions(progress=False, ignore_eos=True)
    await run_benchmark(BenchTarget(stack.router, None, quiet), random_requests(pool, 4, 16, 4))
    hit0, queried0 = await prefix_counters(addresses)
    result = await run_benchmark(BenchTarget(stack.router, None, options), requests)
    hit1, queried1 = await prefix_counters(addresses)
    result["prefix_hit_rate"] = (hit1 - hit0) / max(1, queried1 - queried0)
    result["pipelines"] = len(addresses)
    return result


def _run(model_dir, key: str, pipelines: int, routing: str, workload, options, args):
    mode = Mode(key, key, stages=1, scheduling="async", threads=args.threads_per_worker)
    extra = ["--pipelines", str(pipelines), f"--router-arg=--routing={routing}"]
    if args.max_model_len:
        extra += ["--max-model-len", str(args.max_model_len)]
    stack = start_stack(
        model_dir, mode, Path(args.results_dir), args.kv_cache_memory, extra_args=extra
    )
    try:
        requests = workload.build(asyncio.run(token_pool(stack.router)))
        print(f"--- {key}: {len(requests)} requests", flush=True)
        return asyncio.run(_measure(stack, requests, options))
    finally:
        stack.stop()


def routing_table(results: dict[str, dict]) -> str:
    rows = [
        [
            key,
            f"{r['output_throughput']:.1f}",
            f"{r['request_throughput']:.2f}",
            f"{r['mean_ttft_ms']:.0f}",
            f"{r['prefix_hit_rate']:.2f}",
            str(r.get("failed", 0)),
        ]
        for key, r in results.items()
    ]
    table = grid(["routing", "out tok/s", "req/s", "mean TTFT ms", "hit rate", "failed"], rows)
    ratios = []
    rr, px, one = (results.get(k) for k in ("round-robin", "prefix", ONE_PIPELINE))
    if rr and px:
        ratios.append(["prefix / round-robin hit rate", _ratio(px, rr, "prefix_hit_rate")])
        ratios.append(["prefix / round-robin mean TTFT", _ratio(px, rr, "mean_ttft_ms")])
    if px and one:
        ratios.append(["2 / 1 pipelines throughput", _ratio(px, one, "output_throughput")])
    return table + "\n\n" + grid(["ratio", "measured"], ratios)


def _ratio(a: dict, b: dict, metric: str) -> str:
    return f"{a[metric] / b[metric]:.2f}" if b.get(metric) else "n/a"


def run_routing_compare(
    args: argparse.Namespace, workload: Workload, options: DriverOptions
) -> int:
    from services.models.fetch import fetch_model

    model_dir = Path(args.model) if args.model else fetch_model("smollm2-135m")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in POLICIES:
        results[policy] = _run(model_dir, policy, 2, policy, workload, options, args)
    results[ONE_PIPELINE] = _run(model_dir, ONE_PIPELINE, 1, "prefix", workload, options, args)
    out = results_dir / "routing.json"
    report = {
        "workload": asdict(workload),
        "kv_cache_memory": args.kv_cache_memory,
        "cpus": os.cpu_count(),
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(routing_table(results), flush=True)
    print(f"\nwrote {out}", flush=True)
    return 0 if all(r.get("failed", 0) == 0 for r in results.values()) else 1
