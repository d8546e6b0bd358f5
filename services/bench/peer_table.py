"""The peers comparison's table: medians over rounds, ratios against the peers, and each
row's share of the machine's measured limits (pure functions of the recorded results)."""

from __future__ import annotations

import statistics

from services.bench.limits import MachineLimits, WorkModel
from services.bench.report import grid
from services.bench.run import Workload

LABELS = {
    "sync-2stage": "Conveyor 2 stages sync",
    "async-2stage": "Conveyor 2 stages async",
    "async-1stage": "Conveyor 1 stage (2 threads)",
    "async-1stage-1t": "Conveyor 1 stage (1 thread)",
    "tp2-1stage": "Conveyor 1 stage x 2 TP",
    "tp2-2stage": "Conveyor 2 stages x 2 TP",
    "vllm": "vLLM CPU, vllm serve",
    "conveyor-vllm-bench": "Conveyor via vllm bench serve",
    "openvino": "OpenVINO GenAI, in-process",
}
MEDIAN_KEYS = (
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "single_request_tpot_ms",
    "single_request_ttft_ms",
)
# (name, numerator, denominator, metric, target, higher is better): issue 15's targets.
TARGETS = (
    ("throughput, 2 stages async / vLLM", "async-2stage", "vllm", "output_throughput", 1.2, True),
    (
        "throughput, 2 stages async / OpenVINO",
        "async-2stage",
        "openvino",
        "output_throughput",
        1.0,
        True,
    ),
    ("mean TTFT, 2 stages async / vLLM", "async-2stage", "vllm", "mean_ttft_ms", 0.5, False),
    (
        "1-request ms/token, 2 stages async / OpenVINO",
        "async-2stage",
        "openvino",
        "single_request_tpot_ms",
        1.1,
        False,
    ),
    (
        "throughput, 2 stages async / 1 stage",
        "async-2stage",
        "async-1stage",
        "output_throughput",
        0.95,
        True,
    ),
    (
        "throughput, 1 stage on 2 threads / 1 thread",
        "async-1stage",
        "async-1stage-1t",
        "output_throughput",
        1.6,
        True,
    ),
    (
        "1-request ms/token, 1 stage on 1 thread / 2 threads",
        "async-1stage-1t",
        "async-1stage",
        "single_request_tpot_ms",
        1.6,
        True,
    ),
)


