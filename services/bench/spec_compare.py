"""`conveyor bench --compare --speculative-config JSON`: one workload on 2 stages async,
without and with speculative decoding, on this machine.

    2 stages async                 ─┐  warm-up, the workload's first request alone (its
    2 stages async + speculation   ─┘  TPOT), then the whole workload with scheduler stats

Prints the TPOT and throughput ratios (speculative / plain) and the acceptance the
scheduler measured; writes `spec-compare.json` under the results directory. Run it with
`--dataset repeat` (outputs copy the prompt: proposals are accepted) and with
`--dataset random --temperature 1` (sampled outputs rarely repeat: little is accepted, and
adaptivity must keep the cost small).

With `--peers vllm-ngram`, vLLM's CPU build follows on the same requests, without and with
its n-gram speculation from the same config (`peers/vllm_spec.py`).
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
from services.bench.peers import vllm, vllm_spec
from services.bench.peers.venv import PeerVenv, peers_dir
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


def parse_spec_peers(text: str | None) -> tuple[str, ...]:
    """`--peers` beside `--speculative-config`: none, or vllm-ngram (vLLM without and with
    the same n-gram config)."""
    names = tuple(dict.fromkeys(n.strip() for n in (text or "").split(",") if n.strip()))
    if any(n != vllm_spec.NGRAM_KEY for n in names):
        raise ValueError(
            f"--peers {text!r} with --speculative-config: only {vllm_spec.NGRAM_KEY} "
            "(vLLM without and with the same n-gram speculation)"
        )
    return names


def _run_vllm_rows(args, model_dir: Path, options, results_dir: Path, requests) -> dict:
    """vLLM without and with its n-gram speculation on Conveyor's requests; a server that
    did not start is its row's `startup_error`."""
    base = Path(args.peers_dir) if args.peers_dir else peers_dir()
    venv = PeerVenv.for_spec(vllm.SPEC, base).ensure()
    vllm.fix_distribution(venv)
    cores = os.cpu_count() or 1
    run = vllm.VllmRun(venv, model_dir, args.dtype, f"0-{cores - 1}", 1, results_dir)
    config = vllm_spec.vllm_speculative_config(args.speculative_config)
    rows = {}
    for key, spec in ((vllm_spec.KEY, None), (vllm_spec.NGRAM_KEY, config)):
        print(f"--- {LABELS[key]}: {len(requests)} requests", flush=True)
        rows[key] = vllm_spec.run_vllm_openai(run, requests, options, spec)
        if "startup_error" in rows[key]:
            print(f"--- {LABELS[key]} did not start: {rows[key]['startup_error']}", flush=True)
    return rows


LABELS = {
    PLAIN.key: PLAIN.label,
    SPEC.key: SPEC.label,
    vllm_spec.KEY: "vLLM CPU, vllm serve",
    vllm_spec.NGRAM_KEY: "vLLM CPU + n-gram speculation",
}


def _cell(result: dict, key: str, fmt: str) -> str:
    value = result.get(key)
    return "-" if value is None else fmt.format(value)


def spec_table(modes: dict[str, dict]) -> str:
    """One row per system; a peer that did not start says so in its row."""
    header = ["system", "out tok/s", "TTFT ms", "TPOT ms", "1-req TPOT ms", "accepted", "tok/step"]
    rows, notes = [], []
    for key, res in modes.items():
        if "startup_error" in res:
            rows.append([LABELS.get(key, key), "did not start", *["-"] * (len(header) - 2)])
            notes.append(
                f"{LABELS.get(key, key)} did not start: {res['startup_error']} "
                f"(log: {res.get('log', '-')})"
            )
            continue
        rows.append(
            [
                LABELS.get(key, key),
                _cell(res, "output_throughput", "{:.1f}"),
                _cell(res, "mean_ttft_ms", "{:.0f}"),
                _cell(res, "mean_tpot_ms", "{:.1f}"),
                _cell(res, "single_request_tpot_ms", "{:.1f}"),
                _cell(res, "spec_acceptance_rate", "{:.0%}"),
                _cell(res, "spec_mean_accepted_length", "{:.2f}"),
            ]
        )
    return "\n".join([grid(header, rows), *notes])


def all_ratios(modes: dict[str, dict]) -> dict[str, float]:
    """Speculative / plain for Conveyor (and for vLLM when both its rows ran), and
    Conveyor's speculative row against vLLM's."""
    ratios = spec_ratios(modes[PLAIN.key], modes[SPEC.key])
    plain, ngram = modes.get(vllm_spec.KEY, {}), modes.get(vllm_spec.NGRAM_KEY, {})
    ran = [r for r in (plain, ngram) if r and "startup_error" not in r]
    if len(ran) == 2:
        ratios |= {f"vllm_{k}": v for k, v in spec_ratios(plain, ngram).items()}
    if ngram and "startup_error" not in ngram:
        ratios["conveyor_spec_over_vllm_ngram_tpot"] = (
            modes[SPEC.key]["mean_tpot_ms"] / ngram["mean_tpot_ms"]
        )
        ratios["conveyor_spec_over_vllm_ngram_throughput"] = (
            modes[SPEC.key]["output_throughput"] / ngram["output_throughput"]
        )
    return ratios


def run_spec_compare(args: argparse.Namespace, workload: Workload, options: DriverOptions) -> int:
    from services.models.fetch import fetch_model

    peers = parse_spec_peers(args.peers)
    model_dir = Path(args.model) if args.model else fetch_model("smollm2-135m")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    dtype = ["--dtype", args.dtype]
    plain, requests = _run(model_dir, PLAIN, workload, options, results_dir, None, dtype)
    spec_args = [*dtype, "--speculative-config", args.speculative_config]
    spec, _ = _run(model_dir, SPEC, workload, options, results_dir, requests, spec_args)
    modes = {PLAIN.key: plain, SPEC.key: spec}
    if peers:
        modes |= _run_vllm_rows(args, model_dir, options, results_dir, requests)
    ratios = all_ratios(modes)
    report = {
        "workload": asdict(workload),
        "speculative_config": json.loads(args.speculative_config),
        "temperature": options.temperature,
        "dtype": args.dtype,
        "modes": modes,
        "ratios": ratios,
    }
    out = results_dir / "spec-compare.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(spec_table(modes), flush=True)
    print(
        grid(
            ["ratio (speculative / plain; Conveyor / vLLM)", "measured"],
            [[k, f"{v:.2f}"] for k, v in ratios.items()],
        ),
        flush=True,
    )
    print(f"\nwrote {out}", flush=True)
    failed = sum(r.get("failed", 0) for r in modes.values())
    not_started = [key for key, r in modes.items() if "startup_error" in r]
    return 0 if failed == 0 and not not_started else 1
