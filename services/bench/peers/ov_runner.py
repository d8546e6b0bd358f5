"""Runs inside the OpenVINO peer's virtualenv: the workload through OpenVINO GenAI's
in-process `ContinuousBatchingPipeline`, the prompts given as token ids (Conveyor's own).

    python -m services.bench.peers.ov_runner --model IR_DIR --requests REQ.json --out OUT.json \\
        --precision f32 --threads 2

Prints nothing but progress; writes one JSON object (see `run`). Imports only openvino,
numpy and the standard library (plus the stdlib-only services.bench.cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from services.bench.cpu import CpuMeter


def _config(max_new_tokens: int):
    import openvino_genai as og

    config = og.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = max_new_tokens  # EOS ignored: exactly this many
    config.ignore_eos = True
    config.do_sample = False
    return config


def _generate(pipe, prompts: list[list[int]], lengths: list[int]) -> tuple[float, int]:
    """(seconds, output tokens) of one generate() over every prompt at once."""
    import numpy as np
    import openvino as ov

    ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
    start = time.perf_counter()
    results = pipe.generate(ids, [_config(n) for n in lengths])
    seconds = time.perf_counter() - start
    return seconds, sum(len(r.m_generation_ids[0]) for r in results)


def _kv_precision(precision: str, cpuinfo: str) -> str:
    """OpenVINO's KV cache precision: the benched one, except bf16 on a CPU without
    AVX-512, where its CPU plugin's paged attention takes only an f32 cache ("expect kvcache
    type f32", OpenVINO 2026.4 on an AVX2 EPYC)."""
    if precision == "bf16" and "avx512bw" not in cpuinfo.split():
        return "f32"
    return precision


def _pipeline(model_dir: str, precision: str, threads: int, cache_gib: int):
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    scheduler.cache_size = cache_gib
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    properties = {
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": _kv_precision(precision, cpuinfo),
        "INFERENCE_NUM_THREADS": threads,
    }
    return og.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", properties)


def run(args: argparse.Namespace) -> dict:
    """Warm-up, one request alone (TTFT = a 1-token generate, TPOT from the difference),
    then every request at once."""
    requests = json.loads(Path(args.requests).read_text())
    prompts = [r["prompt_ids"] for r in requests]
    lengths = [r["output_len"] for r in requests]
    pipe = _pipeline(args.model, args.precision, args.threads, args.cache_gib)
    _generate(pipe, [p[:16] for p in prompts[:4]], [8] * min(4, len(prompts)))
    first_s, _ = _generate(pipe, prompts[:1], [1])
    alone_s, alone_tokens = _generate(pipe, prompts[:1], lengths[:1])
    meter = CpuMeter([os.getpid()])
    meter.start()
    seconds, tokens = _generate(pipe, prompts, lengths)
    cpu = meter.stop()
    return {
        "completed": len(prompts),
        "failed": 0,
        "duration_s": seconds,
        "total_output_tokens": tokens,
        "output_throughput": tokens / seconds,
        "request_throughput": len(prompts) / seconds,
        "single_request_ttft_ms": first_s * 1000,
        "single_request_tpot_ms": (alone_s - first_s) * 1000 / max(1, alone_tokens - 1),
        "cpu": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="OpenVINO IR directory")
    parser.add_argument("--requests", required=True, help="JSON: [{prompt_ids, output_len}]")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-gib", type=int, default=1)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(run(args), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
