"""vLLM's CPU build with and without its n-gram speculative decoding, as the peer of
`conveyor bench --compare --speculative-config JSON --peers vllm-ngram` (issue 21).

    vllm serve MODEL --dtype D                                  -> "vLLM CPU"
    vllm serve MODEL --dtype D --speculative-config '{"method": "ngram", ...}'
                                                                -> "vLLM CPU + n-gram"

Both are sent Conveyor's own requests (token-id prompts, e.g. the repeat dataset, whose
outputs copy the prompt) by Conveyor's OpenAI-API driver (`--backend openai`: streamed
`/v1/completions`, greedy, EOS ignored), after a warm-up and one request alone, as the
Conveyor modes beside them. `vllm bench serve` is not used here: its random dataset does
not repeat. The acceptance comes from vLLM's Prometheus counters (`/metrics`) around the
workload.

When vLLM cannot serve with the speculative config (e.g. its CPU backend refuses it), the
row reports the error vLLM printed (`startup_error`) instead of figures.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request
from dataclasses import replace
from pathlib import Path

from services.bench.cpu import CpuMeter
from services.bench.datasets import BenchRequest
from services.bench.driver import DriverOptions
from services.bench.peers import vllm
from services.bench.run import BenchTarget, run_benchmark
from services.common.errors import ConfigError
from services.scheduler.speculative import SpeculativeConfig

KEY = "vllm"
NGRAM_KEY = "vllm-ngram"
VLLM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
"""The keys of Conveyor's `--speculative-config` that vLLM's has too (not `probe_interval`)."""
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
ERROR_LINE = re.compile(r"(Error|error:|not supported|NotImplemented|Exception)")


def vllm_speculative_config(conveyor_config: str) -> dict:
    """Conveyor's `--speculative-config` JSON as vLLM's, with Conveyor's defaults filled in
    (vLLM's differ: given only `prompt_lookup_max`, it takes `prompt_lookup_min` equal to
    it, where Conveyor looks down to 1); Conveyor's own `probe_interval` is left out."""
    try:
        config = SpeculativeConfig.from_json(conveyor_config)
    except ConfigError as exc:
        raise ValueError(f"--peers vllm-ngram: {exc}") from None
    if config.method != "ngram":
        raise ValueError(
            "--peers vllm-ngram compares n-gram speculation: a draft model config "
            '(method "draft_model") has no vLLM n-gram counterpart; pass '
            '\'{"method": "ngram", ...}\''
        )
    return {key: getattr(config, key) for key in VLLM_KEYS}


def spec_counters(metrics_text: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters in a Prometheus `/metrics` text (summed over
    their labels); counters vLLM does not export are left out."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in SPEC_COUNTERS.items():
            if re.match(rf"{re.escape(name)}(_total)?[{{ ]", line):
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance over a run, under the keys of Conveyor's scheduler stats: the share of
    proposed tokens accepted and the tokens a speculative step yields (accepted + 1)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    if not delta["draft_tokens"] or not delta["drafts"]:
        return {}
    return {
        "spec_acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"],
        "spec_mean_accepted_length": 1.0 + delta["accepted_tokens"] / delta["drafts"],
    }


def startup_error(message: str) -> str:
    """The line that says why vLLM stopped, from the end of its log in `message` (the last
    line naming an error), else the message's last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return (errors or lines or ["(no output)"])[-1][-400:]


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return spec_counters(reply.read().decode())


async def _bench(port: int, requests: list[BenchRequest], options: DriverOptions, pid: int):
    address = f"127.0.0.1:{port}"
    quiet = replace(options, progress=False, backend="openai")
    warmup = [BenchRequest(r.prompt_ids[:16], 8) for r in requests[:4]]
    await run_benchmark(BenchTarget(address, None, quiet), warmup)
    alone = await run_benchmark(BenchTarget(address, None, quiet), requests[:1])
    before = await asyncio.to_thread(_metrics, port)
    meter = CpuMeter([pid, os.getpid()])
    meter.start()
    result = await run_benchmark(
        BenchTarget(address, None, replace(options, backend="openai")), requests
    )
    result["cpu"] = meter.stop()
    result |= acceptance(before, await asyncio.to_thread(_metrics, port))
    result["single_request_tpot_ms"] = alone["mean_tpot_ms"]
    return result


def run_vllm_openai(
    run: vllm.VllmRun,
    requests: list[BenchRequest],
    options: DriverOptions,
    speculative_config: dict | None = None,
) -> dict:
    """Serves the model (speculatively with `speculative_config`), sends `requests` with
    Conveyor's OpenAI driver, stops it. A server that does not start is a result too:
    `{"startup_error": <vLLM's line>, "log": <path>}`."""
    try:
        with vllm.serving(run, speculative_config) as (port, _env, proc):
            return asyncio.run(_bench(port, requests, options, proc.pid))
    except RuntimeError as exc:
        if "vllm serve exited" not in str(exc):
            raise
        log = Path(run.results_dir) / (
            "vllm-serve-spec.log" if speculative_config else "vllm-serve.log"
        )
        return {"startup_error": startup_error(str(exc)), "log": str(log)}
