"""`conveyor bench --compare --peers vllm,openvino` (`make bench-peers`): Conveyor's modes and
the CPU engines a user would pick instead, on one workload, alternating in one run.

    build each peer's venv (first use only) -> measure the machine's limits ->
    rounds x [2 stages sync, 2 stages async, 1 stage, vLLM, OpenVINO,
              Conveyor via vllm bench serve (peers/conveyor_http.py)] -> medians, one table

Conveyor's modes run as `--compare` runs them (`compare._run_mode`); the peers as
`peers/vllm.py` and `peers/openvino.py` describe. Every round writes under
`<results-dir>/round-N/`; the whole comparison goes to `<results-dir>/peers.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from services.bench.compare import MODES, _run_mode
from services.bench.cpu import CpuMeter
from services.bench.datasets import BenchRequest
from services.bench.driver import DriverOptions
from services.bench.limits import WorkModel, measure_limits
from services.bench.peer_table import limits_note, medians, peers_table, ratios_table, target_ratios
from services.bench.peers import conveyor_http, openvino, vllm
from services.bench.peers.venv import PeerVenv, peers_dir
from services.bench.run import Workload

logger = logging.getLogger(__name__)

SPECS = {"vllm": vllm.SPEC, "openvino": openvino.SPEC, conveyor_http.KEY: vllm.SPEC}
"""Each peer's venv; Conveyor measured by `vllm bench serve` runs that client from vLLM's."""
KV_CACHE_GIB = 1  # as Conveyor's stacks here (`--kv-cache-memory 1GiB`)


def parse_peers(text: str) -> tuple[str, ...]:
    """`vllm,openvino` -> ("vllm", "openvino"); unknown names are an error."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SPECS]
    if unknown or not names:
        raise ValueError(
            f"--peers {text!r}: unknown {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(SPECS)}"
        )
    return names


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _run_peer(
    name: str, venv: PeerVenv, model_dir: Path, dtype: str, requests, round_dir: Path
) -> dict:
    cores = os.cpu_count() or 1
    if name in ("vllm", conveyor_http.KEY):
        run = vllm.VllmRun(venv, model_dir, dtype, f"0-{cores - 1}", KV_CACHE_GIB, round_dir)
        if name == conveyor_http.KEY:
            stack_args = ["--dtype", dtype, "--startup-timeout", "900"]
            return conveyor_http.run_conveyor_http(run, _workload_of(requests), stack_args)
        return vllm.run_vllm(run, _workload_of(requests))
    run = openvino.OpenVinoRun(venv, model_dir, dtype, cores, KV_CACHE_GIB, round_dir)
    return openvino.run_openvino(run, requests)


def _workload_of(requests: list[BenchRequest]) -> Workload:
    """vLLM's random dataset of the same shape as Conveyor's requests."""
    return Workload(
        num_prompts=len(requests),
        input_len=len(requests[0].prompt_ids),
        output_len=requests[0].output_len,
    )


def _one_round(args, peers, venvs, model_dir, workload, options, round_dir, requests):
    results: dict[str, dict] = {}
    # a loaded shared machine can take minutes to start a stack (or build its C++ kernel)
    extra = ["--dtype", args.dtype, "--startup-timeout", "900"]
    for mode in MODES:
        try:
            results[mode.key], requests = _run_mode(
                model_dir, mode, workload, options, round_dir, requests, extra
            )
        except (RuntimeError, TimeoutError) as exc:
            logger.error("%s failed this round: %s", mode.label, exc)
    if requests is None:
        raise RuntimeError("no Conveyor stack started: nothing to give the peers")
    for name in peers:
        print(f"--- {name}: {len(requests)} requests", flush=True)
        try:
            results[name] = _run_peer(name, venvs[name], model_dir, args.dtype, requests, round_dir)
        except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
            logger.error("%s failed this round: %s", name, exc)
    return results, requests


def _report(args, workload, model_dir, measured, rounds) -> tuple[dict, str]:
    """(peers.json's content, the printed tables); `measured` = (limits, CpuMeter reading
    while they were measured)."""
    limits, limits_cpu = measured
    work = WorkModel.from_model_dir(model_dir)
    table = medians(rounds)
    ratio_rows = target_ratios(table)
    text = "\n\n".join(
        [
            peers_table(table, work, workload, limits),
            limits_note(work, workload, limits)
            + f" Others' cores while measuring the limits: {limits_cpu.get('other_cores', '-')}.",
            ratios_table(ratio_rows),
        ]
    )
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["conveyor", *sys.argv[1:]]),
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "workload": asdict(workload),
        "dtype": args.dtype,
        "limits": asdict(limits),
        "limits_cpu": limits_cpu,
        "medians": table,
        "ratios": ratio_rows,
        "rounds": rounds,
    }
    return report, text


def run_peer_compare(args: argparse.Namespace, workload: Workload, options: DriverOptions) -> int:
    from services.models.fetch import fetch_model

    peers = parse_peers(args.peers)
    model_dir = Path(args.model) if args.model else fetch_model("smollm2-135m")
    results_dir = Path(args.results_dir)
    base = Path(args.peers_dir) if args.peers_dir else peers_dir()
    venvs = {name: PeerVenv.for_spec(SPECS[name], base).ensure() for name in peers}
    for name, venv in venvs.items():
        if SPECS[name] is vllm.SPEC:
            vllm.fix_distribution(venv)
    print(f"--- measuring this machine's limits ({args.dtype})", flush=True)
    meter = CpuMeter([os.getpid()])
    meter.start()
    limits = measure_limits(args.dtype)
    limits_cpu = meter.stop()
    rounds, requests = [], None
    for number in range(1, args.rounds + 1):
        round_dir = results_dir / f"round-{number}"
        round_dir.mkdir(parents=True, exist_ok=True)
        print(f"=== round {number} of {args.rounds}", flush=True)
        results, requests = _one_round(
            args, peers, venvs, model_dir, workload, options, round_dir, requests
        )
        rounds.append(results)
        # after every round, so that a late failure keeps the rounds done
        report, text = _report(args, workload, model_dir, (limits, limits_cpu), rounds)
        out = results_dir / "peers.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['date']}, {report['machine']['cpu']}, {report['command']}\n", flush=True)
    print(text, flush=True)
    print(f"\nwrote {out} and each round's logs under {results_dir}/round-N/", flush=True)
    complete = all(name in results for results in rounds for name in peers)
    failed = sum(r.get("failed", 0) for results in rounds for r in results.values())
    return 0 if complete and failed == 0 else 1
