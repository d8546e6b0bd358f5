"""One `conveyor up` stack, as a child process, for `conveyor bench --compare`.

Its logs go to a file; SIGTERM stops it, and the launcher stops the scheduler before the
workers, so the scheduler's `--timeline` trace is written on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.redis_server import free_port

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Mode:
    """A serving configuration to compare."""

    key: str  # used in file names and JSON
    label: str
    stages: int
    scheduling: str
    threads: int
    tensor_parallel_size: int = 1
    """Ranks per stage; above 1 the stack may have more workers than cores (--oversubscribe)."""


@dataclass
class RunningStack:
    """Addresses and process of a started stack."""

    mode: Mode
    router: str
    scheduler: str
    proc: subprocess.Popen
    trace_path: Path
    log_path: Path
    http: str = ""
    """HOST:PORT of the router's OpenAI-compatible HTTP API."""

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "conveyor up (%s) did not stop in %.0f s; killing it", self.mode.key, timeout_s
            )
            self.proc.kill()
            self.proc.wait()


def start_stack(
    model_dir: str | Path,
    mode: Mode,
    results_dir: Path,
    kv_cache_memory: str = "1GiB",
    startup_timeout_s: float = 600.0,
    extra_args: list[str] | None = None,
) -> RunningStack:
    """Starts `conveyor up` for `mode` (with `extra_args`, e.g. `--device sim`) and waits
    until its router is SERVING."""
    from services.launcher import wait_serving

    port, scheduler_port, http_port = free_port(), free_port(), free_port()
    trace = (results_dir / f"trace-{mode.key}.json").resolve()
    log_path = results_dir / f"stack-{mode.key}.log"
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        str(model_dir),
        "--stages",
        str(mode.stages),
        "--scheduling",
        mode.scheduling,
        "--threads",
        str(mode.threads),
        "--port",
        str(port),
        "--scheduler-port",
        str(scheduler_port),
        "--http-port",
        str(http_port),
        "--kv-cache-memory",
        kv_cache_memory,
        "--timeline",
        str(trace),
        *(extra_args or []),
    ]
    if mode.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(mode.tensor_parallel_size), "--oversubscribe"]
    logger.info("starting %s (log: %s)", mode.label, log_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    stack = RunningStack(
        mode,
        f"127.0.0.1:{port}",
        f"127.0.0.1:{scheduler_port}",
        proc,
        trace,
        log_path,
        http=f"127.0.0.1:{http_port}",
    )
    try:
        wait_serving(stack.router, startup_timeout_s, proc)
    except BaseException:
        stack.stop()
        logger.error(
            "%s did not start; the end of %s:\n%s",
            mode.label,
            log_path,
            log_path.read_text()[-3000:],
        )
        raise
    return stack
