"""One `conveyor up` stack (SmolLM2-135M, 2 stages) shared by every end-to-end test."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.processes import logged_process

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 4096  # below the model's 8192: the router must learn it from `up`


@dataclass(frozen=True)
class StackInfo:
    """Addresses of a running stack."""

    router: str
    scheduler: str
    model_dir: Path
    http: str  # HOST:PORT of the OpenAI-compatible API


@pytest.fixture(scope="session")
def conveyor_stack(smollm2_dir, tmp_path_factory):
    """`conveyor up --model smollm2 --stages 2` on free ports, stopped at the end."""
    from services.cli import COMMANDS
    from services.launcher import wait_serving

    missing = [name for name in ("scheduler", "router") if name not in COMMANDS]
    if missing:
        pytest.fail(f"`conveyor {' '.join(missing)}` is not registered in services/cli.py yet")
    port, scheduler_port, http_port = free_port(), free_port(), free_port()
    log = (tmp_path_factory.mktemp("stack") / "conveyor-up.log").open("w")
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--model",
        str(smollm2_dir),
        "--stages",
        "2",
        "--port",
        str(port),
        "--scheduler-port",
        str(scheduler_port),
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--http-port",
        str(http_port),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    with logged_process(proc, log):
        wait_serving(f"127.0.0.1:{port}", 600, proc)
        yield StackInfo(
            f"127.0.0.1:{port}",
            f"127.0.0.1:{scheduler_port}",
            Path(smollm2_dir),
            f"127.0.0.1:{http_port}",
        )
