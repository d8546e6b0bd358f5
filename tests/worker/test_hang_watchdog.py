"""A step that never ends ends its worker (`--hang-timeout`): a real worker process on the
simulated device, whose modeled hardware makes one step take an hour, exits with
HUNG_EXIT, naming the flag, so that its supervisor starts a fresh one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time

import grpc
import pytest

from services.common.errors import ConfigError
from services.common.pb import plan_to_pb
from services.common.redis_server import free_port
from services.common.sampling import SamplingParams
from services.common.step import NewRequest, StepPlan
from services.worker.config import WorkerConfig
from services.worker.server import HUNG_EXIT
from services.worker.sim import MODELS_DIR
from services.worker.sim.profiles import load_profile
from tests.worker.test_joined_plans import _open_run, wait_ready

MODEL_DIR = MODELS_DIR / "llama-3-8b"


def _start(tmp_path, hang_timeout_s: float) -> tuple[subprocess.Popen, str]:
    profile = load_profile("h100").to_dict()
    profile["step_overhead_s"] = 3600.0  # every step: an hour, as a wedged kernel
    path = tmp_path / "wedged.json"
    path.write_text(json.dumps(profile))
    port = free_port()
    argv = ["worker", "--model", str(MODEL_DIR), "--device", "sim", "--sim-profile", str(path)]
    argv += ["--stage", "0", "--stages", "1", "--port", str(port), "--max-model-len", "512"]
    argv += ["--dist-addr", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1"]
    argv += ["--hang-timeout", str(hang_timeout_s)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv], stderr=subprocess.PIPE, text=True
    )
    address = f"127.0.0.1:{port}"
    wait_ready(address, proc)
    return proc, address


async def _send_a_step(address: str) -> None:
    sampling = SamplingParams(ignore_eos=True)
    plan = StepPlan(0, new_requests=[NewRequest("a", [10, 11, 12], 3, sampling, [0], 0, 3)])
    async with grpc.aio.insecure_channel(address) as channel:
        call = _open_run(channel)
        await call.write(plan_to_pb(plan, False).SerializeToString())
        # the worker dies in the step: the stream breaks, no report comes
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await asyncio.wait_for(call.read(), 60)


def test_a_step_past_the_hang_timeout_ends_the_worker_with_hung_exit(tmp_path):
    proc, address = _start(tmp_path, hang_timeout_s=1.0)
    try:
        started = time.monotonic()
        asyncio.run(_send_a_step(address))
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
    finally:
        proc.kill()
    assert code == HUNG_EXIT, stderr[-2000:]
    assert "--hang-timeout" in stderr and "stage 0" in stderr, stderr[-2000:]
    assert time.monotonic() - started < 60  # long before the modeled hour


def test_hang_timeout_must_not_be_negative():
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        WorkerConfig(model_dir=str(MODEL_DIR), device="sim", hang_timeout_s=-1)
