"""A stage worker stopped while its session is still joining the pipeline exits cleanly.

Stage 1 of 2 (a real worker process on the simulated device) gets a session from a
scheduler; stage 0 never joins, so the session's thread sits in torch.distributed's
rendezvous when SIGTERM comes. The interpreter's exit would destroy torch's C++ objects
under that thread, which could abort the process (exit -6, "terminate called without an
active exception"): the worker leaves at once instead, with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc

from services.common.redis_server import free_port
from services.worker.sim import MODELS_DIR
from tests.worker.test_joined_plans import _open_run, wait_ready

MODEL_DIR = MODELS_DIR / "llama-3-8b"


async def _join_and_stop(address: str, proc: subprocess.Popen) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        call = _open_run(channel)
        await call.initial_metadata()  # the worker took the session: its thread is joining
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 60)


def test_a_worker_stopped_while_joining_the_pipeline_exits_with_status_0():
    port = free_port()
    argv = ["worker", "--model", str(MODEL_DIR), "--device", "sim", "--max-model-len", "512"]
    argv += ["--stage", "1", "--stages", "2", "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--dist-addr", f"127.0.0.1:{free_port()}"]
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "INFO", *argv]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{port}"
        wait_ready(address, proc)
        asyncio.run(_join_and_stop(address, proc))
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "exiting at once" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
