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
import time

import grpc

from services.common.pb import plan_to_pb
from services.common.redis_server import free_port
from services.worker.sim import MODELS_DIR
from tests.worker.test_joined_plans import _open_run, _plans, wait_ready

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


def _start_worker(stage: int, dist_addr: str, log) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = ["worker", "--model", str(MODEL_DIR), "--device", "sim", "--max-model-len", "512"]
    argv += ["--stage", str(stage), "--stages", "2", "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--dist-addr", dist_addr]
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "INFO", *argv]
    return f"127.0.0.1:{port}", subprocess.Popen(cmd, stderr=log, text=True)


async def _end_mid_join_then_form(stage0: str, stage1: str) -> list:
    plan = plan_to_pb(_plans([0, 0])[0], False).SerializeToString()
    async with (
        grpc.aio.insecure_channel(stage0) as channel0,
        grpc.aio.insecure_channel(stage1) as channel1,
    ):
        lost = _open_run(channel0)  # stage 1 never joins this one: as if it died mid-join
        await lost.initial_metadata()
        await asyncio.sleep(0.5)
        lost.cancel()
        epoch = str(time.time_ns())  # the next session's, the same for both stages
        calls = [_open_run(channel, epoch) for channel in (channel0, channel1)]
        for call in calls:
            await call.write(plan)
        report = await asyncio.wait_for(calls[1].read(), 60)
        for call in calls:
            call.cancel()
        return [report]


def test_a_session_ended_mid_join_does_not_hold_up_the_next(tmp_path):
    """A session that ends while its thread waits in the rendezvous for a stage that never
    came (it died mid-join) is not waited for: the next session, under other keys, forms at
    once, instead of after the old thread's join timeout."""
    dist_addr = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"stage{stage}.log", "w") for stage in (0, 1)]  # noqa: SIM115
    (stage0, proc0), (stage1, proc1) = (_start_worker(s, dist_addr, logs[s]) for s in (0, 1))
    try:
        wait_ready(stage0, proc0)
        wait_ready(stage1, proc1)
        reports = asyncio.run(_end_mid_join_then_form(stage0, stage1))
    finally:
        for proc in (proc0, proc1):
            proc.terminate()
            proc.wait(timeout=30)
        for log in logs:
            log.close()
    log0 = (tmp_path / "stage0.log").read_text()
    assert [(r.step_id, r.error, len(r.token_ids)) for r in reports] == [(0, "", 1)], log0[-3000:]
    assert "leaving an ended session's rendezvous to its thread" in log0, log0[-3000:]
    assert "abandoning a session stuck" not in log0, log0[-3000:]
