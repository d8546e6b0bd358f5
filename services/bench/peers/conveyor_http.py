"""Conveyor's OpenAI HTTP endpoint measured by `vllm bench serve`, the very client the vLLM
peer is measured with: the same random dataset, warm-up, lone request and workload
(`vllm.bench_sequence`), against `conveyor up` (2 stages, async scheduling) instead of
`vllm serve`. Beside the "2 stages async" row (Conveyor's own gRPC driver) it shows what the
client and the HTTP path change; beside the vLLM row it compares both servers under one
client.
"""

from __future__ import annotations

import json
import os
import urllib.request

from services.bench.peers import vllm
from services.bench.run import Workload
from services.bench.stack import Mode, start_stack

KEY = "conveyor-vllm-bench"
MODE = Mode(KEY, "2 stages async, via vllm bench serve", stages=2, scheduling="async", threads=1)


def served_model_name(http: str, timeout_s: float = 30.0) -> str:
    """The name Conveyor serves (GET /v1/models): the `model` every request must carry."""
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=timeout_s) as reply:
        return json.load(reply)["data"][0]["id"]


def run_conveyor_http(run: vllm.VllmRun, workload: Workload, stack_args: list[str]) -> dict:
    """Starts the stack (`stack_args`: e.g. --dtype), benches it, stops it."""
    stack = start_stack(run.model_dir, MODE, run.results_dir, extra_args=stack_args)
    try:
        host, port = stack.http.rsplit(":", 1)
        # the bench client's environment, as for the vLLM peer (its venv's libraries)
        env = vllm.serve_env(run, os.environ, vllm.preload_libraries(run.venv.root))
        return vllm.bench_sequence(
            run,
            int(port),
            env,
            workload,
            [stack.proc.pid],
            prefix="conveyor-",
            served_model_name=served_model_name(stack.http),
        )
    finally:
        stack.stop()