def medians(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per system: the median of each metric over the rounds it ran in, the throughput's
    range, its throughput per core it used (on a shared machine, each system gets the share
    of the cores that the others leave), and the most CPU other processes used in any of
    its rounds."""
    systems = list(dict.fromkeys(key for results in rounds for key in results))
    out: dict[str, dict] = {}
    for key in systems:
        runs = [results[key] for results in rounds if key in results]
        row: dict = {"rounds": len(runs)}
        for metric in MEDIAN_KEYS:
            values = [r[metric] for r in runs if r.get(metric) is not None]
            if values:
                row[metric] = statistics.median(values)
        per_core = [
            r["output_throughput"] / r["cpu"]["ours_cores"]
            for r in runs
            if r.get("cpu", {}).get("ours_cores")
        ]
        if per_core:
            row["throughput_per_core"] = statistics.median(per_core)
        tputs = [r["output_throughput"] for r in runs]
        row["output_throughput_range"] = [min(tputs), max(tputs)]
        others = [r.get("cpu", {}).get("other_cores") for r in runs]
        others = [o for o in others if o is not None]
        row["other_cores_max"] = max(others) if others else None
        out[key] = row
    return out


def _ratio(table: dict[str, dict], num: str, den: str, metric: str) -> float | None:
    if num in table and den in table and table[num].get(metric) and table[den].get(metric):
        return table[num][metric] / table[den][metric]
    return None


def target_ratios(table: dict[str, dict]) -> list[dict]:
    """Issue 15's ratios that the systems present allow, each with its target and verdict."""
    rows = []
    for name, num, den, metric, target, higher in TARGETS:
        value = _ratio(table, num, den, metric)
        if value is not None:
            met = value >= target if higher else value <= target
            rows.append(
                {
                    "name": name,
                    "value": value,
                    "target": f"{'>=' if higher else '<='} {target}",
                    "met": met,
                }
            )
    return rows


def shares(work: WorkModel, workload: Workload, limits: MachineLimits, row: dict) -> dict:
    """The row's achieved GF/s and its share of the peak, and its single-request ms/token
    against the memory-bandwidth floor (floor / measured: 1.0 is at the bound)."""
    flops_per_output = work.request_flops(workload.input_len, workload.output_len) / (
        workload.output_len
    )
    gflops = flops_per_output * row["output_throughput"] / 1e9
    context = workload.input_len + workload.output_len // 2
    floor_ms = work.decode_bytes(context, limits.dtype) / limits.read_gbps / 1e6
    out = {"gflops": gflops, "peak_share": gflops / limits.matmul_gflops, "floor_ms": floor_ms}
    if row.get("single_request_tpot_ms"):
        out["bandwidth_share"] = floor_ms / row["single_request_tpot_ms"]
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def peers_table(
    table: dict[str, dict], work: WorkModel, workload: Workload, limits: MachineLimits
) -> str:
    header = [
        "system",
        "out tok/s",
        "range",
        "x vLLM",
        "x OpenVINO",
        "TTFT ms",
        "TPOT ms",
        "1-req ms/tok",
        "GF/s (of peak)",
        "1-req floor/ms",
        "tok/s per core used",
        "others' cores",
    ]
    rows = []
    for key, row in table.items():
        share = shares(work, workload, limits, row)
        low, high = row["output_throughput_range"]
        rows.append(
            [
                LABELS.get(key, key),
                f"{row['output_throughput']:.1f}",
                f"{low:.0f}-{high:.0f}" if row["rounds"] > 1 else "-",
                _cell(_ratio(table, key, "vllm", "output_throughput"), "{:.2f}"),
                _cell(_ratio(table, key, "openvino", "output_throughput"), "{:.2f}"),
                _cell(row.get("mean_ttft_ms"), "{:.0f}"),
                _cell(row.get("mean_tpot_ms"), "{:.1f}"),
                _cell(row.get("single_request_tpot_ms"), "{:.1f}"),
                f"{share['gflops']:.0f} ({share['peak_share']:.0%})",
                _cell(share.get("bandwidth_share"), "{:.0%}"),
                _cell(row.get("throughput_per_core"), "{:.0f}"),
                _cell(row.get("other_cores_max"), "{}"),
            ]
        )
    return grid(header, rows)


def limits_note(work: WorkModel, workload: Workload, limits: MachineLimits) -> str:
    request_flops = work.request_flops(workload.input_len, workload.output_len)
    total = workload.num_prompts * request_flops
    bound_tps = limits.matmul_gflops * 1e9 * workload.output_len / request_flops
    floor = shares(work, workload, limits, {"output_throughput": 0})["floor_ms"]
    return (
        f"machine, measured by this run ({limits.threads} threads, {limits.dtype}): peak "
        f"matmul {limits.matmul_gflops:.0f} GF/s, memory read {limits.read_gbps:.0f} GB/s. "
        f"The workload is {total / 1e12:.2f} TFLOP: at most {bound_tps:.0f} tok/s at the peak; "
        f"one request reads {work.decode_bytes(0, limits.dtype) / 1e6:.0f} MB of weights + KV "
        f"per token: at least {floor:.1f} ms/token.\n"
        "GF/s (of peak): the workload's FLOPs over the run's time; 1-req floor/ms: that "
        "bandwidth floor over the measured single-request ms/token (100% = at the bound); "
        "tok/s per core used: the throughput over the cores the system's processes (and its "
        "bench client) used during the run; "
        "others' cores: the most CPU other processes used during the row's runs (ratios "
        "between rows measured under different outside load are noise)."
    )


def ratios_table(ratio_rows: list[dict]) -> str:
    return grid(
        ["ratio (medians)", "measured", "target", ""],
        [
            [r["name"], f"{r['value']:.2f}", r["target"], "ok" if r["met"] else "MISS"]
            for r in ratio_rows
        ],
    )
